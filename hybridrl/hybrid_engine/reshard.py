"""The reshard: move a model's training-layout shards into the generation layout (and release them again).

Model-agnostic core: it takes this rank's training shards as `ShardedParam`s (global names, partition dim,
regroup rule, pipeline place) and returns the generation shard's tensors by name. The Megatron GPT glue
(training params in, generation-layout model out) is hybrid_engine/megatron_adapter.py.

hybrid (in place). The generation shard lives in ONE flat generation buffer, laid out per parameter in the
generation layout (stage by stage, each tensor contiguous), and every returned tensor is a view of it. The
buffer is filled by collectives inside the micro-DP group whose outputs ARE views of the buffer:
  - a tensor every member holds (a layer of each merged stage, TP-partitioned; or replicated with t_g = t):
    one all-gather, member i's piece lands in its place: dim-0 concat (QKV, embedding, output layer, fc1 gate
    rows, fc1 up rows: the gated fc1 is two all-gathers, so its regroup costs no copy) is in place;
  - a tensor only some members hold (embedding / final norm / output layer of one merged stage, norms with
    t_g < t): one broadcast per holder (owner of a replicated tensor: the first training TP rank of the
    generation TP shard), received in place; no padding is ever sent;
  - a dim-1 partition (linear_proj, fc2) with t_g < t: its column blocks are strided in the generation
    tensor, so the pieces are gathered into a scratch bucket and copied into place (at most one bucket alive);
  - small transfers (below 1/8 of a bucket, and every column-block one) share packed collectives: the
    members pack their pieces into one slot, one all-gather (or one broadcast per sender) fills a scratch
    bucket, and each piece is copied into place. A collective has a fixed cost that dwarfs copying a small
    tensor once, so a model moves in a few collectives instead of one per tensor.
Every collective's output is at most one bucket (large tensors go in row pieces), so the scratch and any
staging inside the collective backend are bounded by the bucket. The rank's own training shard reaches its
slot once (inside its own all-gather, or one copy when it is the broadcast root). With release_training
(default) the training parameters' storages are then freed while generating: the slot in the generation
buffer is the only copy of the rank's training shard, so the extra memory held during generation is the
generation shard minus the training shard (HybridFlow Table 2: M/(t_g p_g) - M/(t p)), plus the few replicated
tensors the rank holds but does not own (kept aside). to_training() reallocates the training storages, copies
the own slots back (bit-identical) and frees the generation buffer. The schedule and the storage release are
in hybrid_engine/inplace.py.

Baselines (ds_chat, hybridflow_v; out of place, for measurement): every member packs its contribution into
one flat slot (equal slots: padding at the end), the slots are gathered into one buffer of the whole model,
and each rank rebuilds its generation shard from it (views where no regrouping is needed, concatenations
otherwise). The training parameters stay (their redundancy is the point of the comparison).

On gloo the hybrid schedule runs as point-to-point messages (hybrid_engine/p2p.py): the same pieces and bytes,
received straight into place and all at once, where gloo's all-gather would stage its whole output and run a
ring of sequential steps.

Bytes moved, memory allocated and copies are reported per call in `last_stats`; bytes equal the plan's
accounting (hybrid_engine/accounting.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridrl.hybrid_engine.fsdp_gather import DpShardedSchedule
from hybridrl.hybrid_engine.inplace import InPlaceSchedule, Op, TrainingStorage, numel_of
from hybridrl.hybrid_engine.model_shapes import CONCAT, ParamSpec
from hybridrl.hybrid_engine.p2p import run_point_to_point
from hybridrl.hybrid_engine.plan import check_strategy, generation_shard_from_training, \
    training_shard_from_generation
from hybridrl.parallel.generation import GenerationGroups

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 32 << 20
TRANSPORTS = ("auto", "collective", "p2p")
# one contiguous output for all members (torch >= 2.13 names it all_gather_single)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class ShardedParam:
    """This rank's training shard of one parameter."""
    name: str                    # global name (global layer index), the same on every rank holding it
    tensor: torch.Tensor
    partition_dim: int | None    # None: replicated over TP
    stage: int                   # training pipeline stage holding it
    regroup: str = CONCAT
    # fully sharded data parallel: `tensor` is rows [first, first + rows) of the whole TP shard of this shape
    dp_slice: tuple[int, tuple[int, ...]] | None = None


@dataclass(frozen=True)
class ShardMeta:
    """A training shard as another rank needs to know it (no data): to size a buffer and regroup it."""
    name: str
    shape: tuple[int, ...]
    partition_dim: int | None
    regroup: str
    dp_slice: tuple[int, tuple[int, ...]] | None = None  # fsdp: (first row, whole TP-shard shape), see ShardedParam

    @classmethod
    def of(cls, param: ShardedParam) -> "ShardMeta":
        return cls(param.name, tuple(param.tensor.shape), param.partition_dim, param.regroup, param.dp_slice)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass
class ReshardStats:
    """One to_generation() call. Memory is counted from the tensors this code allocates and frees."""
    recv_payload_bytes: int = 0
    recv_wire_bytes: int = 0        # payload + padding actually received
    buffer_bytes: int = 0           # gather buffer (hybrid: the generation buffer), padding included
    generation_bytes: int = 0       # bytes of the generation-shard tensors returned
    scratch_bytes: int = 0          # largest transient allocation besides the buffer (one bucket at most)
    kept_bytes: int = 0             # hybrid: own training tensors kept aside while their storage is freed
    released_training_bytes: int = 0  # hybrid: training storage freed while generating
    held_bytes: int = 0             # extra bytes held during generation: buffer + other allocations - released
    peak_extra_bytes: int = 0       # most extra bytes alive at once during the transition
    own_copy_bytes: int = 0         # bytes of the rank's own training shard copied into the buffer
    regroup_copy_bytes: int = 0     # other bytes copied after arriving (scratch -> place, concatenations)
    collectives: int = 0
    messages: int = 0               # point-to-point messages received (the gloo transport)
    extra: dict = field(default_factory=dict)


def new_group_of(rank: int, member_lists: list[list[int]]):
    """Create every group (collective: all ranks, same order) and return this rank's (members, group)."""
    mine = None
    for members in member_lists:
        group = dist.new_group(members)
        if rank in members:
            mine = (members, group)
    return mine


class Resharder:
    """Training -> generation weight movement for one rank under one strategy (hybrid / ds_chat /
    hybridflow_v). Construction is collective over the whole default process group.

    bucket_bytes: most bytes one collective outputs (and the scratch bound). release_training (hybrid): free
    the training storages while generating. generation_names (hybrid): move only these tensors (the
    generation model's parameters; None: every parameter of the generation shard). transport (hybrid): "p2p"
    runs the schedule as point-to-point messages into place (hybrid_engine/p2p.py), "collective" as
    collectives, "auto" picks p2p on gloo and collectives otherwise (NCCL's all-gather writes in place)."""

    def __init__(self, groups: GenerationGroups, params: list[ShardedParam], strategy: str = "hybrid", *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, release_training: bool = True,
                 generation_names: set[str] | None = None, transport: str = "auto") -> None:
        check_strategy(strategy)
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes} (set bucket_mb > 0)")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.groups, self.strategy = groups, strategy
        self.bucket_bytes, self.release_training = bucket_bytes, release_training
        self.rank = dist.get_rank()
        train = groups.train
        self.coords = train.coords(self.rank)
        dtypes = {p.tensor.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"all parameters must share one dtype for the flat gather buffer, got {dtypes}")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.device = params[0].tensor.device if params else torch.device("cpu")
        self.params = params
        # fully sharded data parallel: each TP shard is cut over the DP ranks (fsdp_gather.py)
        self.dp_sharded = any(p.dp_slice is not None for p in params)
        if self.dp_sharded and strategy != "hybrid":
            raise ValueError(f"strategy {strategy} (a baseline) reads whole training shards; fully sharded ones "
                             f"(parallel.fsdp) move with the hybrid strategy")
        if strategy == "hybrid":
            member_lists = groups.gen_dp_groups() if self.dp_sharded else groups.micro_dp_groups()
            owner = self.coords.tp % groups.tp_stride == 0
        elif strategy == "hybridflow_v":
            member_lists = train.model_parallel_groups()
            owner = self.coords.tp == 0
        else:
            member_lists = [list(train.ranks())]
            owner = self.coords.tp == 0
        self.members, self.group = new_group_of(self.rank, member_lists)
        self.me = self.members.index(self.rank)
        if transport == "auto":  # gloo's all-gather stages the whole output and runs a ring; messages do not
            on_gloo = dist.get_backend(self.group) == "gloo" and self.device.type == "cpu"
            transport = "p2p" if on_gloo else "collective"
        self.transport = transport
        # what this rank puts in: its TP-partitioned shards, plus replicated tensors where it is the owner
        self.contributed = [p for p in params if p.partition_dim is not None or owner]
        shared = params if strategy == "hybrid" else self.contributed
        meta = ((self.coords.pp, self.coords.tp, self.coords.dp),
                [ShardMeta.of(p) for p in shared])
        gathered: list = [None] * len(self.members)
        dist.all_gather_object(gathered, meta, group=self.group)
        self.member_meta = gathered  # [(pp, tp, dp), [ShardMeta...]] per member, in group order
        self.last_stats = ReshardStats()
        self._buffer: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] | None = None
        if strategy == "hybrid":
            elems = max(1, bucket_bytes // torch.empty(0, dtype=self.dtype).element_size())
            schedule = DpShardedSchedule if self.dp_sharded else InPlaceSchedule
            self.schedule = schedule(groups, gathered, generation_names, elems)
            self._own = {p.name: p.tensor for p in params}
            self._placed = self.schedule.placed_by(self.me)
        self._storage: TrainingStorage | None = None
        self._kept: dict[str, torch.Tensor] = {}

    # ---- the transition --------------------------------------------------------------------------
    def to_generation(self) -> dict[str, torch.Tensor]:
        """Gather and regroup; returns this rank's generation-shard tensors by global name (hybrid: views of
        the generation buffer, valid until to_training())."""
        if self._views is not None:
            return self._views
        if self.strategy == "hybrid":
            self._views = self._to_generation_in_place()
        else:
            self._views = self._to_generation_gather_all()
        return self._views

    def to_training(self) -> None:
        """Free the generation buffer (views handed out become empty) and, if released, give the training
        tensors their storage and values back (bit-identical: the own slots are exact copies)."""
        if self._views is None:
            return
        if self._storage is not None and any(self._storage.freed):
            self._storage.restore()
            with torch.no_grad():
                for op in self.schedule.ops:
                    for part in op.parts:
                        if part.member == self.me:
                            src = self._own[part.src].narrow(0, part.row, part.rows)
                            src.copy_(self.schedule.dst_view(self._views, part))
                for name, kept in self._kept.items():
                    self._own[name].copy_(kept)
        self._kept = {}
        if self._buffer is not None and self._buffer.untyped_storage().resizable():
            self._buffer.untyped_storage().resize_(0)  # really free, even if a caller still holds a view
        self._buffer, self._views = None, None

    # ---- hybrid: in place --------------------------------------------------------------------------
    def _to_generation_in_place(self) -> dict[str, torch.Tensor]:
        sched = self.schedule
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        self._buffer = torch.empty(sched.numel, dtype=self.dtype, device=self.device)
        views = {name: self._buffer[off:off + numel_of(shape)].view(shape) for name, (off, shape) in
                 sched.layout.items()}
        stats = ReshardStats(buffer_bytes=sched.numel * itemsize, generation_bytes=sched.numel * itemsize)
        with torch.no_grad():
            if self.transport == "p2p":
                run_point_to_point(sched, self.me, self.members, self.group, self._own, self._buffer, views,
                                   max(1, self.bucket_bytes // itemsize), stats)
            else:
                self._run_collectives(views, stats, itemsize)
        stats.recv_wire_bytes = stats.recv_payload_bytes  # no padding: every piece is real data
        # the training shard now lives in its slots; what the rank holds but did not place is kept aside
        self._kept, released = {}, 0
        if self.release_training:  # storages looked up now: a wrapper (DDP) may have moved them since
            self._storage = TrainingStorage(self._own)
            releasable = self._storage.releasable()
            self._kept = {n: self._own[n].detach().clone() for n in releasable if n not in self._placed}
            released = self._storage.release(releasable)
        stats.kept_bytes = sum(t.numel() * t.element_size() for t in self._kept.values())
        stats.released_training_bytes = released
        stats.held_bytes = stats.buffer_bytes + stats.kept_bytes - released
        stats.peak_extra_bytes = stats.buffer_bytes + max(stats.scratch_bytes, stats.kept_bytes)
        self.last_stats = stats
        return views

    def _run_collectives(self, views: dict[str, torch.Tensor], stats: ReshardStats, itemsize: int) -> None:
        sched = self.schedule
        scratch_elems = 0
        for op in sched.ops:
            if op.packed:  # the packed output (+ the own send slot of a gather)
                total = sum(sched.piece_numel(p) for p in op.parts)
                staged = total + (total // len(self.members) if op.kind == "packed_gather" else 0)
            else:
                dsts = [sched.dst_view(views, p) for p in op.parts]
                staged = sum(d.numel() for d in dsts if not d.is_contiguous())
            scratch_elems = max(scratch_elems, staged)
        scratch = torch.empty(scratch_elems, dtype=self.dtype, device=self.device)
        stats.scratch_bytes = scratch_elems * itemsize
        for op in sched.ops:
            self._run_op(op, views, scratch, stats, itemsize)

    def _run_op(self, op: Op, views: dict[str, torch.Tensor], scratch: torch.Tensor, stats: ReshardStats,
                itemsize: int) -> None:
        if op.packed:
            self._run_packed_op(op, views, scratch, stats, itemsize)
            return
        sched, me = self.schedule, self.me
        dsts = [sched.dst_view(views, p) for p in op.parts]
        outs, staged, cursor = [], [], 0
        for dst in dsts:  # a strided destination (dim-1 column block) arrives in scratch first
            if dst.is_contiguous():
                outs.append(dst)
            else:
                tmp = scratch[cursor:cursor + dst.numel()].view(dst.shape)
                cursor += dst.numel()
                outs.append(tmp)
                staged.append((dst, tmp))
        stats.collectives += 1
        if op.kind == "gather":
            mine = op.parts[me]
            src = self._own[mine.src].narrow(0, mine.row, mine.rows)
            piece = src.numel() * itemsize
            region = self._adjacent_region(outs, scratch if staged else self._buffer)
            if region is not None:  # one contiguous output: no list to stage through
                _all_gather_single(region, src.reshape(-1), group=self.group)
            else:
                dist.all_gather(outs, src, group=self.group)
            stats.recv_payload_bytes += (len(outs) - 1) * piece
            stats.own_copy_bytes += piece
        else:
            part = op.parts[0]
            root = self.members[part.member]
            if part.member == me:
                src = self._own[part.src].narrow(0, part.row, part.rows)
                dsts[0].copy_(src)  # the root's own slot: the one copy of its training shard
                stats.own_copy_bytes += src.numel() * itemsize
                dist.broadcast(src, src=root, group=self.group)
                staged = []
            else:
                dist.broadcast(outs[0], src=root, group=self.group)
                stats.recv_payload_bytes += outs[0].numel() * itemsize
        for dst, tmp in staged:
            dst.copy_(tmp)
            stats.regroup_copy_bytes += tmp.numel() * itemsize

    def _run_packed_op(self, op: Op, views: dict[str, torch.Tensor], scratch: torch.Tensor, stats: ReshardStats,
                       itemsize: int) -> None:
        """Many small transfers in one collective: pack the sources, move the packed bucket, copy into place."""
        sched, me = self.schedule, self.me
        sizes = [sched.piece_numel(p) for p in op.parts]
        total = sum(sizes)
        stats.collectives += 1
        if op.kind == "packed_gather":
            slot = total // len(self.members)
            out, send = scratch[:total], scratch[total:total + slot]
            cursor = 0
            for part, size in zip(op.parts, sizes):
                if part.member == me:
                    send[cursor:cursor + size].copy_(self._own[part.src].narrow(0, part.row, part.rows).reshape(-1))
                    cursor += size
            _all_gather_single(out, send, group=self.group)
            stats.recv_payload_bytes += (total - slot) * itemsize
            stats.own_copy_bytes += slot * itemsize
            stats.regroup_copy_bytes += total * itemsize  # packing + every other member's pieces into place
        else:
            root = op.parts[0].member
            out = scratch[:total]
            if root == me:
                cursor = 0
                for part, size in zip(op.parts, sizes):
                    out[cursor:cursor + size].copy_(self._own[part.src].narrow(0, part.row, part.rows).reshape(-1))
                    cursor += size
                stats.own_copy_bytes += total * itemsize
                stats.regroup_copy_bytes += total * itemsize  # the packing
            else:
                stats.recv_payload_bytes += total * itemsize
                stats.regroup_copy_bytes += total * itemsize
            dist.broadcast(out, src=self.members[root], group=self.group)
        cursor = 0  # member-major: each piece lands in its place in the generation buffer
        for part, size in zip(op.parts, sizes):
            dst = sched.dst_view(views, part)
            dst.copy_(out[cursor:cursor + size].view(dst.shape))
            cursor += size

    @staticmethod
    def _adjacent_region(outs: list[torch.Tensor], base: torch.Tensor) -> torch.Tensor | None:
        """The flat slice of `base` that the outputs tile in order, or None if they do not."""
        size = base.element_size()
        if any(o.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() for o in outs):
            return None
        for a, b in zip(outs, outs[1:]):
            if a.data_ptr() + a.numel() * size != b.data_ptr():
                return None
        start = (outs[0].data_ptr() - base.data_ptr()) // size
        return base[start:start + sum(o.numel() for o in outs)]

    # ---- baselines: gather everything, then slice (out of place) --------------------------------------
    def _to_generation_gather_all(self) -> dict[str, torch.Tensor]:
        slot = self._slot_numel()
        n = len(self.members)
        own = self._own_slot(slot)
        self._buffer = torch.empty(n * slot, dtype=self.dtype, device=own.device)
        dist.all_gather(list(self._buffer.split(slot)), own, group=self.group)
        pieces = self._unpack(slot)
        out = self._assemble(pieces)
        itemsize = own.element_size()
        own_payload = self._numel(self.member_meta[self.me][1])
        if self.strategy == "ds_chat":
            each = self._zero_chunk(own_payload)
            own_payload = max(0, min(each, own_payload - self.coords.dp * each))
        distinct = {(pp, tp): m for (pp, tp, _), m in self.member_meta}  # ds_chat: d members per MP shard
        total_payload = sum(self._numel(m) for m in distinct.values())
        buf_storage = self._buffer.untyped_storage().data_ptr()
        assembled = sum(t.numel() * itemsize for t in out.values()
                        if t.untyped_storage().data_ptr() != buf_storage)  # concatenations, not views
        buffer_bytes = n * slot * itemsize
        self.last_stats = ReshardStats(
            recv_payload_bytes=(total_payload - own_payload) * itemsize,
            recv_wire_bytes=(n - 1) * slot * itemsize, buffer_bytes=buffer_bytes,
            generation_bytes=sum(t.numel() * t.element_size() for t in out.values()),
            scratch_bytes=slot * itemsize, held_bytes=buffer_bytes + assembled,
            peak_extra_bytes=buffer_bytes + assembled + slot * itemsize, own_copy_bytes=own_payload * itemsize,
            regroup_copy_bytes=assembled, collectives=1)
        return out

    # ---- packing ---------------------------------------------------------------------------------
    @staticmethod
    def _numel(metas: list[ShardMeta]) -> int:
        return sum(m.numel for m in metas)

    def _slot_numel(self) -> int:
        if self.strategy == "ds_chat":  # ZeRO-3 style: each MP contribution split evenly over the DP ranks
            return max(self._zero_chunk(self._numel(metas)) for _, metas in self.member_meta)
        return max(self._numel(metas) for _, metas in self.member_meta)

    def _zero_chunk(self, numel: int) -> int:
        """ds_chat: elements of a model-parallel contribution held by each of the d DP ranks."""
        return -(-numel // self.groups.train.dp)

    def _own_slot(self, slot: int) -> torch.Tensor:
        flat = torch.cat([p.tensor.detach().reshape(-1) for p in self.contributed]) if self.contributed \
            else torch.empty(0, dtype=self.dtype)
        if self.strategy == "ds_chat":
            each = self._zero_chunk(flat.numel())
            flat = flat[self.coords.dp * each:(self.coords.dp + 1) * each]
        out = torch.zeros(slot, dtype=self.dtype, device=flat.device)
        out[:flat.numel()] = flat
        return out

    def _unpack(self, slot: int) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        """(training pp, tp) -> name -> tensor view of the gathered buffer."""
        buf = self._buffer
        flats: dict[tuple[int, int], torch.Tensor] = {}
        if self.strategy == "ds_chat":
            d = self.groups.train.dp
            by_mp: dict[tuple[int, int], list] = {}
            for i, ((pp, tp, dp), m) in enumerate(self.member_meta):
                each = self._zero_chunk(self._numel(m))
                by_mp.setdefault((pp, tp), [None] * d)[dp] = buf[i * slot:i * slot + each]
            for key, chunks in by_mp.items():
                flats[key] = torch.cat(chunks)
            metas = {(pp, tp): m for (pp, tp, _), m in self.member_meta}
        else:
            metas = {}
            for i, ((pp, tp, _), m) in enumerate(self.member_meta):
                flats[(pp, tp)] = buf[i * slot:(i + 1) * slot]
                metas[(pp, tp)] = m
        pieces: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for key, m in metas.items():
            offset, views = 0, {}
            for meta in m:
                numel = int(torch.Size(meta.shape).numel())
                views[meta.name] = flats[key][offset:offset + numel].view(meta.shape)
                offset += numel
            pieces[key] = views
        self._metas = metas
        return pieces

    def _assemble(self, pieces: dict[tuple[int, int], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        g, train = self.groups, self.groups.train
        shard = g.gen_shard(self.rank)
        stages = range(shard.gen_pp * g.pp_stride, (shard.gen_pp + 1) * g.pp_stride)
        if self.strategy == "hybrid":
            tp_ranks = list(range(shard.gen_tp * g.tp_stride, (shard.gen_tp + 1) * g.tp_stride))
        else:
            tp_ranks = list(range(train.tp))  # full model gathered: rebuild full tensors, then slice
        out: dict[str, torch.Tensor] = {}
        for stage in stages:
            for meta in self._stage_metas(stage):
                if meta.partition_dim is None:
                    owner = (stage, tp_ranks[0])
                    out[meta.name] = pieces[owner][meta.name]
                    continue
                spec = ParamSpec(meta.name, meta.shape, meta.partition_dim, None, "layer", meta.regroup)
                shards = [pieces[(stage, tp)][meta.name] for tp in tp_ranks]
                if len(shards) == 1:
                    out[meta.name] = shards[0]
                elif self.strategy == "hybrid":
                    out[meta.name] = generation_shard_from_training(shards, spec)
                else:
                    full = generation_shard_from_training(shards, spec)
                    out[meta.name] = training_shard_from_generation(full, spec, g.gen.tp, shard.gen_tp)
        return out

    def _stage_metas(self, stage: int) -> list[ShardMeta]:
        """Every parameter of a training stage (partitioned ones from any TP rank, replicated from the owner),
        in a stable order."""
        seen: dict[str, ShardMeta] = {}
        for (pp, _), metas in sorted(self._metas.items()):
            if pp == stage:
                for m in metas:
                    seen.setdefault(m.name, m)
        return list(seen.values())
