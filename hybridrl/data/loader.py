"""Reproducible, resumable prompt batches and the left-padding collate.

The loader walks epochs: each epoch is a permutation of the dataset drawn from (seed, epoch), cut into
fixed-size batches. Its state is just (epoch, batches taken in that epoch), so a run resumed from
`state_dict()` continues with exactly the next batch: no prompt skipped or repeated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from hybridrl.data.dataset import PromptDataset, PromptRow


@dataclass
class PromptBatch:
    input_ids: torch.Tensor  # [B, P] left-padded token ids
    attention_mask: torch.Tensor  # [B, P] 1 for real tokens
    texts: list[str]  # prompt strings, for reward functions
    metadata: list[dict[str, Any]]  # per-row extra columns, for reward functions
    indices: list[int]  # dataset positions

    def __len__(self) -> int:
        return len(self.texts)


def collate_prompts(rows: Sequence[PromptRow], pad_token_id: int, pad_to: int | None = None) -> PromptBatch:
    """Left-pad (so every prompt ends at the same column, where generation starts) to the longest prompt
    or to `pad_to`."""
    if not rows:
        raise ValueError("cannot collate an empty list of prompts")
    longest = max(len(row.input_ids) for row in rows)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        if n:
            input_ids[i, width - n:] = torch.tensor(row.input_ids, dtype=torch.long)
            attention_mask[i, width - n:] = 1
    return PromptBatch(input_ids, attention_mask, [row.text for row in rows],
                       [dict(row.metadata) for row in rows], [row.index for row in rows])


class StatefulPromptLoader:
    """Fixed-size prompt batches, shuffled per epoch from a seed, with an exact resumable position."""

    def __init__(self, dataset: PromptDataset, batch_size: int, pad_token_id: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True, pad_to: int | None = None) -> None:
        if batch_size <= 0:
            raise ValueError(f"data.batch_size={batch_size} must be > 0")
        if len(dataset) == 0:
            raise ValueError("the prompt dataset is empty (data.train_files)")
        if batch_size > len(dataset):
            raise ValueError(f"data.batch_size={batch_size} is larger than the dataset ({len(dataset)} prompts); "
                             "lower data.batch_size or add prompts")
        self.dataset = dataset
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pad_to = pad_to
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(len(self.dataset), generator=generator).tolist()
            else:
                self._order = list(range(len(self.dataset)))
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> PromptBatch:
        """The next batch, moving on to a freshly shuffled epoch when this one is used up."""
        if self.batch_in_epoch >= len(self):
            self.epoch += 1
            self.batch_in_epoch = 0
        order = self._epoch_order(self.epoch)
        start = self.batch_in_epoch * self.batch_size
        chosen = order[start:start + self.batch_size]
        self.batch_in_epoch += 1
        return collate_prompts([self.dataset[i] for i in chosen], self.pad_token_id, self.pad_to)

    def __iter__(self) -> Iterator[PromptBatch]:
        """The rest of the current epoch (a fresh epoch if the current one is finished)."""
        if self.batch_in_epoch >= len(self):
            self.epoch += 1
            self.batch_in_epoch = 0
        epoch = self.epoch
        while self.epoch == epoch and self.batch_in_epoch < len(self):
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; refuse a state from a different dataset or batching."""
        for key, current in (("seed", self.seed), ("batch_size", self.batch_size), ("shuffle", self.shuffle),
                             ("drop_last", self.drop_last), ("num_prompts", len(self.dataset))):
            if state[key] != current:
                raise ValueError(f"cannot resume the prompt loader: checkpoint has {key}={state[key]!r}, this run "
                                 f"{current!r} (use the same data.* settings and files to resume exactly)")
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
