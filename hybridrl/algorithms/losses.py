"""Masked tensor helpers and the RL losses (pure torch functions on [B, T] response tensors).

Conventions: `mask` is the response mask [B, T] (1 for real response tokens incl. EOS, 0 for padding).
Every reduction ignores padding, and a row (or a whole batch) of padding reduces to 0, never NaN.
Losses return (loss, stats) where stats are detached floats-as-tensors for logging.
"""
from __future__ import annotations

import torch

from hybridrl.algorithms.loss_agg import aggregate

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    masked = values * mask
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over entries where mask == 1; 0 where there are none."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries (Bessel-corrected when `unbiased` and more than one entry)."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    sq = masked_sum((values - mean) ** 2, mask)
    if unbiased and count > 1:
        return sq / (count - 1)
    return sq / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries of the whole tensor; padding comes out 0."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean",
                   norm_length: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar (the modes: hybridrl/algorithms/loss_agg.py)."""
    return aggregate(loss_mat, mask, mode, norm_length)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position: logits [..., V], labels [...] -> [...] (computed in fp32)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: logsumexp(z) - sum softmax(z) * z."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

    k1: log r with log r = logp - logp_ref (unbiased, high variance, can be negative).
    k2: (log r)^2 / 2 (low variance, biased).
    k3 / low_var_kl: exp(-log r) - 1 + log r (unbiased, >= 0; clamped to [-10, 10] for stability).
    abs: |log r|.
    """
    log_ratio = log_prob.float() - ref_log_prob.float()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator in ("k3", "low_var_kl"):
        neg = (-log_ratio).clamp(-20.0, 20.0)
        return (torch.exp(neg) - 1.0 - neg).clamp(-10.0, 10.0)
    if estimator == "abs":
        return log_ratio.abs()
    raise ValueError(f"KL estimator {estimator!r} is unknown (algorithm.kl.estimator); choose one of {KL_ESTIMATORS}")


def ppo_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
                    dual_clip: float | None = None,
                    agg_mode: str = "token_mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (ppo_policy_token_loss), aggregated by `agg_mode`."""
    loss_mat, stats = ppo_policy_token_loss(log_prob, old_log_prob, advantages, mask, clip_ratio, clip_ratio_high,
                                            dual_clip)
    return aggregate_loss(loss_mat, mask, agg_mode), stats


def ppo_policy_token_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                          mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
                          dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token [B, T]: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)).

    `dual_clip` (c > 1, Ye et al. 2020) further bounds the loss of negative-advantage tokens by -A c, so a
    token whose probability already rose a lot cannot produce an unbounded push down.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (or None to disable it)")
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + high)
    loss_mat = torch.maximum(unclipped, clipped)
    stats = {
        "clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
        "approx_kl": masked_mean(-log_ratio, mask).detach(),
    }
    if dual_clip is not None:
        bounded = torch.minimum(loss_mat, -advantages * dual_clip)
        stats["dual_clipfrac"] = masked_mean(((advantages < 0) & (bounded < loss_mat)).float(), mask).detach()
        loss_mat = torch.where(advantages < 0, bounded, loss_mat)
    return loss_mat, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_range: float | None = 0.2,
               agg_mode: str = "token_mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, +-eps)."""
    unclipped = (values - returns).square()
    if clip_range is None:
        loss_mat = unclipped
        clipfrac = torch.zeros((), dtype=values.dtype)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (clipped_values - returns).square()
        loss_mat = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).float(), mask).detach()
    return 0.5 * aggregate_loss(loss_mat, mask, agg_mode), {"vf_clipfrac": clipfrac}


def entropy_loss(logits: torch.Tensor, mask: torch.Tensor, agg_mode: str = "token_mean") -> torch.Tensor:
    """Mean entropy of the policy on response tokens (subtract coef * this from the loss as a bonus)."""
    return aggregate_loss(entropy_from_logits(logits), mask, agg_mode)


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor, estimator: str = "k3",
            agg_mode: str = "token_mean") -> torch.Tensor:
    """KL to the reference as a loss term (GRPO style): aggregate of the per-token estimate."""
    return aggregate_loss(kl_penalty(log_prob, ref_log_prob, estimator), mask, agg_mode)
