"""Reward shaping and sample filtering that DAPO (Yu et al. 2025) introduced; any algorithm may turn them on.

overlong_penalty: a response longer than max_new_tokens - buffer loses reward linearly, reaching -penalty at
max_new_tokens, so truncated answers are discouraged without a cliff.
informative_groups: a prompt group whose rewards are all equal has zero group-baseline advantage and gives no
gradient; dynamic sampling drops such groups and refills the batch with new prompts.
"""
from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """[B] penalties (<= 0) for response lengths [B]."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0.0)
    return -penalty * over / buffer


def informative_groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    """[B / n] bool: the group's n rewards are not all equal."""
    grouped = scores.view(-1, n)
    return (grouped.max(-1).values - grouped.min(-1).values) > 0


def fill_dropped(scores: torch.Tensor, keep: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B] scores where each dropped sample (keep False: a judge could not parse its verdict, on_parse_error=drop)
    takes the mean score of its group's kept samples (0 when none is kept), so it moves no group's mean; the
    trainer then leaves it out of the update."""
    scores = scores.float().clone()
    for group in torch.unique(index[~keep]):
        members = index == group
        kept = members & keep
        scores[members & ~keep] = scores[kept].mean() if kept.any() else 0.0
    return scores
