"""Token layouts between rollout and training.

Rollouts come back as left-padded prompts [B, P] and right-padded responses [B, R]. Models are run on
"packed" sequences instead: each is prompt + response with no gap, positions 0..L-1, so a causal mask is
exact (padding only ever follows real tokens). Response token i of a sequence starting at column s of its
row is predicted at column s + prompt_length - 1 + i (workers/policy.py reads the model's outputs there).

Micro-batches (`micro_batches`) come in two shapes:
- rows: `micro_batch_size` sequences per micro-batch, one per row (the padded layout);
- token budget: rows of the longest sequence's width, several short sequences sharing a row where they fit
  (block-diagonal causal mask, positions restarting at 0), as many rows per micro-batch as
  `max_tokens_per_micro_batch` allows. A sequence never straddles rows, so attention costs what the padded
  batch costs at most, and no micro-batch computes on rows of padding.
Each micro-batch carries, per sequence, `row_of` / `seq_start` (where it lives) and the caller's per-sequence
tensors; `gather_at` reads a model output at per-sequence columns. Recorded expert routing (mixture-of-experts
rollouts, models/routing_replay.py) is packed like the tokens: "routed_experts" [rows, width, layers, topk].
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
    routing: torch.Tensor | None = None  # [B, L, moe_layers, topk] experts per packed token (-1: none)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


def pack(prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
         response_mask: torch.Tensor, pad_id: int = 0, multiple_of: int = 1,
         routing: torch.Tensor | None = None) -> PackedSequences:
    """Concatenate each row's real prompt and response tokens; right-pad to a common (rounded) length.
    routing [B, P+R, ...] (per token of prompts ++ responses) is packed the same way."""
    prompt_lengths = prompt_mask.sum(-1).long()
    response_lengths = response_mask.sum(-1).long()
    lengths = prompt_lengths + response_lengths
    width = int(lengths.max().item()) if lengths.numel() else 1
    width = max(1, -(-width // multiple_of) * multiple_of)
    out = torch.full((prompts.shape[0], width), pad_id, dtype=prompts.dtype)
    packed_routing = None
    if routing is not None:
        packed_routing = torch.full((prompts.shape[0], width, *routing.shape[2:]), -1, dtype=routing.dtype)
        real = torch.cat([prompt_mask, response_mask], dim=1).bool()
    for row in range(prompts.shape[0]):
        p = prompts[row][prompt_mask[row].bool()]
        r = responses[row][response_mask[row].bool()]
        out[row, : p.numel()] = p
        out[row, p.numel(): p.numel() + r.numel()] = r
        if routing is not None:
            packed_routing[row, : p.numel() + r.numel()] = routing[row][real[row]]
    return PackedSequences(out, lengths, prompt_lengths, responses.shape[1], packed_routing)


def _first_fit_rows(lengths: list[int], width: int, share_rows: bool) -> list[list[int]]:
    """Sequence indices per row: first-fit decreasing into rows of `width` tokens (one per row if not
    share_rows)."""
    if not share_rows:
        return [[i] for i in range(len(lengths))]
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(width - lengths[i])
    return rows


def micro_batches(packed: PackedSequences, extra: dict[str, torch.Tensor], *, micro_batch_size: int,
                  max_tokens: int | None = None, share_rows: bool = True, uniform: bool = False,
                  device: torch.device | str = "cpu", count: int | None = None) -> tuple[list[dict], list[int]]:
    """Cut packed sequences into micro-batches; returns (micro-batches, sequence order).

    The sequence order lists the sequence indices in the order the micro-batches hold them (concatenate
    per-sequence results, then put them back with `restore_order`). uniform=True (pipeline parallelism)
    gives every micro-batch the same number of rows (empty rows fill the last one; they hold no sequence).
    Rows mode: max_tokens None, `micro_batch_size` sequences per micro-batch.
    count: exactly this many micro-batches (at least the natural number, at most the sequences): the rows are
    spread over more, smaller micro-batches (one sequence per row if need be). Expert-parallel replicas must
    run the same number of forwards, their MoE layers exchanging tokens.
    """
    wanted, (count, width) = count, (packed.batch_size, packed.input_ids.shape[1])
    lengths = packed.lengths.tolist()
    if max_tokens is None:
        rows = [[i] for i in range(count)]
        rows_per_mb = min(micro_batch_size, count)
    else:
        if max_tokens < width:
            raise ValueError(f"max_tokens_per_micro_batch={max_tokens} is below the longest sequence's "
                             f"{width} tokens; raise it to at least {width}")
        rows = _first_fit_rows(lengths, width, share_rows)
        rows_per_mb = max_tokens // width
    groups = [rows[i:i + rows_per_mb] for i in range(0, len(rows), rows_per_mb)]
    if wanted is not None and wanted != len(groups):
        if not len(groups) <= wanted <= count:
            raise ValueError(f"{wanted} micro-batches asked for {count} sequences that need {len(groups)}")
        if len(rows) < wanted:  # unpack the shared rows: one sequence each
            rows = [[i] for members in rows for i in members]
        # contiguous groups, sizes differing by at most one (each within rows_per_mb: fewer than before)
        bounds = [len(rows) * k // wanted for k in range(wanted + 1)]
        groups = [rows[bounds[k]:bounds[k + 1]] for k in range(wanted)]
    out, order = [], []
    for group in groups:
        num_rows = rows_per_mb if uniform else len(group)
        ids = torch.zeros((num_rows, width), dtype=packed.input_ids.dtype)
        positions = torch.arange(width).repeat(num_rows, 1)
        blocks = torch.zeros((num_rows, width), dtype=torch.long)  # which sequence of the row a column holds
        seq, row_of, start_of = [], [], []
        for r, members in enumerate(group):
            start = 0
            for block, i in enumerate(members):
                n = lengths[i]
                ids[r, start:start + n] = packed.input_ids[i, :n]
                positions[r, start:start + n] = torch.arange(n)
                blocks[r, start:start + n] = block
                blocks[r, start + n:] = block + 1  # the row's padding: a block of its own
                seq.append(i)
                row_of.append(r)
                start_of.append(start)
                start += n
        index = torch.tensor(seq, dtype=torch.long)
        if packed.routing is not None:  # placed like the tokens; -1 (route as usual) elsewhere
            routed = torch.full((num_rows, width, *packed.routing.shape[2:]), -1, dtype=packed.routing.dtype)
            for i, r, start in zip(seq, row_of, start_of):
                routed[r, start:start + lengths[i]] = packed.routing[i, :lengths[i]]
        mb = {"input_ids": ids, "position_ids": positions, "row_of": torch.tensor(row_of),
              "seq_start": torch.tensor(start_of), "lengths": packed.lengths[index],
              "prompt_lengths": packed.prompt_lengths[index], "row_valid": torch.ones(len(seq)),
              **{k: v[index] for k, v in extra.items()}}
        if packed.routing is not None:
            mb["routed_experts"] = routed
        if any(len(members) > 1 for members in group):  # block-diagonal causal; True = masked (Megatron)
            causal = torch.ones((width, width), dtype=torch.bool).tril()
            allowed = causal & (blocks[:, :, None] == blocks[:, None, :])
            mb["attention_mask"] = ~allowed.unsqueeze(1)
        out.append({k: v.to(device) for k, v in mb.items()})
        order += seq
    return out, order


def packed_fill(batches: list[dict]) -> float:
    """The share of the positions the micro-batches compute ([rows, width] each) that hold a real token."""
    computed = sum(mb["input_ids"].numel() for mb in batches)
    return float(sum(int(mb["lengths"].sum()) for mb in batches)) / max(computed, 1)


def restore_order(results: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Per-sequence results in micro-batch order -> the original sequence order."""
    out = torch.empty_like(results)
    out[torch.tensor(order, dtype=torch.long)] = results
    return out


def gather_at(output: torch.Tensor, mb: dict, columns: torch.Tensor) -> torch.Tensor:
    """output [rows, W, ...] read at per-sequence columns [n, k] (relative to each sequence's start, clamped
    inside its row) -> [n, k, ...]."""
    rows, width = output.shape[:2]
    absolute = (mb["seq_start"].unsqueeze(1) + columns).clamp(0, width - 1)
    flat = output.reshape(rows * width, *output.shape[2:])
    return flat[mb["row_of"].unsqueeze(1) * width + absolute]
