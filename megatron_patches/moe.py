"""MoE on CPU through gloo (the router without Transformer Engine: moe_gemm.py, needed on GPUs without TE too).

1. Upstream: the all-to-all token dispatcher turns its split sizes into numpy arrays with
   `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors; on CPU they stay
   tensors and `all_to_all_single` refuses them ("incompatible function arguments") at expert parallel > 1.
   Fix: convert CPU tensors too when numpy is asked for.
2. Upstream: with sequence parallelism the all-to-all dispatcher gathers / reduce-scatters the routed tokens
   over the TP group in uneven pieces (tensor_parallel/mappings.py `_gather_along_first_dim` and
   `_reduce_scatter_along_first_dim` with split sizes); gloo's all_gather needs equal sizes ("invalid tensor
   size") and has no reduce_scatter.
   Fix: with split sizes, gather pieces padded to the largest and cut them back; reduce-scatter as an
   all-reduce of the whole tensor keeping this rank's piece (more traffic, the same sums).
Checked on megatron-core 0.16.1.
"""
from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from hybridrl.versions import MEGATRON_CORE, MEGATRON_CORE_CHECKED

VERSIONS = SpecifierSet(MEGATRON_CORE)
CHECKED_ON = MEGATRON_CORE_CHECKED
UPSTREAM = ("megatron/core/transformer/moe/moe_utils.py: maybe_move_tensor_to_cpu (token_dispatcher."
            "MoEAlltoAllTokenDispatcher split sizes); tensor_parallel/mappings.py uneven first-dim gather / scatter")


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    upstream = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and isinstance(tensor, torch.Tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _uneven_first_dim_collectives()


def _uneven_first_dim_collectives() -> None:
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)], dim=0)

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        torch.distributed.all_reduce(total, group=group)
        return torch.split(total, [int(n) for n in input_split_sizes], dim=0)[group.rank()].contiguous()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
