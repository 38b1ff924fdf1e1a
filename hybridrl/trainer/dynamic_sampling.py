"""DAPO's dynamic sampling in the trainer: keep the batch full of prompt groups that carry a gradient.

A group whose n rewards are all equal has zero group-baseline advantage. Such groups are dropped and new
prompts are generated and scored, up to `max_refill_rounds` rounds, until the batch has as many informative
groups as it started with; if the rounds run out, dropped groups fill the rest (their advantage is 0, so they
only keep the batch shape that the data-parallel split and the metrics expect).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridrl.algorithms.shaping import informative_groups
from hybridrl.rollout.base import concat_batches
from hybridrl.rollout.types import Rollout


def select_groups(pieces: list[tuple[Any, torch.Tensor]], n: int, groups: int
                  ) -> tuple[list[tuple[int, int]], int]:
    """(piece, group) pairs to keep, informative ones first in order, and how many uninformative filled in."""
    informative, rest = [], []
    for p, (_, scores) in enumerate(pieces):
        for g, keep in enumerate(informative_groups(scores, n).tolist()):
            (informative if keep else rest).append((p, g))
    chosen = informative[:groups]
    filled = rest[:groups - len(chosen)]
    return chosen + filled, len(filled)


def gather_rollout(pieces: list[tuple[Rollout, torch.Tensor]], chosen: list[tuple[int, int]], n: int,
                   pad_token_id: int) -> tuple[Rollout, torch.Tensor]:
    """One Rollout (and its scores) of the chosen groups, re-padded to a common width."""
    rows = [[] for _ in pieces]
    for p, g in chosen:
        rows[p].extend(range(g * n, (g + 1) * n))
    used = [(p, r) for p, r in enumerate(rows) if r]
    batches = [pieces[p][0].sequences.index(r) for p, r in used]
    first = pieces[0][0]
    pick = [(pieces[p][0], r) for p, r in used]
    rollout = Rollout(concat_batches(batches, pad_token_id),
                      [o.texts[i] for o, r in pick for i in r], [o.prompt_texts[i] for o, r in pick for i in r],
                      [o.metadata[i] for o, r in pick for i in r], first.tokenizer)
    scores = torch.cat([pieces[p][1][torch.tensor(r)] for p, r in used])
    return rollout, scores


def refill(out: Any, scores: torch.Tensor, n: int, max_rounds: int,
           more: Callable[[int], tuple[Any, torch.Tensor]], pad_token_id: int) -> tuple[Any, torch.Tensor, dict]:
    """`more(round)` generates and scores one more batch of prompts. Returns the batch to train on and metrics."""
    groups = len(scores) // n
    pieces = [(out, scores)]
    first = informative_groups(scores, n)
    found, rounds = int(first.sum()), 0
    while found < groups and rounds < max_rounds:
        rounds += 1
        extra, extra_scores = more(rounds)
        pieces.append((extra, extra_scores))
        found += int(informative_groups(extra_scores, n).sum())
    metrics = {"dynamic_sampling/informative_fraction": float(first.float().mean()),
               "dynamic_sampling/refill_rounds": float(rounds)}
    if rounds == 0:
        return out, scores, {**metrics, "dynamic_sampling/filled_uninformative": float(groups - found)}
    chosen, filled = select_groups(pieces, n, groups)
    rollout, kept_scores = gather_rollout(pieces, chosen, n, pad_token_id)
    return rollout, kept_scores, {**metrics, "dynamic_sampling/filled_uninformative": float(filled)}
