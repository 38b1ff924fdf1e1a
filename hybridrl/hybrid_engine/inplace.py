"""The in-place (hybrid) reshard's schedule and the training-storage release, used by reshard.Resharder.

InPlaceSchedule: the generation-buffer layout of one micro-DP group's generation shard (stage by stage, each
tensor contiguous, no padding) and the ordered collectives that fill it; identical on every member, computed
from the members' parameter metadata. TrainingStorage: frees the training tensors' storages while generating
and gives them back. See reshard.py for the design and what is copied where.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hybridrl.hybrid_engine.model_shapes import CONCAT, GATED_HALVES

_LAYER_NAME = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")  # Megatron decoder.layers.N, HF model.layers.N


def numel_of(shape) -> int:
    return int(torch.Size(shape).numel())


@dataclass(frozen=True)
class Part:
    """One member's piece of a collective: rows [row, row+rows) along dim 0 of `src` (on the member) land in
    rows of the generation tensor `dst` narrowed to [start, start+length) along `dim`."""
    member: int
    src: str
    row: int
    rows: int
    dst: str
    dim: int
    start: int
    length: int
    dst_row: int


@dataclass(frozen=True)
class Op:
    """One collective. In place (the output is the generation buffer itself):
      "gather": every member puts one part (in member order); "broadcast": parts[0].member sends one part.
    Packed (many small transfers in one collective, through a scratch bucket and one copy into place):
      "packed_gather": every member sends its parts (member-major, each member's in a fixed order) packed
      into one slot of equal size; "packed_broadcast": parts[0].member sends all the parts, packed."""
    kind: str
    parts: tuple[Part, ...]

    @property
    def packed(self) -> bool:
        return self.kind.startswith("packed_")


class InPlaceSchedule:
    """Generation-buffer layout and the ordered collectives of one micro-DP group (identical on its members)."""

    def __init__(self, groups, member_meta: list, gen_names: set[str] | None,
                 bucket_elems: int, alone_elems: int | None = None) -> None:
        self.s_t, self.s_p, self.d_g = groups.tp_stride, groups.pp_stride, groups.micro_dp_size
        self.member_meta = member_meta
        self.gen_names = gen_names
        by_member = [{m.name: m for m in metas} for _, metas in member_meta]
        for i, metas in enumerate(by_member):  # TP ranks of one stage hold the same parameters
            ref = by_member[(i // self.s_t) * self.s_t]
            if {n: m.shape for n, m in metas.items()} != {n: m.shape for n, m in ref.items()}:
                raise ValueError(f"micro-DP member {i} holds different parameters than its stage's first TP rank")
        self.by_member = by_member
        # generation tensors: merged stage by stage, each contiguous in the buffer, no padding
        self.layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for pp_off in range(self.s_p):
            for _, meta in self._stage(pp_off):
                if gen_names is not None and meta.name not in gen_names:
                    continue
                shape = list(meta.shape)
                if meta.partition_dim is not None:
                    shape[meta.partition_dim] *= self.s_t
                self.layout[meta.name] = (offset, tuple(shape))
                offset += numel_of(shape)
        self.numel = offset
        # every tensor piece's in-place transfer, then the collectives that carry them: a transfer whose output
        # reaches alone_elems runs as its own in-place collective, smaller ones share packed collectives of up
        # to one bucket (a collective's fixed cost dwarfs copying a small tensor once)
        self.transfers = self._schedule(bucket_elems)
        alone = max(1, bucket_elems // 8) if alone_elems is None else alone_elems
        self.ops = self._coalesce(self._merge_broadcasts(self.transfers), bucket_elems, alone)

    def _stage(self, pp_off: int) -> list[tuple[str, object]]:
        """(stage-local key, meta) of a merged training stage, in training order."""
        metas = self.member_meta[pp_off * self.s_t][1]
        layers = [int(m.group(2)) for m in (_LAYER_NAME.match(x.name) for x in metas) if m]
        first = min(layers, default=0)
        out = []
        for meta in metas:
            match = _LAYER_NAME.match(meta.name)
            key = f"{match.group(1)}{int(match.group(2)) - first}{match.group(3)}" if match else meta.name
            out.append((key, meta))
        return out

    def _parts_of(self, member: int, meta) -> list[tuple[int, int, int, int, int]]:
        """(src row, rows, dim, start, length) per sub-part the member contributes to its tensor `meta`."""
        tp_off = member % self.s_t
        if meta.partition_dim is None:
            return [(0, meta.shape[0], 0, 0, meta.shape[0])] if tp_off == 0 else []  # the owner only
        if self.s_t == 1:
            return [(0, meta.shape[0], 0, 0, meta.shape[0])]
        dim, n = meta.partition_dim, meta.shape[meta.partition_dim]
        if meta.regroup == GATED_HALVES:
            if dim != 0 or n % 2:
                raise ValueError(f"{meta.name}: gated fc1 must split dim 0 into [gate; up], got shape {meta.shape}")
            half = n // 2
            return [(0, half, 0, tp_off * half, half), (half, half, 0, self.s_t * half + tp_off * half, half)]
        if meta.regroup != CONCAT:
            raise ValueError(f"unknown regroup rule {meta.regroup!r} for {meta.name}")
        return [(0, meta.shape[0], dim, tp_off * n, n)]

    def _schedule(self, bucket_elems: int) -> list[Op]:
        stages = [dict(self._stage(p)) for p in range(self.s_p)]
        keys = list(dict.fromkeys(k for stage in stages for k in stage))
        ops: list[Op] = []
        for key in keys:
            # sub-part j of every member holding `key` (skipping tensors the generation model does not need)
            subparts: dict[int, list[Part]] = {}
            for member in range(self.d_g):
                meta = stages[member // self.s_t].get(key)
                if meta is None or meta.name not in self.layout:
                    continue
                for j, (row, rows, dim, start, length) in enumerate(self._parts_of(member, meta)):
                    subparts.setdefault(j, []).append(Part(member, meta.name, row, rows, meta.name, dim, start,
                                                            length, 0))
            for parts in subparts.values():
                shapes = {self._piece_shape(p) for p in parts}
                if len(parts) == self.d_g and len(shapes) == 1:
                    ops += self._split("gather", parts, bucket_elems)
                else:
                    for part in parts:
                        ops += self._split("broadcast", [part], bucket_elems)
        return ops

    def _merge_broadcasts(self, transfers: list[Op]) -> list[Op]:
        """One broadcast of an equal-shaped piece from each member (e.g. the embedding's TP halves from the first
        stage and the output layer's from the last) is one all-gather, each piece into its own place: all
        members send at once instead of one sender after another. Same pieces, same bytes."""
        by_shape: dict[tuple[int, ...], dict[int, list[int]]] = {}
        for i, op in enumerate(transfers):
            if op.kind == "broadcast":
                by_shape.setdefault(self._piece_shape(op.parts[0]), {}).setdefault(op.parts[0].member, []).append(i)
        merged: dict[int, Op] = {}
        for senders in by_shape.values():
            if self.d_g < 2 or len(senders) < self.d_g:
                continue
            for k in range(min(len(found) for found in senders.values())):
                indices = [senders[member][k] for member in range(self.d_g)]  # parts in member order
                merged[min(indices)] = Op("gather", tuple(transfers[i].parts[0] for i in indices))
                merged.update({i: None for i in indices if i != min(indices)})
        return [merged.get(i, op) for i, op in enumerate(transfers) if merged.get(i, op) is not None]

    def _coalesce(self, transfers: list[Op], bucket_elems: int, alone_elems: int) -> list[Op]:
        """Group small transfers into packed collectives (gathers together, broadcasts by sender), each
        outputting at most one bucket; large in-place transfers stay single collectives, in order."""
        ops: list[Op] = []
        gathers: list[Part] = []
        broadcasts: dict[int, list[Part]] = {}
        sizes = {"gather": 0}

        def flush_gathers() -> None:
            if gathers:
                by_member = sorted(gathers, key=lambda p: p.member)  # stable: each member's parts keep order
                ops.append(Op("packed_gather", tuple(by_member)) if len(gathers) > self.d_g
                           else Op("gather", tuple(gathers)))
                gathers.clear()
                sizes["gather"] = 0

        def flush_broadcast(member: int) -> None:
            parts = broadcasts.pop(member, [])
            if parts:
                ops.append(Op("packed_broadcast", tuple(parts)) if len(parts) > 1 else Op("broadcast", tuple(parts)))
                sizes.pop(member, None)

        for op in transfers:
            elems = sum(self.piece_numel(p) for p in op.parts)
            in_place = all(p.dim == 0 for p in op.parts)  # a dim-1 column block needs a copy anyway
            if in_place and elems >= alone_elems:
                ops.append(op)
                continue
            key = "gather" if op.kind == "gather" else op.parts[0].member
            # a packed gather also needs the member's own send slot (1/d_g of it) beside its output
            limit = bucket_elems * self.d_g // (self.d_g + 1) if key == "gather" else bucket_elems
            if sizes.get(key, 0) + elems > limit:
                flush_gathers() if key == "gather" else flush_broadcast(key)
            if key == "gather":
                gathers.extend(op.parts)
            else:
                broadcasts.setdefault(key, []).extend(op.parts)
            sizes[key] = sizes.get(key, 0) + elems
        flush_gathers()
        for member in list(broadcasts):
            flush_broadcast(member)
        return ops

    def piece_numel(self, part: Part) -> int:
        return numel_of(self._piece_shape(part))

    def _piece_shape(self, part: Part) -> tuple[int, ...]:
        meta = self.by_member[part.member][part.src]
        return (part.rows,) + tuple(meta.shape[1:])

    def _split(self, kind: str, parts: list[Part], bucket_elems: int) -> list[Op]:
        """Cut into row pieces so that one collective's output stays within the bucket."""
        shape = self._piece_shape(parts[0])
        row_numel = numel_of(shape[1:])
        rows = shape[0]
        step = max(1, min(rows, bucket_elems // max(1, len(parts) * row_numel)))
        return [Op(kind, tuple(Part(p.member, p.src, p.row + r, min(step, rows - r), p.dst, p.dim, p.start,
                                      p.length, r) for p in parts)) for r in range(0, rows, step)]

    def dst_view(self, views: dict[str, torch.Tensor], part: Part) -> torch.Tensor:
        target = views[part.dst]
        if part.dim != 0 or part.start != 0 or part.length != target.shape[0]:
            target = target.narrow(part.dim, part.start, part.length)
        return target.narrow(0, part.dst_row, part.rows)

    def placed_by(self, member: int) -> set[str]:
        """Names of the member's training tensors it places entirely into the buffer (its slots)."""
        placed: dict[str, int] = {}
        for op in self.ops:
            for p in op.parts:
                if p.member == member:
                    placed[p.src] = placed.get(p.src, 0) + p.rows * numel_of(self._piece_shape(p)[1:])
        return {n for n, count in placed.items() if count == numel_of(self.by_member[member][n].shape)}


class TrainingStorage:
    """Frees and restores the storages of the rank's training tensors (FSDP-style storage resize: every view,
    Megatron DDP's bucket buffers and optimizer shards included, stays valid). A storage is freed only if it
    is resizable, our tensors tile it without overlap, and the bytes between them are zero (DDP padding), so
    restoring loses nothing."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.storages: list = []
        self.members: list[list[str]] = []
        index: dict[int, int] = {}
        self.storage_of: dict[str, int] = {}
        for name, t in tensors.items():
            st = t.untyped_storage()
            if st.data_ptr() not in index:
                index[st.data_ptr()] = len(self.storages)
                self.storages.append(st)
                self.members.append([])
            self.members[index[st.data_ptr()]].append(name)
            self.storage_of[name] = index[st.data_ptr()]
        self.tensors = tensors
        self.sizes = [st.nbytes() for st in self.storages]
        self.freed = [False] * len(self.storages)

    def _bytes(self, i: int) -> torch.Tensor:
        device = self.tensors[self.members[i][0]].device
        return torch.empty(0, dtype=torch.uint8, device=device).set_(self.storages[i], 0, (self.sizes[i],))

    def _restorable(self, i: int) -> bool:
        tensors = [self.tensors[n] for n in self.members[i]]
        if not self.storages[i].resizable() or any(not t.is_contiguous() for t in tensors):
            return False
        spans = sorted((t.storage_offset() * t.element_size(), (t.storage_offset() + t.numel()) * t.element_size())
                       for t in tensors)
        raw, cursor = self._bytes(i), 0
        for start, end in spans + [(self.sizes[i], self.sizes[i])]:
            if start < cursor or bool(raw[cursor:start].any()):
                return False  # overlapping tensors, or something else lives between them: keep it
            cursor = end
        return True

    def releasable(self) -> set[str]:
        """Names of the tensors whose storages release() will free."""
        return {n for i in range(len(self.storages)) if self._restorable(i) for n in self.members[i]}

    def release(self, names: set[str]) -> int:
        """Free the storages of `names` (from releasable()); returns the bytes freed."""
        freed = 0
        for i in sorted({self.storage_of[n] for n in names}):
            self.storages[i].resize_(0)
            self.freed[i] = True
            freed += self.sizes[i]
        return freed

    def restore(self) -> None:
        """Reallocate the freed storages, zeroed; the caller copies the tensors' contents back."""
        for i in range(len(self.storages)):
            if self.freed[i]:
                self.storages[i].resize_(self.sizes[i])
                self._bytes(i).zero_()
                self.freed[i] = False
