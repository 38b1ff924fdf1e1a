"""The in-place reshard when the training shards are fully sharded over data parallelism (`parallel.fsdp`).

Without fsdp a micro-DP group (d_g ranks of one DP replica) holds the d_g training TP/PP shards that make one
generation shard, and all-gathers them into the generation buffer (inplace.InPlaceSchedule). Under fsdp every
TP shard is itself cut into d row blocks, one per DP rank (FSDP2's dim-0 split), so the d * d_g pieces of a
generation shard are held by the ranks of its generation DP group (the d micro-DP groups of that generation
shard, ordered by generation DP rank = dp * d_g + micro-DP rank). That group gathers them, each piece straight
into its rows of the generation buffer:
  - the layout of the buffer and the micro-DP transfers are InPlaceSchedule's, computed on the whole TP shards;
  - each transfer piece (rows [row, row + rows) of micro-DP member m's TP shard) is cut at the DP row blocks: the
    rows DP rank k holds travel from member k * d_g + m, into the same place of the buffer;
  - a gather whose pieces are all equal (TP shards whose rows divide by d) stays one all-gather over the
    d * d_g ranks, the rest become broadcasts; small ones are packed as before.
Every rank ends with the whole generation shard; its own rows were its slot (the only copy of its training
shard while generating), so per rank the bytes received are M/(t_g p_g) - M/(t p d) and nothing is held twice
(hybrid_engine/accounting.py counts the same). Going back copies the own rows out of the buffer again and
frees it; no full training shard ever exists.
"""
from __future__ import annotations

from dataclasses import replace

from hybridrl.hybrid_engine.inplace import InPlaceSchedule, Op, Part


class DpShardedSchedule(InPlaceSchedule):
    """InPlaceSchedule over a generation DP group of fully sharded members (member i = generation DP rank i)."""

    def __init__(self, groups, member_meta: list, gen_names: set[str] | None, bucket_elems: int,
                 alone_elems: int | None = None) -> None:
        micro, dp = groups.micro_dp_size, groups.train.dp
        if len(member_meta) != micro * dp:
            raise ValueError(f"a fully sharded generation group has d * d_g = {dp * micro} members, got "
                             f"{len(member_meta)}")
        for i, (_, metas) in enumerate(member_meta):
            unsliced = [m.name for m in metas if m.dp_slice is None]
            if unsliced:
                raise ValueError(f"member {i} holds parameters that are not fully sharded: {unsliced[:3]}")
        # the micro-DP layout and transfers, on the whole TP shards (as DP replica 0's members describe them)
        whole = [(coords, [replace(m, shape=m.dp_slice[1], dp_slice=None) for m in metas])
                 for coords, metas in member_meta[:micro]]
        super().__init__(groups, whole, gen_names, bucket_elems, alone_elems)
        self.micro, self.dp = micro, dp
        self.member_meta = member_meta
        self.by_member = [{m.name: m for m in metas} for _, metas in member_meta]
        self.d_g = micro * dp  # from here on: the gathering group's size (packing and merging read it)
        self.transfers = [op for micro_op in self.transfers for op in self._over_dp(micro_op)]
        alone = max(1, bucket_elems // 8) if alone_elems is None else alone_elems
        self.ops = self._coalesce(self._merge_broadcasts(self.transfers), bucket_elems, alone)

    def _dp_parts(self, part: Part) -> list[Part]:
        """A micro-DP member's piece cut at the DP row blocks: one part per DP rank holding some of its rows."""
        out = []
        for k in range(self.dp):
            member = k * self.micro + part.member
            meta = self.by_member[member][part.src]
            first, rows = meta.dp_slice[0], meta.shape[0]
            lo, hi = max(part.row, first), min(part.row + part.rows, first + rows)
            if hi > lo:
                out.append(Part(member, part.src, lo - first, hi - lo, part.dst, part.dim, part.start, part.length,
                                part.dst_row + lo - part.row))
        return out

    def _over_dp(self, op: Op) -> list[Op]:
        parts = sorted((p for part in op.parts for p in self._dp_parts(part)), key=lambda p: p.member)
        shapes = {self._piece_shape(p) for p in parts}
        if op.kind == "gather" and len(parts) == self.micro * self.dp and len(shapes) == 1:
            return [Op("gather", tuple(parts))]
        return [Op("broadcast", (p,)) for p in parts]
