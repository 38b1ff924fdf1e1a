"""Token layouts between rollout and training.

Rollouts come back as left-padded prompts [B, P] and right-padded responses [B, R]. Models are run on
"packed" rows instead: each row is prompt + response with no gap, right-padded, positions 0..L-1, so a
plain causal mask is exact (padding only ever follows real tokens). Response token i of a row is predicted at
position prompt_length - 1 + i (workers/policy.py reads the model's outputs there).
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
