"""What an algorithm's advantage estimator receives and returns (shared by the registry and the catalog)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AdvantageResult:
    advantages: torch.Tensor  # [B, T], 0 on padding
    returns: torch.Tensor  # [B, T], the critic's target (PPO / Safe-RLHF) or the return-to-go
    token_rewards: torch.Tensor  # [B, T], scores on the last token minus the KL penalty
    cost_returns: torch.Tensor | None = None  # [B, T], the cost critic's target (Safe-RLHF)


@dataclass
class AdvantageInputs:
    """One step's tensors, as the trainer has them. token_rewards [B, T] already hold the sequence scores on
    the last response token minus the per-token KL penalty (when the KL is a reward penalty)."""
    algorithm: str
    token_rewards: torch.Tensor
    mask: torch.Tensor  # [B, T] float, 1 on response tokens
    index: torch.Tensor | None = None  # [B] prompt group of each sample
    baseline_scores: torch.Tensor | None = None  # [B] greedy responses' rewards
    values: torch.Tensor | None = None  # [B, T] critic values
    cost_scores: torch.Tensor | None = None  # [B]
    cost_values: torch.Tensor | None = None  # [B, T]
    lagrange_multiplier: float | None = None
    gamma: float = 1.0
    lam: float = 0.95
    norm_by_std: bool = True

    def need(self, field: str, what: str):
        """The input `field`, or an error naming the role that should have produced it."""
        value = getattr(self, field)
        if value is None:
            raise ValueError(f"algorithm {self.algorithm!r} needs {field}: {what}")
        return value

    @property
    def sequence_scores(self) -> torch.Tensor:
        """[B] each response's penalised return: the sum of its token rewards."""
        return (self.token_rewards * self.mask).sum(-1)
