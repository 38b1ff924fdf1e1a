"""The distributed optimizer's collectives over a data-parallel group of one rank.

Upstream: megatron/core/distributed/param_and_grad_buffer.py (`dist_reduce_scatter_func`,
`dist_all_gather_func`) reduce-scatter each bucket's gradients into this rank's shard and all-gather the
updated parameters back, every step. With one data-parallel rank the shard is the whole bucket, the same
memory as the input, and gloo still copies it: two full copies of the parameters per step (on the peer
job's 25M model ~0.1 s of a 3 s update) that change nothing.
Fix: skip the call when the group has one rank and output and input are the same memory (the result is
the input); any other call goes upstream.
Checked on megatron-core 0.16.1.
"""
from __future__ import annotations

from packaging.specifiers import SpecifierSet

from hybridrl.versions import MEGATRON_CORE, MEGATRON_CORE_CHECKED
from megatron_patches._base import replace, wraps

VERSIONS = SpecifierSet(MEGATRON_CORE)
CHECKED_ON = MEGATRON_CORE_CHECKED
UPSTREAM = "megatron/core/distributed/param_and_grad_buffer.py: dist_reduce_scatter_func, dist_all_gather_func"


def _same_memory(output, input_) -> bool:
    return output.data_ptr() == input_.data_ptr() and output.numel() == input_.numel() \
        and output.dtype == input_.dtype


def _skip_in_place_single_rank(collective):
    @wraps(collective)
    def call(output, input_, *args, group=None, async_op=False, **kwargs):
        import torch.distributed as dist

        if _same_memory(output, input_) and dist.get_world_size(group) == 1:
            return None  # nothing to wait for (an async caller waits on its empty coalescing manager)
        return collective(output, input_, *args, group=group, async_op=async_op, **kwargs)

    return call


def apply() -> None:
    from megatron.core.distributed import param_and_grad_buffer as buffers

    for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
        replace(buffers, name, _skip_in_place_single_rank(getattr(buffers, name)))
