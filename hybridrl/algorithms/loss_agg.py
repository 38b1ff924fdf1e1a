"""How a per-token loss becomes the scalar the optimizer minimises (`algorithm.loss_agg`).

Every mode is a weighted token sum divided by a count of units, both additive over sequences, so the update
gets the exact mini-batch value however the sequences are split into micro-batches and DP ranks: each
micro-batch contributes sum(weights * loss) and the step divides by the units of the whole mini-batch.
  token_mean                every real token weighs the same (long responses weigh more)
  seq_mean_token_mean       mean over each response's tokens, then over responses
  seq_mean_token_sum        sum over each response's tokens, then mean over responses
  seq_mean_token_sum_norm   sum over tokens / (responses x a constant length): Dr.GRPO, no length bias
Responses without a real token count as no unit (except in the constant-length mode, where the constant is
the point).
"""
from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def check_loss_agg(mode: str, norm_length: int | None = None) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"algorithm.loss_agg={mode!r} is unknown; choose one of {', '.join(LOSS_AGG_MODES)}")
    if mode == "seq_mean_token_sum_norm" and not (norm_length and norm_length > 0):
        raise ValueError("loss_agg=seq_mean_token_sum_norm needs a constant length > 0 (rollout.max_new_tokens)")


def token_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """[B, T] weights of each token's loss in the numerator."""
    mask = mask.float()
    if mode == "seq_mean_token_mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return mask


def units(mask: torch.Tensor, mode: str, norm_length: int | None = None, rows: torch.Tensor | None = None) -> float:
    """The denominator's share of these sequences. `rows` [B] marks real sequences (0: filler rows)."""
    mask = mask.float()
    if mode == "token_mean":
        return float(mask.sum())
    if mode == "seq_mean_token_sum_norm":
        real = float(rows.sum()) if rows is not None else float(mask.shape[0])
        return real * float(norm_length)
    return float((mask.sum(-1) > 0).sum())


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean",
              norm_length: int | None = None) -> torch.Tensor:
    """The scalar of one whole batch (0 when it has no unit)."""
    check_loss_agg(mode, norm_length)
    return (token_weights(mask, mode) * loss_mat).sum() / max(units(mask, mode, norm_length), 1.0)
