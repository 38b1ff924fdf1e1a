"""Advantage estimators (pure torch functions).

Shapes: responses are [B, T] with a response mask [B, T]; sequence-level scores are [B] and sit on the last
real token of each response (`place_sequence_rewards`); samples of the same prompt share a value of the
group `index` [B] (any integers). Rows with no real token get zero advantages and returns.
"""
from __future__ import annotations

import torch

from hybridrl.algorithms.losses import masked_whiten


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token per row [B] (-1 for an all-padding row)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=-1).values


def place_sequence_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence scores [B] -> token-level rewards [B, T]: the score on the last real token, 0 elsewhere."""
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    last = last_token_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    token_rewards[rows, last[rows]] = scores[rows].float()
    return token_rewards


def apply_kl_penalty(token_rewards: torch.Tensor, kl: torch.Tensor, kl_coef: float,
                     mask: torch.Tensor) -> torch.Tensor:
    """KL as a per-token reward penalty: r_t - beta * kl_t on real tokens."""
    return (token_rewards - kl_coef * kl) * mask


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k-t) r_k over the real tokens of each row (padding skipped, output 0)."""
    returns = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float32, device=token_rewards.device)
    for t in reversed(range(token_rewards.shape[1])):
        real = mask[:, t] > 0
        running = torch.where(real, token_rewards[:, t].float() + gamma * running, running)
        returns[:, t] = running * real
    return returns


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al.) over the real tokens of each row.

    delta_t = r_t + gamma V_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1}, where t+1 is the next real
    token (after the last one, V = 0 and A = 0). Returns (advantages, returns = A + V); the advantages are
    whitened over the batch when `whiten` (returns are not).
    """
    values = values.float()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], dtype=torch.float32, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        real = mask[:, t] > 0
        delta = token_rewards[:, t].float() + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(real, values[:, t], next_value)
        next_advantage = torch.where(real, advantage, next_advantage)
        advantages[:, t] = advantage * real
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _group_stats(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group size, group mean and unbiased group std (0 for groups of one)."""
    _, group = torch.unique(index, return_inverse=True)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    scores = scores.float()

    def group_sum(per_row: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=torch.float32, device=scores.device).index_add_(0, group, per_row)

    size = group_sum(torch.ones_like(scores))
    mean = group_sum(scores) / size
    sq = group_sum((scores - mean[group]) ** 2)
    std = torch.where(size > 1, (sq / (size - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return size[group], mean[group], std[group]


def grpo_outcome(scores: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, norm_by_std: bool = True,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: (r - mean_group) / (std_group + eps), the same for every token of a response.

    A group of one sample has no baseline: its advantage is 0. `norm_by_std=False` gives Dr. GRPO's
    mean-only centring. Returns (advantages, returns) with returns = advantages (no critic).
    """
    size, mean, std = _group_stats(scores, index)
    centred = scores.float() - mean
    if norm_by_std:
        centred = centred / (std + eps)
    advantages = torch.where(size > 1, centred, torch.zeros_like(centred))[:, None] * mask
    return advantages, advantages


def rloo(scores: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: r_i - mean_{j != i, same group} r_j = n/(n-1) (r_i - mean_group).

    A group of one sample has no other sample to compare with: its advantage is 0.
    """
    size, mean, _ = _group_stats(scores, index)
    leave_one_out = (scores.float() - mean) * size / (size - 1).clamp(min=1)
    advantages = torch.where(size > 1, leave_one_out, torch.zeros_like(leave_one_out))[:, None] * mask
    return advantages, advantages


def remax(token_rewards: torch.Tensor, baseline_scores: torch.Tensor,
          mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): return-to-go of the sampled response minus the greedy response's score.

    `token_rewards` [B, T] are the sampled responses' token rewards (score on the last token, minus any
    per-token KL penalty); `baseline_scores` [B] are the rewards of the greedy responses to the same
    prompts, generated this step. With no KL penalty A_t = r(sample) - r(greedy) on every token.
    """
    returns = discounted_returns(token_rewards, mask, gamma=1.0)
    advantages = (returns - baseline_scores.float()[:, None]) * mask
    return advantages, returns


def reinforce_plus_plus(token_rewards: torch.Tensor, mask: torch.Tensor,
                        gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go of the KL-penalised token rewards, whitened over
    all real tokens of the global batch (no critic, no per-prompt baseline).

    Pass token rewards that already include the per-token KL penalty (`apply_kl_penalty`).
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


def safe_rlhf_combine(reward_advantages: torch.Tensor, cost_advantages: torch.Tensor,
                      lagrange_multiplier: float, mask: torch.Tensor) -> torch.Tensor:
    """Safe-RLHF (Dai et al. 2023): (A_reward - lambda A_cost) / (1 + lambda).

    Dividing by 1 + lambda keeps the advantage scale bounded however large the multiplier grows.
    """
    if lagrange_multiplier < 0:
        raise ValueError(f"lagrange_multiplier={lagrange_multiplier} must be >= 0")
    combined = (reward_advantages - lagrange_multiplier * cost_advantages) / (1.0 + lagrange_multiplier)
    return combined * mask
