"""Rollout / training mismatch: how far the rollout engine's log-probs are from the trainer's, and the
importance weights that correct for it.

The responses were sampled by the rollout engine (vLLM or the native engine, other kernels, maybe another
precision), so the policy-gradient expectation is over pi_rollout while the update's ratio is taken against
pi_old, the trainer's log-probs of the same tokens. The weight w = pi_old / pi_rollout re-weights each token
(or each sequence, w = prod over its tokens) back to pi_old:
  tis (truncated importance sampling): min(w, cap), the variance bounded at a small bias;
  mis (masked importance sampling): w where w <= cap, 0 (the token or sequence dropped) above it.
The weights are detached: they scale the advantages, they do not carry gradient.
"""
from __future__ import annotations

import torch

from hybridrl.algorithms.losses import kl_penalty, masked_mean

MODES = ("none", "tis", "mis")
LEVELS = ("token", "sequence")


def check_correction(mode: str, cap: float, level: str) -> None:
    if mode not in MODES:
        raise ValueError(f"algorithm.rollout_correction={mode!r} is unknown; choose one of {', '.join(MODES)}")
    if level not in LEVELS:
        raise ValueError(f"algorithm.rollout_correction_level={level!r} is unknown; choose token or sequence")
    if not cap > 1.0:
        raise ValueError(f"algorithm.rollout_correction_cap must be > 1 (a weight cap), got {cap}")


def mismatch_metrics(rollout_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """mismatch/log_prob_diff: mean |rollout - trainer| log-prob over response tokens; mismatch/kl: KL(rollout
    || trainer) per token (k3 estimate: the tokens were sampled by the rollout engine)."""
    rollout, trainer = rollout_log_probs.detach().float(), trainer_log_probs.detach().float()
    return {"mismatch/log_prob_diff": masked_mean((rollout - trainer).abs(), mask),
            "mismatch/kl": masked_mean(kl_penalty(rollout, trainer, "k3"), mask)}


def correction_weights(rollout_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor, mask: torch.Tensor,
                       mode: str, cap: float, level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, R] to multiply the advantages by, the fraction of tokens or sequences truncated / masked)."""
    mask = mask.float()
    log_w = (trainer_log_probs.detach().float() - rollout_log_probs.detach().float()) * mask
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(mask)
    w = torch.exp(log_w.clamp(max=20.0))  # exp(20) is far above any cap: the clamp only avoids inf
    over = (w > cap).float()
    if mode == "tis":
        weights = w.clamp(max=cap)
    elif mode == "mis":
        weights = w * (1.0 - over)
    else:
        raise ValueError(f"rollout correction {mode!r} has no weights (none means no correction)")
    if level == "sequence":
        has_tokens = (mask.sum(-1) > 0).float()
        fraction = (over[:, 0] * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    else:
        fraction = masked_mean(over, mask)
    return weights * mask, fraction
