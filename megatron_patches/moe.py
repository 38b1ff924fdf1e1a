"""MoE without Transformer Engine and without CUDA.

1. Upstream: megatron/core/transformer/moe/moe_utils.py imports `te_general_gemm` only inside its
   `try: import transformer_engine` block, yet `RouterGatingLinearFunction.forward/backward` test
   `te_general_gemm is not None`; without TE that raises "NameError: name 'te_general_gemm' is not
   defined" on the first MoE router forward.
   Fix: define it as None when it is missing (the router then uses torch.matmul).
2. Upstream: the all-to-all token dispatcher turns its split sizes into numpy arrays with
   `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors; on CPU they stay
   tensors and `all_to_all_single` refuses them ("incompatible function arguments") at expert parallel > 1.
   Fix: convert CPU tensors too when numpy is asked for.
3. Upstream: with sequence parallelism the all-to-all dispatcher gathers / reduce-scatters the routed tokens
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

VERSIONS = SpecifierSet(">=0.16,<0.20")
CHECKED_ON = ("0.16.1",)
UPSTREAM = ("megatron/core/transformer/moe/moe_utils.py: te_general_gemm (RouterGatingLinearFunction), "
            "maybe_move_tensor_to_cpu (token_dispatcher.MoEAlltoAllTokenDispatcher split sizes)")


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
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
