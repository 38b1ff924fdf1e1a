"""Shared helpers of the patch modules: version ranges and marking what was replaced."""
from __future__ import annotations

import functools
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hybridrl.versions import MEGATRON_CORE, MEGATRON_CORE_CHECKED

# The megatron-core releases these shims are written for. 0.17-0.19 need Python >= 3.12 (not testable
# here); the same CPU checks were run by hand on 0.19.2 (Python 3.12) and passed. CI checks 0.16.1, the
# newest release for Python 3.11.
SUPPORTED = SpecifierSet(MEGATRON_CORE)
CHECKED_ON = MEGATRON_CORE_CHECKED

_ORIGINAL = "_hybridrl_original"


class UnsupportedMegatronVersion(RuntimeError):
    """megatron-core is a version the shims were not written for: refuse rather than mis-patch."""


def spec_text(spec: SpecifierSet) -> str:
    """'>=0.16,<0.20' (lower bounds first; SpecifierSet's own str() sorts them alphabetically)."""
    return ",".join(str(s) for s in sorted(spec, key=lambda s: (not s.operator.startswith(">"), s.version)))


def check_version(version: str, supported: SpecifierSet = SUPPORTED, what: str = "megatron_patches") -> None:
    """Raise UnsupportedMegatronVersion unless `version` lies in `supported`."""
    wanted = spec_text(supported)
    try:
        parsed = Version(version)
    except Exception as exc:  # packaging.version.InvalidVersion
        raise UnsupportedMegatronVersion(
            f"{what}: cannot parse megatron-core version {version!r}; install a release in "
            f"'megatron-core{wanted}' (checked on {', '.join(CHECKED_ON)})") from exc
    if parsed not in supported:
        raise UnsupportedMegatronVersion(
            f"{what}: megatron-core {version} is not supported by the CPU/gloo shims (supported: "
            f"'megatron-core{wanted}', checked on {', '.join(CHECKED_ON)}). Install a supported "
            f"release (pip install 'megatron-core{wanted}') or port and re-check megatron_patches/ "
            f"for {version}.")


def replace(owner: Any, name: str, new: Any) -> None:
    """Set owner.name = new, remembering the original once (so repeated apply() never double-wraps)."""
    old = getattr(owner, name)
    if getattr(old, _ORIGINAL, None) is not None:
        return  # already patched
    # For a staticmethod/classmethod, getattr(owner, name) yields the function: mark that.
    setattr(getattr(new, "__func__", new), _ORIGINAL, old)
    setattr(owner, name, new)


def is_patched(owner: Any, name: str) -> bool:
    return getattr(getattr(owner, name, None), _ORIGINAL, None) is not None


def original(owner: Any, name: str) -> Any:
    """The object that `replace` swapped out (or the current one when unpatched)."""
    current = getattr(owner, name)
    return getattr(current, _ORIGINAL, current)


def wraps(fn: Callable) -> Callable[[Callable], Callable]:
    """functools.wraps that tolerates builtins."""
    return functools.wraps(fn, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
