"""Expert parallelism in training (ep > 1) -> generation (e_g dividing ep) for the colocated hybrid engine.

A training rank holds num_experts / ep experts of each MoE layer (its expert-parallel rank's share, at its TP
shard); a generation rank needs those of its generation block, ep / e_g training blocks (all of them when
e_g = 1), at its t_g shard. Before each reshard the ep / e_g ranks whose blocks make one generation block
all-gather their experts into buffers (one per expert this rank does not hold, named with the global expert
number), so the reshard that follows sees, on every rank, a training shard of an EP=e_g model and plans it like
one. The buffers have storage only during a transition: to_training() frees them again, so training holds no
extra memory; the gather itself packs the local experts into buckets (one all-gather each, at most bucket_mb
received per bucket). Bytes: each rank receives (ep / e_g - 1) x its own expert bytes (counted in
ReshardStats.extra["expert_recv_bytes"] and in recv_payload_bytes).

With an expert TP other than the TP (ExpertRegroup) a rank's experts are not a TP shard at all: it holds a
whole block of experts at its expert-TP shard, which is tp / expert_tp dense TP shards wide below the TP and
1 / (expert_tp / tp) of one above it, and the ranks that hold the right expert-TP shards of a block may be other
TP ranks (below) or ranks of other DP replicas (above). So every expert is regrouped into the dense TP layout
first: each rank gets all experts at its own TP shard, each piece sent by the rank of its expert-TP x EP group
(same stage, same expert-data-parallel replica) whose expert-TP shard contains it (below; a point-to-point
message straight into place) or by each of the expert_tp / tp ranks whose shards make it (above; received into
a scratch and joined, SwiGLU halves in order); a piece the rank holds itself is copied. The reshard then sees an
EP=1 model's TP shard as above. The rank's training experts stay allocated while generating (they are not a
slot of any generation shard).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridrl.hybrid_engine.model_shapes import GATED_HALVES
from hybridrl.hybrid_engine.reshard import ShardedParam, new_group_of
from hybridrl.models.families import expert_number, renumber_expert, tp_gather, tp_shard
from hybridrl.parallel.layout import LayoutError, ParallelLayout


class ExpertGather:
    """The experts of the other ranks of this rank's expert-parallel group, gathered for the reshard."""

    def __init__(self, params: list[ShardedParam], num_experts: int, ep_group: Any,
                 bucket_bytes: int = 32 << 20, *, blocks: int | None = None, first_block: int = 0) -> None:
        """ep_group: the ranks that gather together (their expert blocks first_block, first_block + 1, ...);
        blocks: the training ep (default: the group's size)."""
        self.group, self.bucket_bytes = ep_group, max(1, bucket_bytes)
        self.ep, self.me = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        per_rank = num_experts // (blocks or self.ep)
        self.pairs: list[tuple[ShardedParam, list[torch.Tensor | None]]] = []
        self.remote: list[ShardedParam] = []
        for param in params:
            expert = expert_number(param.name)
            if expert is None:
                continue
            local = expert - (first_block + self.me) * per_rank
            slots: list[torch.Tensor | None] = []
            for rank in range(self.ep):
                if rank == self.me:
                    slots.append(None)
                    continue
                buffer = torch.empty_like(param.tensor.detach())
                buffer.untyped_storage().resize_(0)  # storage only during a transition
                self.remote.append(ShardedParam(renumber_expert(param.name, (first_block + rank) * per_rank + local),
                                                buffer,
                                                param.partition_dim, param.stage, param.regroup))
                slots.append(buffer)
            self.pairs.append((param, slots))
        self.buckets = self._buckets()
        self.collectives = len(self.buckets)  # all-gathers per transition
        self.messages = 0
        self.allocated_bytes = sum(p.tensor.numel() * p.tensor.element_size() for p in self.remote)

    def params(self, params: list[ShardedParam]) -> list[ShardedParam]:
        """The rank's training shards plus every remote expert's buffer: an EP=1 model's shard."""
        return params + self.remote

    @torch.no_grad()
    def gather(self) -> int:
        """Fill the buffers with the other ranks' current experts; returns the bytes received. The local experts
        go out packed, one all-gather per bucket of at most bucket_bytes received (not one per tensor: a
        Qwen3-30B-A3B rank at ep=8 holds 48 x 16 x 2 expert tensors)."""
        for _, slots in self.pairs:
            for slot in slots:
                if slot is not None:
                    slot.untyped_storage().resize_(slot.numel() * slot.element_size())
        received = 0
        for bucket in self.buckets:
            flat = torch.cat([param.tensor.detach().reshape(-1) for param, _ in bucket])
            gathered = torch.empty(self.ep * flat.numel(), dtype=flat.dtype, device=flat.device)
            dist.all_gather_into_tensor(gathered, flat, group=self.group)
            for rank, part in enumerate(gathered.split(flat.numel())):
                if rank == self.me:
                    continue
                offset = 0
                for param, slots in bucket:
                    numel = param.tensor.numel()
                    slots[rank].copy_(part[offset:offset + numel].view_as(slots[rank]))
                    offset += numel
                received += part.numel() * part.element_size()
        return received

    def _buckets(self) -> list[list[tuple[ShardedParam, list[torch.Tensor | None]]]]:
        buckets: list[list] = [[]]
        size = 0
        for pair in self.pairs:
            nbytes = self.ep * pair[0].tensor.numel() * pair[0].tensor.element_size()
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(pair)
            size += nbytes
        return [bucket for bucket in buckets if bucket]

    def release(self) -> None:
        """Drop the buffers' storage (after the transition back to training)."""
        for param in self.remote:
            param.tensor.untyped_storage().resize_(0)


class ExpertRegroup:
    """expert_tp != tp: every expert of the stage at this rank's dense TP shard, regrouped from the expert-TP
    shards of the rank's expert-TP x EP group (see the module docstring). Construction is local (no collective):
    every member derives the same schedule from the layout."""

    def __init__(self, params: list[ShardedParam], num_experts: int, layout: ParallelLayout, rank: int,
                 bucket_bytes: int = 32 << 20) -> None:
        self.layout, self.rank = layout, rank
        # below tp an expert-TP shard is `split` dense TP shards wide; above it a dense TP shard is `join` of them
        self.split = max(1, layout.tp // layout.expert_tp)
        self.join = max(1, layout.expert_tp // layout.tp)
        coords, me = layout.coords(rank), layout.expert_coords(rank)
        self.tp_rank, self.me = coords.tp, me
        per_block = num_experts // layout.ep
        local = sorted((p for p in params if expert_number(p.name) is not None), key=lambda p: p.name)
        self.local_names = {p.name for p in local}
        # one "kind" per local tensor, named by its local expert number: the same list on every member
        self.kinds = [(renumber_expert(p.name, expert_number(p.name) - me.ep * per_block), p) for p in local]
        for kind, param in self.kinds:
            self._check_divisible(kind, param)
        grid = {(e.etp, e.ep): r for r in layout.ranks()
                for e in [layout.expert_coords(r)] if layout.coords(r).pp == coords.pp and e.edp == me.edp}
        self.holder = lambda block, shard: grid[(shard, block)]  # the rank holding block's expert-TP shard
        self.sources = layout.expert_shards_of_tp_shard(self.tp_rank)  # the shards this rank's pieces come from
        self.peers = sorted({r for r in grid.values() if r != rank})
        self.buckets = self._buckets(bucket_bytes)
        # one flat buffer: bucket by bucket, block by block, kind by kind; the tensors of one block in one bucket
        # are one contiguous region, so a message lands in place (join > 1: in a scratch, then assembled)
        sample = local[0].tensor if local else None
        total = sum(layout.ep * self._dense_numel(p) for _, p in self.kinds)
        self.flat = sample.new_empty(total) if sample is not None else torch.empty(0)
        self.regions: list[list[tuple[int, int, int]]] = []  # per bucket: (block, offset, numel)
        self.remote: list[ShardedParam] = []
        offset = 0
        for bucket in self.buckets:
            regions = []
            for block in range(layout.ep):
                start = offset
                for kind, param in bucket:
                    shape = list(param.tensor.shape)
                    shape[param.partition_dim] = shape[param.partition_dim] * self.join // self.split
                    view = self.flat.as_strided(shape, _contiguous_strides(shape), offset)
                    name = renumber_expert(kind, block * per_block + expert_number(kind))
                    self.remote.append(ShardedParam(name, view, param.partition_dim, param.stage, param.regroup))
                    offset += self._dense_numel(param)
                regions.append((block, start, offset - start))
            self.regions.append(regions)
        self.allocated_bytes = total * self.flat.element_size()
        self.flat.untyped_storage().resize_(0)  # storage only during a transition (the views stay valid)
        self.collectives = 0
        self.messages = sum(1 for regions in self.regions for block, _, n in regions for shard in self.sources
                            if n and self.holder(block, shard) != rank)

    def _check_divisible(self, kind: str, param: ShardedParam) -> None:
        if param.partition_dim is None:
            raise LayoutError(f"expert weight {kind} has no TP partition dim; experts are split")
        size = param.tensor.shape[param.partition_dim]
        if size % ((2 if param.regroup == GATED_HALVES else 1) * self.split):
            raise LayoutError(f"{kind}: an expert-TP shard of {size} along dim {param.partition_dim} cannot be cut "
                              f"into tp/expert_tp = {self.split} dense TP shards; choose expert_tp = tp or a tp "
                              f"that divides the expert's intermediate size")

    def _dense_numel(self, param: ShardedParam) -> int:
        """Elements of one expert tensor at a dense TP shard."""
        return param.tensor.numel() * self.join // self.split

    def _buckets(self, bucket_bytes: int) -> list[list[tuple[str, ShardedParam]]]:
        """Kinds in groups whose send scratch (every sub-shard of the local tensors) stays within a bucket."""
        buckets: list[list] = [[]]
        size = 0
        for kind, param in self.kinds:
            nbytes = param.tensor.numel() * param.tensor.element_size()
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((kind, param))
            size += nbytes
        return [bucket for bucket in buckets if bucket]

    def params(self, params: list[ShardedParam]) -> list[ShardedParam]:
        """The rank's dense training shards plus every expert at its TP shard: an EP=1 model's TP shard."""
        return [p for p in params if p.name not in self.local_names] + self.remote

    def _piece(self, bucket: list[tuple[str, ShardedParam]], tp_rank: int, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """What this rank's shard contributes to dense TP shard `tp_rank`, for every tensor of a bucket, flat:
        its sub-shard below tp, all of it above."""
        return torch.cat([tp_shard(p.name, p.tensor.detach(), p.partition_dim, tp_rank % self.split,
                                   self.split).reshape(-1) for _, p in bucket], out=out)

    @torch.no_grad()
    def gather(self) -> int:
        """Fill the buffer with every expert at this rank's TP shard; returns the bytes received."""
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
        received = 0
        # who takes a piece of this rank's expert-TP shard: the members whose dense TP shard overlaps it
        takers = [(peer, self.layout.coords(peer).tp) for peer in self.peers
                  if self.me.etp in self.layout.expert_shards_of_tp_shard(self.layout.coords(peer).tp)]
        for tag, (bucket, regions) in enumerate(zip(self.buckets, self.regions)):
            ops, packed, scratches = [], {}, []
            for block, start, numel in regions:
                region = self.flat.narrow(0, start, numel)
                # join > 1: the pieces of `join` expert-TP shards, assembled into the region once all have come
                target = region if self.join == 1 else region.new_empty(numel)
                for shard, piece in zip(self.sources, target.chunk(self.join)):
                    holder = self.holder(block, shard)
                    if holder == self.rank:  # a piece of the rank's own experts: one copy
                        self._piece(bucket, self.tp_rank, out=piece)
                    else:
                        ops.append(dist.P2POp(dist.irecv, piece, holder, tag=tag))
                        received += piece.numel() * piece.element_size()
                if self.join > 1:
                    scratches.append((region, target))
            for peer, peer_tp in takers:
                sub = peer_tp % self.split
                if sub not in packed:
                    packed[sub] = self._piece(bucket, peer_tp)
                ops.append(dist.P2POp(dist.isend, packed[sub], peer, tag=tag))
            # one batch: NCCL runs it as one group (no per-pair ordering to deadlock on, no message at a time)
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
            for region, scratch in scratches:
                self._assemble(bucket, region, scratch.chunk(self.join))
        return received

    def _assemble(self, bucket: list[tuple[str, ShardedParam]], region: torch.Tensor,
                  pieces: tuple[torch.Tensor, ...]) -> None:
        """join > 1: each tensor's dense TP shard from its `join` expert-TP shards (the dense shard split join
        ways is exactly those shards, SwiGLU halves included)."""
        offset = 0
        for kind, param in bucket:
            numel = param.tensor.numel()
            shards = [piece[offset:offset + numel].view(param.tensor.shape) for piece in pieces]
            dense = tp_gather(kind, shards, param.partition_dim)
            region.narrow(0, offset * self.join, numel * self.join).copy_(dense.reshape(-1))
            offset += numel

    def release(self) -> None:
        self.flat.untyped_storage().resize_(0)


def _contiguous_strides(shape: list[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def expert_stage(params: list[ShardedParam], num_experts: int, layout: ParallelLayout, rank: int, gen_ep: int,
                 bucket_bytes: int) -> ExpertGather | ExpertRegroup | None:
    """What brings a rank's experts into an EP=e_g model's TP shard before the reshard (collective: every rank
    calls it): an all-gather inside ep / e_g ranks of the expert-parallel group when expert TP equals TP (None
    when e_g = ep: nothing to gather), a regroup over the expert-TP x EP group otherwise (e_g = 1)."""
    if layout.expert_tp != layout.tp:
        return ExpertRegroup(params, num_experts, layout, rank, bucket_bytes=bucket_bytes)
    size = layout.ep // gen_ep
    gather_groups = [group[i:i + size] for group in layout.expert_parallel_groups()
                     for i in range(0, len(group), size)]
    members, group = new_group_of(rank, gather_groups)
    if size == 1:
        return None
    first_block = layout.expert_coords(members[0]).ep
    return ExpertGather(params, num_experts, group, bucket_bytes=bucket_bytes, blocks=layout.ep,
                        first_block=first_block)
