"""The reshard: move a model's training-layout shards into the generation layout (and release them again).

Model-agnostic core: it takes this rank's training shards as `ShardedParam`s (global names, partition dim,
regroup rule, pipeline place) and returns the generation shard's tensors by name. The Megatron GPT glue
(training params in, generation-layout model out) is hybrid_engine/megatron_adapter.py.

One all-gather per gather group (the plan's): every member packs its contribution into one flat slot
(equal slots: padding at the end), the slots are gathered into one buffer, and each rank rebuilds the
tensors of its generation shard from the members' slots with the plan's regroup rules. The metadata (names,
shapes) of every member is exchanged once, at construction.

This first cut is out of place: the rank's own slot is a copy of its training parameters, and the regrouped
generation tensors are built by concatenation from the buffer (views where no regrouping is needed). The
bytes moved and the buffer size are reported per call (`last_stats`) and equal the accounting's numbers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridrl.hybrid_engine.model_shapes import CONCAT, ParamSpec
from hybridrl.hybrid_engine.plan import check_strategy, generation_shard_from_training, \
    training_shard_from_generation
from hybridrl.parallel.generation import GenerationGroups

logger = logging.getLogger(__name__)


@dataclass
class ShardedParam:
    """This rank's training shard of one parameter."""
    name: str                    # global name (global layer index), the same on every rank holding it
    tensor: torch.Tensor
    partition_dim: int | None    # None: replicated over TP
    stage: int                   # training pipeline stage holding it
    regroup: str = CONCAT


@dataclass(frozen=True)
class _Meta:
    name: str
    shape: tuple[int, ...]
    partition_dim: int | None
    regroup: str


@dataclass
class ReshardStats:
    recv_payload_bytes: int = 0
    recv_wire_bytes: int = 0        # payload + padding actually received
    buffer_bytes: int = 0           # gather buffer, padding included
    generation_bytes: int = 0       # bytes of the generation-shard tensors returned
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
    hybridflow_v). Construction is collective over the whole default process group."""

    def __init__(self, groups: GenerationGroups, params: list[ShardedParam], strategy: str = "hybrid") -> None:
        check_strategy(strategy)
        self.groups, self.strategy = groups, strategy
        self.rank = dist.get_rank()
        train = groups.train
        self.coords = train.coords(self.rank)
        dtypes = {p.tensor.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"all parameters must share one dtype for the flat gather buffer, got {dtypes}")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.params = params
        if strategy == "hybrid":
            member_lists = groups.micro_dp_groups()
            owner = self.coords.tp % groups.tp_stride == 0
        elif strategy == "hybridflow_v":
            member_lists = train.model_parallel_groups()
            owner = self.coords.tp == 0
        else:
            member_lists = [list(train.ranks())]
            owner = self.coords.tp == 0
        self.members, self.group = new_group_of(self.rank, member_lists)
        # what this rank puts in: its TP-partitioned shards, plus replicated tensors where it is the owner
        self.contributed = [p for p in params if p.partition_dim is not None or owner]
        meta = ((self.coords.pp, self.coords.tp, self.coords.dp),
                [_Meta(p.name, tuple(p.tensor.shape), p.partition_dim, p.regroup) for p in self.contributed])
        gathered: list = [None] * len(self.members)
        dist.all_gather_object(gathered, meta, group=self.group)
        self.member_meta = gathered  # [(pp, tp, dp), [_Meta...]] per member, in group order
        self.last_stats = ReshardStats()
        self._buffer: torch.Tensor | None = None

    # ---- packing ---------------------------------------------------------------------------------
    @staticmethod
    def _numel(metas: list[_Meta]) -> int:
        return sum(int(torch.Size(m.shape).numel()) for m in metas)

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

    # ---- the transition --------------------------------------------------------------------------
    def to_generation(self) -> dict[str, torch.Tensor]:
        """Gather and regroup; returns this rank's generation-shard tensors by global name."""
        slot = self._slot_numel()
        n = len(self.members)
        own = self._own_slot(slot)
        self._buffer = torch.empty(n * slot, dtype=self.dtype, device=own.device)
        dist.all_gather(list(self._buffer.split(slot)), own, group=self.group)
        pieces = self._unpack(slot)
        out = self._assemble(pieces)
        itemsize = own.element_size()
        own_payload = self._numel(self.member_meta[self.members.index(self.rank)][1])
        if self.strategy == "ds_chat":
            each = self._zero_chunk(own_payload)
            own_payload = max(0, min(each, own_payload - self.coords.dp * each))
        distinct = {(pp, tp): m for (pp, tp, _), m in self.member_meta}  # ds_chat: d members per MP shard
        total_payload = sum(self._numel(m) for m in distinct.values())
        self.last_stats = ReshardStats(
            recv_payload_bytes=(total_payload - own_payload) * itemsize,
            recv_wire_bytes=(n - 1) * slot * itemsize, buffer_bytes=n * slot * itemsize,
            generation_bytes=sum(t.numel() * t.element_size() for t in out.values()))
        return out

    def to_training(self) -> None:
        """Release the gather buffer (the training parameters were never modified: nothing to copy back).
        Callers drop the returned generation tensors too."""
        self._buffer = None

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

    def _stage_metas(self, stage: int) -> list[_Meta]:
        """Every parameter of a training stage (partitioned ones from any TP rank, replicated from the owner),
        in a stable order."""
        seen: dict[str, _Meta] = {}
        for (pp, _), metas in sorted(self._metas.items()):
            if pp == stage:
                for m in metas:
                    seen.setdefault(m.name, m)
        return list(seen.values())
