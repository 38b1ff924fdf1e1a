"""The per-token policy-gradient losses an algorithm can register (AlgorithmSpec.policy_loss).

Each takes log-probs under the current policy (with gradient), pi_old's (detached), advantages and the mask,
all [B, T], and returns (loss per token, stats); algorithm.loss_agg then reduces the tokens.
  ppo    clipped ratio per token: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) (losses.py)
  gspo   one ratio per sequence, s = exp(mean over its tokens of log r) (Zheng et al. 2025), clipped per
         sequence. Written per token as s_t = sg(s) * exp(logp_t - sg(logp_t)): its value is s and its
         gradient s * grad logp_t, so with seq_mean_token_mean the sum is exactly the sequence objective's.
  cispo  REINFORCE with a clipped, stop-gradient importance weight (MiniMax-M1, 2025):
         -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp_t: every token keeps a gradient, clipped or not.
"""
from __future__ import annotations

import torch

from hybridrl.algorithms.losses import masked_mean, ppo_policy_token_loss

POLICY_LOSSES = ("ppo", "gspo", "cispo")


def _bounds(clip_ratio: float, clip_ratio_high: float | None) -> tuple[float, float]:
    return 1.0 - clip_ratio, 1.0 + (clip_ratio if clip_ratio_high is None else clip_ratio_high)


def gspo_token_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_high: float | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = mask.float()
    log_ratio = (log_prob - old_log_prob) * mask
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    token_ratio = torch.exp((seq_log_ratio.detach() + log_prob - log_prob.detach()).clamp(-20.0, 20.0))
    low, high = _bounds(clip_ratio, clip_ratio_high)
    unclipped = -advantages * token_ratio
    clipped = -advantages * torch.clamp(token_ratio, low, high)
    loss = torch.maximum(unclipped, clipped)
    has_tokens = (mask.sum(-1) > 0).float()
    clipped_seq = ((clipped > unclipped).float() * mask).amax(-1)  # a sequence is clipped as a whole
    return loss, {"clipfrac": masked_mean(clipped_seq, has_tokens).detach(),
                  "approx_kl": masked_mean(-(log_prob - old_log_prob).detach(), mask)}


def cispo_token_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_high: float | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_ratio = (log_prob - old_log_prob).detach().clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    low, high = _bounds(clip_ratio, clip_ratio_high)
    weight = ratio.clamp(low, high)
    loss = -weight * advantages * log_prob
    return loss, {"clipfrac": masked_mean((weight != ratio).float(), mask),
                  "approx_kl": masked_mean(-log_ratio, mask)}


def policy_token_loss(name: str, log_prob, old_log_prob, advantages, mask, clip_ratio: float = 0.2,
                      clip_ratio_high: float | None = None, dual_clip: float | None = None):
    if name == "ppo":
        return ppo_policy_token_loss(log_prob, old_log_prob, advantages, mask, clip_ratio, clip_ratio_high,
                                     dual_clip)
    if dual_clip is not None:
        raise ValueError(f"dual_clip applies to the ppo policy loss, not {name!r}")
    if name == "gspo":
        return gspo_token_loss(log_prob, old_log_prob, advantages, mask, clip_ratio, clip_ratio_high)
    if name == "cispo":
        return cispo_token_loss(log_prob, old_log_prob, advantages, mask, clip_ratio, clip_ratio_high)
    raise ValueError(f"policy loss {name!r} is unknown; choose one of {', '.join(POLICY_LOSSES)}")
