"""One entry point from an algorithm name and a step's tensors to advantages and returns.

The trainer calls `compute_advantages` once per step; it places the sequence scores on the last token,
applies the per-token KL penalty (when the KL is a reward penalty) and dispatches to the estimator the
algorithm's registry entry names. Missing inputs are refused with the role that should produce them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.losses import masked_whiten
from hybridrl.algorithms.registry import get_algorithm


@dataclass
class AdvantageResult:
    advantages: torch.Tensor  # [B, T], 0 on padding
    returns: torch.Tensor  # [B, T], the critic's target (PPO / Safe-RLHF) or the return-to-go
    token_rewards: torch.Tensor  # [B, T], scores on the last token minus the KL penalty
    cost_returns: torch.Tensor | None = None  # [B, T], the cost critic's target (Safe-RLHF)


def _require(name: str, value: torch.Tensor | None, what: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"algorithm {name!r} needs {what}")
    return value


def compute_advantages(algorithm: str, scores: torch.Tensor, mask: torch.Tensor, *,
                       kl: torch.Tensor | None = None, kl_coef: float = 0.0,
                       index: torch.Tensor | None = None, baseline_scores: torch.Tensor | None = None,
                       values: torch.Tensor | None = None, cost_scores: torch.Tensor | None = None,
                       cost_values: torch.Tensor | None = None, lagrange_multiplier: float | None = None,
                       gamma: float = 1.0, lam: float = 0.95, norm_by_std: bool = True) -> AdvantageResult:
    """Advantages for `algorithm` (a name in ALGORITHMS).

    scores [B]: sequence rewards of the sampled responses. kl [B, T] with kl_coef > 0: per-token KL to the
    reference, subtracted from the token rewards (pass kl=None when the KL is a loss term instead).
    For group estimators (grpo, rloo) the group score is the sum of a response's penalised token rewards.
    Safe-RLHF: (A_reward - lambda A_cost) / (1 + lambda), each from GAE with its own critic, then whitened.
    """
    spec = get_algorithm(algorithm)
    mask = mask.float()
    token_rewards = adv.place_sequence_rewards(scores, mask)
    if kl is not None and kl_coef != 0.0:
        token_rewards = adv.apply_kl_penalty(token_rewards, kl, kl_coef, mask)
    if spec.advantage == "remax":
        baseline = _require(algorithm, baseline_scores, "baseline_scores: the greedy responses' rewards")
        a, r = adv.remax(token_rewards, baseline, mask)
        return AdvantageResult(a, r, token_rewards)
    if spec.advantage in ("grpo_outcome", "rloo"):
        group = _require(algorithm, index, "index: the prompt group of each sample (rollout.n >= 2)")
        sequence_scores = (token_rewards * mask).sum(-1)
        if spec.advantage == "grpo_outcome":
            a, r = adv.grpo_outcome(sequence_scores, mask, group, norm_by_std=norm_by_std)
        else:
            a, r = adv.rloo(sequence_scores, mask, group)
        return AdvantageResult(a, r, token_rewards)
    if spec.advantage == "reinforce_plus_plus":
        a, r = adv.reinforce_plus_plus(token_rewards, mask, gamma)
        return AdvantageResult(a, r, token_rewards)
    if spec.advantage == "gae" and not spec.needs_cost_model:
        critic_values = _require(algorithm, values, "values: the critic's values of the response tokens")
        a, r = adv.gae(token_rewards, critic_values, mask, gamma=gamma, lam=lam, whiten=True)
        return AdvantageResult(a, r, token_rewards)
    if spec.advantage == "gae":  # safe_rlhf
        critic_values = _require(algorithm, values, "values: the reward critic's values")
        costs = _require(algorithm, cost_scores, "cost_scores: the cost model's (or cost_fn's) scores")
        cost_critic = _require(algorithm, cost_values, "cost_values: the cost critic's values")
        multiplier = _require(algorithm, lagrange_multiplier, "lagrange_multiplier: LagrangeMultiplier.value")
        reward_adv, r = adv.gae(token_rewards, critic_values, mask, gamma=gamma, lam=lam, whiten=False)
        # The KL penalty is charged once, to the reward side.
        cost_adv, cost_r = adv.gae(adv.place_sequence_rewards(costs, mask), cost_critic, mask, gamma=gamma,
                                   lam=lam, whiten=False)
        combined = adv.safe_rlhf_combine(reward_adv, cost_adv, float(multiplier), mask)
        return AdvantageResult(masked_whiten(combined, mask), r, token_rewards, cost_r)
    raise AssertionError(f"registry names an unknown estimator {spec.advantage!r}")
