"""Token layouts between rollout and training.

Rollouts come back as left-padded prompts [B, P] and right-padded responses [B, R]. Models are run on
"packed" rows instead: each row is prompt + response with no gap, right-padded, positions 0..L-1, so a
plain causal mask is exact (padding only ever follows real tokens). These helpers convert both ways.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedSequences:
    input_ids: torch.Tensor  # [B, L] right-padded prompt+response
    lengths: torch.Tensor  # [B] real tokens per row
    prompt_lengths: torch.Tensor  # [B]
    response_width: int  # R: width of the response tensors this was built from

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


def pack(prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
         response_mask: torch.Tensor, pad_id: int = 0, multiple_of: int = 1) -> PackedSequences:
    """Concatenate each row's real prompt and response tokens; right-pad to a common (rounded) length."""
    prompt_lengths = prompt_mask.sum(-1).long()
    response_lengths = response_mask.sum(-1).long()
    lengths = prompt_lengths + response_lengths
    width = int(lengths.max().item()) if lengths.numel() else 1
    width = max(1, -(-width // multiple_of) * multiple_of)
    out = torch.full((prompts.shape[0], width), pad_id, dtype=prompts.dtype)
    for row in range(prompts.shape[0]):
        p = prompts[row][prompt_mask[row].bool()]
        r = responses[row][response_mask[row].bool()]
        out[row, : p.numel()] = p
        out[row, p.numel(): p.numel() + r.numel()] = r
    return PackedSequences(out, lengths, prompt_lengths, responses.shape[1])


def response_positions(packed: PackedSequences) -> torch.Tensor:
    """Index [B, R] of the position whose output predicts response token i (prompt_len - 1 + i), clamped."""
    offsets = torch.arange(packed.response_width).unsqueeze(0)
    positions = packed.prompt_lengths.unsqueeze(1) - 1 + offsets
    return positions.clamp(0, packed.input_ids.shape[1] - 1)


def next_tokens(packed: PackedSequences) -> torch.Tensor:
    """Labels for every position: the token that follows it (the last column repeats padding)."""
    labels = torch.roll(packed.input_ids, shifts=-1, dims=1)
    labels[:, -1] = packed.input_ids[:, -1]
    return labels


def gather_response(per_position: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
    """Pick the [B, R] entries of a [B, L] per-position tensor that belong to the response tokens."""
    return torch.gather(per_position, 1, response_positions(packed).to(per_position.device))


def last_token_index(packed: PackedSequences) -> torch.Tensor:
    """[B] position of each row's last real token (where reward models read their score)."""
    return (packed.lengths - 1).clamp(min=0)
