"""What a policy model computes on a micro-batch: response-token log-probs, entropy, and the actor loss.

Micro-batches come from workers/sequences.py `micro_batches`: rows of packed sequences ("input_ids"), and per
sequence "row_of" / "seq_start" / "prompt_lengths", "row_valid" and the per-response-token tensors the caller
passed ([n, R]). Response token i of a sequence is predicted at column prompt_length - 1 + i of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.algorithms.loss_agg import check_loss_agg, token_weights
from hybridrl.algorithms.losses import kl_penalty, masked_mean
from hybridrl.algorithms.policy_losses import check_policy_loss, policy_token_loss
from hybridrl.algorithms.rollout_correction import check_correction, correction_weights, mismatch_metrics
from hybridrl.workers.sequences import gather_at
from hybridrl.workers.vocab_parallel import token_log_probs


def response_index(mb: dict) -> torch.Tensor:
    """[n, R] columns (from each sequence's start) whose outputs predict the response tokens."""
    responses = mb["response_mask"].shape[1]
    offsets = torch.arange(responses, device=mb["input_ids"].device).unsqueeze(0)
    return mb["prompt_lengths"].unsqueeze(1) - 1 + offsets


def response_mask(mb: dict) -> torch.Tensor:
    """Response-token mask with filler sequences zeroed."""
    return mb["response_mask"].float() * mb["row_valid"].unsqueeze(1)


def response_log_probs(mb: dict, logits: torch.Tensor, vocab_size: int, tp_group,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) [n, R] (and entropy [n, R]) from this rank's vocab-parallel logits [rows, W, V/tp]."""
    columns = response_index(mb)
    # only the response positions are needed: select them before the softmax statistics
    picked_logits = gather_at(logits, mb, columns)
    picked_labels = gather_at(mb["input_ids"], mb, columns + 1)
    return token_log_probs(picked_logits, picked_labels, vocab_size=vocab_size, tp_group=tp_group,
                           with_entropy=with_entropy)


@dataclass
class PolicyLossConfig:
    """The actor's loss: PPO clip on the advantages, optional entropy bonus and KL-to-reference loss term."""

    clip_ratio: float = 0.2
    clip_ratio_high: float | None = None
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    rollout_correction: str = "none"  # none | tis | mis, from mb["rollout_log_probs"] (rollout_correction.py)
    rollout_correction_cap: float = 2.0
    rollout_correction_level: str = "token"  # token | sequence
    policy_loss: str = "ppo"  # a registered loss: ppo | gspo | cispo | a user's (algorithms/policy_losses.py)
    module: str | None = None  # algorithm.module: this worker imports it when it registers policy_loss
    loss_agg: str = "token_mean"  # algorithms/loss_agg.py; the step divides by the mini-batch's units
    loss_agg_length: int | None = None  # the constant of seq_mean_token_sum_norm (max_new_tokens)

    def __post_init__(self) -> None:
        check_correction(self.rollout_correction, self.rollout_correction_cap, self.rollout_correction_level)
        check_loss_agg(self.loss_agg, self.loss_agg_length)
        check_policy_loss(self.policy_loss, self.module, dual_clip=self.dual_clip)


def actor_loss_terms(mb: dict, logits: torch.Tensor, vocab_size: int, tp_group,
                     cfg: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(summed per-token loss, token count, metrics) of one micro-batch.

    Needs mb["advantages"] ([b, R]); mb["old_log_probs"] for PPO's ratio (absent: on-policy, ratio 1);
    mb["ref_log_probs"] when kl_loss_coef > 0. With mb["rollout_log_probs"] (the engine's) the rollout /
    trainer mismatch is measured against pi_old, and corrected when cfg.rollout_correction asks.
    """
    mask = response_mask(mb)
    log_probs, entropy = response_log_probs(mb, logits, vocab_size, tp_group, with_entropy=True)
    old = mb["old_log_probs"] if "old_log_probs" in mb else log_probs.detach()  # on-policy: ratio 1
    advantages, mismatch = mb["advantages"], {}
    if "rollout_log_probs" in mb:
        mismatch = mismatch_metrics(mb["rollout_log_probs"], old, mask)
        if cfg.rollout_correction != "none":
            weights, fraction = correction_weights(mb["rollout_log_probs"], old, mask, cfg.rollout_correction,
                                                   cfg.rollout_correction_cap, cfg.rollout_correction_level)
            advantages = advantages * weights  # w > 0 and detached: the clipped objective scales by w
            mismatch["mismatch/corrected_fraction"] = fraction
    pg_tokens, stats = policy_token_loss(cfg.policy_loss, log_probs, old, advantages, mask, cfg.clip_ratio,
                                         cfg.clip_ratio_high, cfg.dual_clip, module=cfg.module)
    weights = token_weights(mask, cfg.loss_agg)  # the step divides the sum by the mini-batch's units
    count = mask.sum()
    loss_sum = (weights * pg_tokens).sum()
    metrics = {"actor/pg_loss": masked_mean(pg_tokens.detach(), mask),  # then clipfrac, approx_kl, the loss's own
               **{f"actor/{key}": value for key, value in stats.items()},
               "actor/entropy": masked_mean(entropy.detach(), mask), **mismatch}
    if cfg.entropy_coef:
        loss_sum = loss_sum - cfg.entropy_coef * (entropy * weights).sum()
    if cfg.kl_loss_coef:
        kl = kl_penalty(log_probs, mb["ref_log_probs"], cfg.kl_estimator)
        loss_sum = loss_sum + cfg.kl_loss_coef * (kl * weights).sum()
        metrics["actor/kl_loss"] = masked_mean(kl.detach(), mask)
    return loss_sum, count, metrics
