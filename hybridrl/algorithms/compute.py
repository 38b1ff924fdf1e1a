"""One entry point from an algorithm name and a step's tensors to advantages and returns.

The trainer calls `compute_advantages` once per step: it places the sequence scores on the last token,
applies the per-token KL penalty (when the KL is a reward penalty) and hands the inputs to the estimator the
algorithm registered (hybridrl/algorithms/catalog/). Missing inputs are refused with the role that should
produce them.
"""
from __future__ import annotations

import torch

from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.registry import get_algorithm


def compute_advantages(algorithm: str, scores: torch.Tensor, mask: torch.Tensor, *,
                       kl: torch.Tensor | None = None, kl_coef: float = 0.0,
                       index: torch.Tensor | None = None, baseline_scores: torch.Tensor | None = None,
                       values: torch.Tensor | None = None, cost_scores: torch.Tensor | None = None,
                       cost_values: torch.Tensor | None = None, lagrange_multiplier: float | None = None,
                       gamma: float = 1.0, lam: float = 0.95, norm_by_std: bool = True) -> AdvantageResult:
    """Advantages for `algorithm` (a registered name).

    scores [B]: sequence rewards of the sampled responses. kl [B, T] with kl_coef > 0: per-token KL to the
    reference, subtracted from the token rewards (pass kl=None when the KL is a loss term instead).
    """
    spec = get_algorithm(algorithm)
    mask = mask.float()
    token_rewards = adv.place_sequence_rewards(scores, mask)
    if kl is not None and kl_coef != 0.0:
        token_rewards = adv.apply_kl_penalty(token_rewards, kl, kl_coef, mask)
    inputs = AdvantageInputs(algorithm, token_rewards, mask, index=index, baseline_scores=baseline_scores,
                             values=values, cost_scores=cost_scores, cost_values=cost_values,
                             lagrange_multiplier=lagrange_multiplier, gamma=gamma, lam=lam, norm_by_std=norm_by_std)
    return spec.estimator(inputs)
