"""What generation hands the driver: the `Rollout` (sequences + texts), built from the generation replicas'
per-rank results.

Every generation replica returns (replica index, Batch) from its collect rank and None elsewhere;
`rollouts_from_replicas` merges them in prompt order into one Batch per sampling setting and decodes the
responses. The Batch layout is rollout/base.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridrl.protocol import Batch
from hybridrl.rollout.base import SamplingParams, concat_batches

# the rollout fields every model forward reads (actor, reference, critic, reward model)
SEQUENCE_KEYS = ("prompts", "responses", "attention_mask", "response_mask")


@dataclass
class Rollout:
    """Generated sequences: the Batch the rollout engine returned, plus decoded texts.

    sequences: Batch with prompts / responses / input_ids / attention_mask / response_mask /
               rollout_log_probs (see rollout/base.py); prompt-major when n > 1.
    prompt_texts, metadata: one per response (a prompt's are repeated n times).
    tokenizer: the actor's, which made the token ids (a reward model reuses them when it shares it).

    Per-token tensors ([B, R], e.g. log_probs) are right-padded to the batch's longest response R and are 0 on
    padding. So `x.mean(dim=-1)` is each row's SUM over its own tokens divided by the same R for every row:
    the sequence total scaled by 1/R, not a per-token mean (short responses count less). `masked_mean(x)`
    divides by each response's own length instead; `(x * mask).sum(-1)` is the sequence total.
    """

    sequences: Batch
    texts: list[str]
    prompt_texts: list[str]
    metadata: list[dict]
    tokenizer: Any = None

    @property
    def log_probs(self) -> torch.Tensor:
        """[B, R] log-prob of each sampled token under the sampling distribution (0 on padding)."""
        return self.sequences["rollout_log_probs"]

    @property
    def mask(self) -> torch.Tensor:
        """[B, R] 1.0 on generated tokens."""
        return self.sequences["response_mask"].float()

    def masked_mean(self, x: torch.Tensor) -> torch.Tensor:
        """[B]: the mean of x [B, R] over each response's own tokens (padding excluded)."""
        mask = self.mask
        if x.shape != mask.shape:
            raise ValueError(f"masked_mean: x of shape {tuple(x.shape)} is not per response token {tuple(mask.shape)}")
        return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)

    @property
    def finish_reasons(self) -> list[str]:
        return list(self.sequences.non_tensors["finish_reasons"])

    def __len__(self) -> int:
        return len(self.sequences)


def as_sequences(actions: Any) -> Batch:
    """The sequences Batch of a Rollout (or the Batch itself)."""
    if isinstance(actions, Rollout):
        return actions.sequences
    if isinstance(actions, Batch):
        return actions
    raise TypeError(f"pass the sequences as the Rollout (or its .sequences Batch) from generate_sequences, "
                    f"got {type(actions).__name__}")


def policy_inputs(sequences: Any) -> Batch:
    """What the actor's forwards read: the sequences, and the experts the rollout routed them to when it
    recorded them (mixture-of-experts models, rollout routing measure / replay)."""
    sequences = as_sequences(sequences)
    recorded = ("routed_experts",) if "routed_experts" in sequences.tensors.keys() else ()
    return sequences.select(*SEQUENCE_KEYS, *recorded)


def merge_replicas(results: list, pad_token_id: int = 0) -> Batch:
    """The per-rank generate results -> one Batch in prompt order (replica 0's rows first)."""
    parts = sorted((r for r in results if r is not None), key=lambda item: item[0])
    if not parts:
        raise RuntimeError("no generation replica returned sequences")
    return concat_batches([batch for _, batch in parts], pad_token_id)


def max_timing(results: list) -> dict[str, float]:
    """Stage seconds of a generate call: the slowest replica's (they run in parallel)."""
    timing: dict[str, float] = {}
    for item in results:
        if item is not None:
            for key, value in item[1].meta.get("timing", {}).items():
                timing[key] = max(timing.get(key, 0.0), value)
    return timing


def decode_responses(tokenizer: Any, sequences: Batch) -> list[str]:
    responses, mask = sequences["responses"], sequences["response_mask"].bool()
    return tokenizer.batch_decode([r[m].tolist() for r, m in zip(responses, mask)], skip_special_tokens=True)


def rollouts_from_replicas(results: list, all_params: list[SamplingParams], texts: list[str], metadata: list[dict],
                           tokenizer: Any) -> list[Rollout]:
    """One Rollout per sampling setting from the replicas' results (each (replica, [Batch per setting]) or
    None); prompt texts and metadata repeated n times per prompt. Each Batch's meta keeps the slowest
    replica's stage times ("timing")."""
    pad = tokenizer.pad_token_id or 0
    rollouts = []
    for i, params in enumerate(all_params):
        per_replica = [None if r is None else (r[0], r[1][i]) for r in results]
        sequences = merge_replicas(per_replica, pad)
        sequences.meta["timing"] = max_timing(per_replica)
        row_steps = [r[1].meta["decode_row_steps"] for r in per_replica
                     if r is not None and "decode_row_steps" in r[1].meta]
        if row_steps:  # the native engine's decode work (rows x sampling steps), summed over the replicas
            sequences.meta["decode_row_steps"] = sum(row_steps)
        rollouts.append(Rollout(sequences, decode_responses(tokenizer, sequences),
                                [t for t in texts for _ in range(params.n)],
                                [m for m in metadata for _ in range(params.n)], tokenizer))
    return rollouts


def group_index(sequences: Batch, groups: int, n: int) -> torch.Tensor:
    """[B] the prompt group of each row: the rows' own "group_index" where the rollout carries one (agent runs,
    whose runs may split into several trajectories or be dropped), else n rows per prompt, prompt-major."""
    own = sequences.non_tensors.get("group_index")
    if own is not None:
        return torch.as_tensor(np.asarray(own, dtype=np.int64))
    return torch.arange(groups).repeat_interleave(n)


def group_baseline(scores: torch.Tensor, source: Batch, target: Batch, groups: int, n: int) -> torch.Tensor:
    """[len(target)] for each row of `target` (n per prompt) the mean score of `source`'s rows (one per prompt,
    e.g. ReMax's greedy responses) of the same prompt group; 0 for a group without a source row."""
    src, dst = group_index(source, groups, 1), group_index(target, groups, n)
    sums = torch.zeros(groups, dtype=scores.dtype).index_add_(0, src, scores)
    counts = torch.zeros(groups, dtype=scores.dtype).index_add_(0, src, torch.ones_like(scores))
    return (sums / counts.clamp(min=1))[dst]
