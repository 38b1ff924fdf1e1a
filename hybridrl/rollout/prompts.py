"""Prompts on the driver: encoding them for the engines (left-padded ids) and checking that prompts a caller
passes along with sequences are the ones the sequences were generated from.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from hybridrl.data.loader import PromptBatch
from hybridrl.protocol import Batch


def encode_prompts(tokenizer: Any, prompts: Any) -> tuple[Batch, list[str], list[dict]]:
    """Prompts as a left-padded Batch (+ texts, metadata): strings (tokenised), token-id lists, a PromptBatch
    or a Batch."""
    if isinstance(prompts, PromptBatch):
        return Batch({"input_ids": prompts.input_ids, "attention_mask": prompts.attention_mask}), \
            list(prompts.texts), list(prompts.metadata)
    if isinstance(prompts, Batch):
        texts = list(prompts.non_tensors.get("prompt_texts", [""] * len(prompts)))
        return prompts.select("input_ids", "attention_mask"), texts, [{} for _ in texts]
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
    if all(isinstance(p, str) for p in prompts):
        ids = tokenizer(list(prompts))["input_ids"]
        texts = list(prompts)
    else:
        ids = [list(map(int, p)) for p in prompts]
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    if any(len(row) == 0 for row in ids):
        raise ValueError("an empty prompt: every prompt needs at least one token")
    input_ids, mask = left_pad(ids, tokenizer.pad_token_id or 0)
    return Batch({"input_ids": input_ids, "attention_mask": mask}), texts, [{} for _ in texts]


def left_pad(ids: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> left-padded [B, P] ids and their attention mask (generation starts at column P)."""
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
        mask[i, width - len(row):] = 1
    return input_ids, mask


def _real_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def check_prompts(tokenizer: Any, prompts: Any, sequences: Batch, caller: str) -> None:
    """`prompts` must be the prompts `sequences` were generated from, in order (n sequences per prompt)."""
    batch, _, _ = encode_prompts(tokenizer, prompts)
    given = _real_rows(batch["input_ids"], batch["attention_mask"])
    width = sequences["prompts"].shape[1]
    held = _real_rows(sequences["prompts"], sequences["attention_mask"][:, :width])
    if len(held) % len(given):
        raise ValueError(f"{caller}: {len(given)} prompts for {len(held)} sequences (give the prompts the sequences "
                         f"were generated from)")
    n = len(held) // len(given)
    for i, row in enumerate(held):
        if row != given[i // n]:
            raise ValueError(f"{caller}: prompt {i // n} is not the prompt of sequence {i}; pass the prompts the "
                             f"sequences were generated from, in the same order (they are tokenised with this "
                             f"role's tokenizer: give it tokenizer= when its model folder has none)")


def prompt_texts_of(prompts: Any) -> list[str]:
    """The texts of prompts given as strings or a PromptBatch."""
    if isinstance(prompts, PromptBatch):
        return list(prompts.texts)
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not all(isinstance(p, str) for p in prompts):
        raise TypeError("reward prompts must be a list of strings (or a PromptBatch)")
    return list(prompts)


def repeat_per_response(prompts: list[str], responses: int) -> list[str]:
    """One prompt per response: prompts given once per n responses are repeated (prompt-major)."""
    if not prompts or responses % len(prompts):
        raise ValueError(f"{responses} responses for {len(prompts)} prompts (give one prompt per response or "
                         f"per n responses)")
    n = responses // len(prompts)
    return [p for p in prompts for _ in range(n)]


def check_prompt_texts(given: list[str], held: list[str]) -> None:
    """Prompt texts a caller passed against the rollout's own (one per response), in order."""
    expanded = repeat_per_response(given, len(held))
    for i, (a, b) in enumerate(zip(expanded, held)):
        if a != b:
            raise ValueError(f"reward_model.score: prompt {a!r} is not the prompt of response {i} ({b!r}); pass the "
                             f"prompts the rollout was generated from, in order")
