"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary. The softmax statistics are combined
with all-reduces over the TP group: the max (no gradient needed) and two sums through Megatron's
`reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward: every rank computes
the same loss, so each rank's local logits receive exactly their own gradient). Padded vocabulary entries
(Megatron rounds the vocabulary up to a multiple of TP) are excluded, so the numbers equal a softmax over
the real vocabulary, as the rollout engines sample it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_NEG = -1e30  # finite "minus infinity": exp() gives 0 and 0 * _NEG stays finite


def _tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int, tp_group=None,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(labels) [...] and, optionally, the entropy [...] of softmax(logits) over the real vocabulary.

    logits [..., V_local] is this rank's vocabulary slice (rank r holds [r * V_local, (r + 1) * V_local));
    labels [...] are global token ids. Computed in fp32; differentiable.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    tp = _tp_size(tp_group)
    local = logits.shape[-1]
    start = (dist.get_rank(tp_group) if tp > 1 else 0) * local
    if start + local > vocab_size:  # this slice holds padding columns
        column = torch.arange(start, start + local, device=logits.device)
        logits = logits.masked_fill(column >= vocab_size, _NEG)

    def tp_sum(x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(x, group=tp_group) if tp > 1 else x

    maximum = logits.detach().max(dim=-1).values
    if tp > 1:
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - maximum.unsqueeze(-1)
    exp = shifted.exp()
    log_z = tp_sum(exp.sum(dim=-1)).log()
    in_slice = (labels >= start) & (labels < start + local)
    local_label = (labels - start).clamp(0, local - 1)
    picked = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1) * in_slice
    log_probs = tp_sum(picked) - log_z
    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v * shifted_v, with p_v = exp_v / Z
        entropy = log_z - tp_sum((exp * shifted).sum(dim=-1)) / log_z.exp()
    return log_probs, entropy
