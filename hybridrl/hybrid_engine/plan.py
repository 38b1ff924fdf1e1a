"""The 3D-HybridEngine plan: who gathers with whom, which generation shard each rank ends up holding, which
training shards compose it, and what each rank contributes to the gather under each strategy.

Strategies (selectable, same code; the baselines are for measurement):
  hybrid        HybridFlow: all-gather inside each micro-DP group (d_g ranks); a rank's training shard is its
                own slot of the generation buffer, so nothing is held twice.
  hybridflow_v  HybridFlow-V: all-gather over the training TP x PP group (the whole model), then slice.
  ds_chat       DeepSpeed-Chat: all-gather over all t*p*d ranks, each contributing its ZeRO-3 partition
                (1/d of its model-parallel shard), then slice.

Regrouping a TP-partitioned tensor: generation TP shard j = training shards [j*s_t, (j+1)*s_t) along the
partition dim, but only where Megatron's fused layout is interleaved finer than one TP shard:
  - fused QKV: rows are blocks per query group ([q heads of the group; k; v]) and TP ranks own consecutive
    query groups, so a plain concat of consecutive shards IS the t_g shard (rule CONCAT);
  - gated fc1 (SwiGLU): each TP shard holds [gate_i; up_i], so a concat gives [g0;u0;g1;u1] while the t_g
    shard is [g0;g1;u0;u1]: each shard is split in halves and the halves regrouped (rule GATED_HALVES).
Both are checked against Megatron-style sharding of the full tensor in tests/test_hybrid_plan.py.

Mixture-of-experts (training ep, generation e_g dividing it): a training rank holds 1/ep of each MoE layer's
experts (block dp % ep) at its TP shard, a generation rank 1/e_g of them at its t_g shard. hybrid moves them in
two stages: first an all-gather of the expert blocks inside ep / e_g consecutive ranks of the expert-parallel
group (expert_gather_groups; nothing when e_g = ep), then the micro-DP all-gather as for the dense part, each
member now contributing its gathered experts too. Per rank that is Table 2's hybrid formula applied to the dense
part with (t p -> t_g p_g) and to the experts with (t p ep -> t_g p_g e_g); still nothing held twice.
hybridflow_v gathers every expert inside the expert-parallel group first, then the whole model inside TP x PP;
ds_chat (ZeRO-3, which has no expert parallelism) gathers over all ranks, each rank's partition being 1/(t p d)
of the model (the experts split over the d / ep ranks that replicate them).

With an expert TP other than the TP (expert_tp != tp; e_g = 1) the first stage is a regroup instead (experts.py
ExpertRegroup): inside each expert-TP x EP group every rank receives every expert block at its dense TP shard
from the member whose expert-TP shard contains it (below the TP) or from the tp / expert_tp members whose shards
make it (above); its own block's piece is copied when it holds one. A rank's training experts (a block at its
expert-TP shard) are not a slot of its generation shard, so hybrid holds them beside it: Table 2's zero
redundancy holds for the dense part only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hybridrl.hybrid_engine.model_shapes import CONCAT, GATED_HALVES, ModelShapes, ParamSpec
from hybridrl.parallel.generation import (GenerationGroups, GenerationLayout, GenShard,
                                          check_generation_layout)
from hybridrl.parallel.layout import LayoutError, ParallelLayout, shard_rows

STRATEGIES = ("hybrid", "ds_chat", "hybridflow_v")


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown transition strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def tp_shard_elements(spec: ParamSpec, tp: int, tp_rank: int) -> tuple[int, int]:
    """(payload, padding) elements of one TP shard. A partition dim that does not divide evenly is padded
    to a multiple of tp (every shard has ceil(n/tp) rows); the missing rows are padding."""
    if spec.partition_dim is None:
        return spec.numel, 0
    n = spec.shape[spec.partition_dim]
    rows_each = -(-n // tp)
    rows = max(0, min(rows_each, n - tp_rank * rows_each))
    per_row = spec.numel // n
    return rows * per_row, (rows_each - rows) * per_row


@dataclass(frozen=True)
class StageShardTable:
    """Element counts per training stage: TP-partitioned payload/padding per TP rank, replicated per stage
    (dense parameters), and every expert's elements at each TP shard (before the split over ep)."""
    partitioned: tuple[tuple[int, ...], ...]   # [pp][tp]
    tp_padding: tuple[tuple[int, ...], ...]    # [pp][tp]
    replicated: tuple[int, ...]                # [pp]
    experts: tuple[tuple[int, ...], ...]       # [pp][tp], all experts
    expert_padding: tuple[tuple[int, ...], ...]  # [pp][tp], all experts


@dataclass(frozen=True)
class DpShardTable:
    """Fully sharded data parallel: element counts per training stage, TP rank and DP rank (each DP rank holds
    its rows of every TP shard)."""
    partitioned: tuple[tuple[tuple[int, ...], ...], ...]  # [pp][tp][dp]
    replicated: tuple[tuple[int, ...], ...]               # [pp][dp]


class HybridEnginePlan:
    """Plan of one (training layout, generation layout, model) triple; all sizes are in bytes of `dtype_bytes`."""

    def __init__(self, train: ParallelLayout, gen: GenerationLayout, shapes: ModelShapes,
                 dtype_bytes: int = 2) -> None:
        train.check_model(shapes.num_attention_heads, shapes.num_query_groups, shapes.num_layers,
                          num_experts=shapes.num_experts)
        check_generation_layout(train, gen, num_attention_heads=shapes.num_attention_heads,
                                num_query_groups=shapes.num_query_groups, num_layers=shapes.num_layers)
        self.train, self.gen, self.shapes, self.dtype_bytes = train, gen, shapes, dtype_bytes
        self.groups = GenerationGroups(train, gen)
        self.table = self._stage_table()
        self.dp_table = self._dp_table() if train.dp_shards > 1 else None

    # ---- model placement -------------------------------------------------------------------------
    def train_stage_of(self, spec: ParamSpec) -> int:
        if spec.section == "embedding":
            return 0
        if spec.section == "final":
            return self.train.pp - 1
        return spec.layer // (self.shapes.num_layers // self.train.pp)

    def gen_stage_layers(self, gen_pp: int) -> range:
        """Layers of generation stage gen_pp = the layers of training stages [gen_pp*s_p, (gen_pp+1)*s_p)."""
        per_stage = self.shapes.num_layers // self.gen.pp
        return range(gen_pp * per_stage, (gen_pp + 1) * per_stage)

    def _stage_table(self) -> StageShardTable:
        t, p = self.train.tp, self.train.pp
        part, pad, expert, expert_pad = ([[0] * t for _ in range(p)] for _ in range(4))
        repl = [0] * p
        for spec in self.shapes.params:
            stage = self.train_stage_of(spec)
            if spec.partition_dim is None:
                if spec.expert is not None:
                    raise LayoutError(f"expert weight {spec.name} has no TP partition dim; experts are split")
                repl[stage] += spec.numel
                continue
            payloads, paddings = (expert, expert_pad) if spec.expert is not None else (part, pad)
            for r in range(t):
                payload, padding = tp_shard_elements(spec, t, r)
                payloads[stage][r] += payload
                paddings[stage][r] += padding
        return StageShardTable(*(tuple(map(tuple, x)) for x in (part, pad)), tuple(repl),
                               *(tuple(map(tuple, x)) for x in (expert, expert_pad)))

    def _dp_table(self) -> DpShardTable:
        """Fully sharded data parallel: each TP shard's rows cut over the DP ranks as FSDP2 cuts them."""
        if self.shapes.num_experts:
            raise LayoutError(f"parallel.fsdp={self.train.fsdp} with a mixture-of-experts model: not planned (Megatron's "
                              f"fully sharded wrapper runs without expert parallelism); use fsdp=no_shard")
        t, p, d = self.train.tp, self.train.pp, self.train.dp
        part = [[[0] * d for _ in range(t)] for _ in range(p)]
        repl = [[0] * d for _ in range(p)]
        for spec in self.shapes.params:
            stage = self.train_stage_of(spec)
            for r in range(t if spec.partition_dim is not None else 1):
                payload = tp_shard_elements(spec, t, r)[0]
                rows = payload // (spec.numel // spec.shape[0]) if spec.partition_dim == 0 else spec.shape[0]
                for k in range(d):
                    elems = shard_rows(rows, d, k)[1] * (payload // rows if rows else 0)
                    if spec.partition_dim is None:
                        repl[stage][k] += elems
                    else:
                        part[stage][r][k] += elems
        return DpShardTable(tuple(tuple(map(tuple, x)) for x in part), tuple(map(tuple, repl)))

    @property
    def model_bytes(self) -> int:
        """M: bytes of the whole model, every parameter once."""
        return self.shapes.numel * self.dtype_bytes

    @property
    def expert_bytes(self) -> int:
        """E: bytes of every expert weight (the routed experts; routers and shared experts are dense)."""
        return self.shapes.expert_numel * self.dtype_bytes

    # ---- what each strategy gathers -----------------------------------------------------------------
    def gather_groups(self, strategy: str) -> list[list[int]]:
        self._check_fsdp_strategy(strategy)
        if strategy == "hybrid":  # fully sharded: the d micro-DP groups of a generation shard gather together
            return self.groups.gen_dp_groups() if self.dp_table else self.groups.micro_dp_groups()
        if strategy == "hybridflow_v":
            return self.train.model_parallel_groups()
        return [list(self.train.ranks())]

    @property
    def regroups_experts(self) -> bool:
        """expert_tp != tp: the experts are regrouped into the dense TP layout before the reshard."""
        return bool(self.shapes.num_experts) and self.train.expert_tp != self.train.tp

    def expert_gather_groups(self, strategy: str = "hybrid") -> list[list[int]]:
        """The first stage with expert parallelism: inside each expert-parallel group, the ranks whose expert
        blocks make one generation expert block all-gather them (hybrid: ep / e_g ranks; hybridflow_v: all ep,
        it builds the whole model; ds_chat: none, ZeRO-3 has no expert parallelism). Empty when nothing moves.
        With expert_tp != tp: the expert-TP x EP groups the regroup runs in."""
        check_strategy(strategy)
        if self.regroups_experts:
            if strategy == "ds_chat":
                return []
            groups: dict[tuple[int, int], list[int]] = {}
            for rank in self.train.ranks():
                groups.setdefault((self.train.coords(rank).pp, self.train.expert_coords(rank).edp), []).append(rank)
            return list(groups.values())
        size = {"hybrid": self.train.ep // self.gen.ep, "hybridflow_v": self.train.ep, "ds_chat": 1}[strategy]
        if size == 1:
            return []
        return [group[i:i + size] for group in self.train.expert_parallel_groups()
                for i in range(0, len(group), size)]

    def expert_first_stage(self, strategy: str = "hybrid") -> dict[int, tuple[int, int, int]]:
        """Per rank (received, sent, copied from its own experts) payload bytes of the experts' first stage."""
        out: dict[int, tuple[int, int, int]] = {}
        if not self.regroups_experts:
            for group in self.expert_gather_groups(strategy):
                for rank in group:
                    moved = (len(group) - 1) * self.expert_share(rank, self.train.ep)[0]
                    out[rank] = (moved, moved, 0)
            return out
        join = max(1, self.train.expert_tp // self.train.tp)  # expert-TP shards per dense TP shard
        shards_of = self.train.expert_shards_of_tp_shard
        for group in self.expert_gather_groups(strategy):
            for rank in group:
                c, me = self.train.coords(rank), self.train.expert_coords(rank)
                own = me.etp in shards_of(c.tp)  # it holds a piece of its own dense TP shard
                piece = self.expert_share(rank, self.train.ep)[0] // join  # of one block, at its dense TP shard
                sent = sum(self.expert_share(peer, self.train.ep)[0] // join for peer in group
                           if peer != rank and me.etp in shards_of(self.train.coords(peer).tp))
                out[rank] = ((self.train.ep * join - own) * piece, sent, own * piece)
        return out

    def expert_share(self, rank: int, blocks: int) -> tuple[int, int]:
        """(payload, padding) bytes of the rank's experts when they are split in `blocks` blocks."""
        c = self.train.coords(rank)
        return (self.table.experts[c.pp][c.tp] // blocks * self.dtype_bytes,
                self.table.expert_padding[c.pp][c.tp] // blocks * self.dtype_bytes)

    def contribution(self, rank: int, strategy: str) -> tuple[int, int]:
        """(payload, padding) bytes this rank puts into its gather. Replicated tensors (norms) are put in by
        one owner per gathered copy: the first training TP rank of the rank's generation TP shard (hybrid) or
        TP rank 0 (baselines). The experts a first stage gathered are part of it (hybrid: 1/e_g of them,
        hybridflow_v: all); ds_chat splits the model-parallel contribution evenly over the DP ranks that
        replicate it (d, or d / ep for experts)."""
        self._check_fsdp_strategy(strategy)
        c = self.train.coords(rank)
        owner_tp = (c.tp % self.groups.tp_stride == 0) if strategy == "hybrid" else c.tp == 0
        if self.dp_table and strategy == "hybrid":  # its DP rows of its TP shard (+ of the norms it owns)
            dense = self.dp_table.partitioned[c.pp][c.tp][c.dp] + (self.dp_table.replicated[c.pp][c.dp] if owner_tp
                                                                   else 0)
            return dense * self.dtype_bytes, 0
        dense = self.table.partitioned[c.pp][c.tp] + (self.table.replicated[c.pp] if owner_tp else 0)
        dense_padding = self.table.tp_padding[c.pp][c.tp]
        if strategy == "ds_chat":  # flat ZeRO-3 split of the model-parallel shard over its replicas
            ep = 1 if self.regroups_experts else self.train.ep  # ZeRO-3 knows no expert grid
            expert, expert_padding = (x // self.dtype_bytes for x in self.expert_share(rank, ep))
            parts = [_split(dense, dense_padding, self.train.dp, c.dp),
                     _split(expert, expert_padding, self.train.dp // ep, c.dp // ep)]
            return tuple(sum(x) * self.dtype_bytes for x in zip(*parts))
        expert, expert_padding = self.expert_share(rank, self.gen.ep if strategy == "hybrid" else 1)
        return dense * self.dtype_bytes + expert, dense_padding * self.dtype_bytes + expert_padding

    def training_bytes(self, rank: int) -> int:
        """Payload bytes of the rank's training-layout parameters (Megatron: its TP x PP shard, 1/ep of the
        experts at its expert-TP shard)."""
        c = self.train.coords(rank)
        if self.dp_table:  # fully sharded: its DP rows only
            return (self.dp_table.partitioned[c.pp][c.tp][c.dp] + self.dp_table.replicated[c.pp][c.dp]) \
                * self.dtype_bytes
        dense = (self.table.partitioned[c.pp][c.tp] + self.table.replicated[c.pp]) * self.dtype_bytes
        if not self.regroups_experts:
            return dense + self.expert_share(rank, self.train.ep)[0]
        shard = self.train.expert_coords(rank).etp
        if self.train.expert_tp < self.train.tp:  # its expert-TP shard spans `ratio` dense TP shards
            ratio = self.train.tp // self.train.expert_tp
            experts = sum(self.table.experts[c.pp][shard * ratio:(shard + 1) * ratio])
        else:  # 1 / join of one dense TP shard
            join = self.train.expert_tp // self.train.tp
            experts = self.table.experts[c.pp][shard // join] // join
        return dense + experts // self.train.ep * self.dtype_bytes

    @property
    def strategies(self) -> tuple[str, ...]:
        """The strategies this layout can be accounted for: fully sharded training shards have no whole TP x PP
        shard for HybridFlow-V to gather (DS-Chat's ZeRO-3 partition is what fsdp holds anyway)."""
        return ("hybrid", "ds_chat") if self.dp_table else STRATEGIES

    def _check_fsdp_strategy(self, strategy: str) -> None:
        check_strategy(strategy)
        if strategy not in self.strategies:
            raise ValueError(f"strategy {strategy} with parallel.fsdp={self.train.fsdp}: choose one of "
                             f"{', '.join(self.strategies)}")

    # ---- composition of generation shards -----------------------------------------------------------
    def gen_shard(self, rank: int) -> GenShard:
        return self.groups.gen_shard(rank)

    def composition(self, rank: int) -> list[int]:
        """Training ranks (same DP replica) whose shards compose this rank's generation shard, in micro-DP
        order; equals the rank's micro-DP group."""
        dp = self.train.coords(rank).dp
        return [self.train.rank(pp=pp, dp=dp, tp=tp)
                for pp, tp in self.groups.training_shards_of(self.gen_shard(rank))]

    def describe_rank(self, rank: int) -> dict:
        c = self.train.coords(rank)
        shard = self.gen_shard(rank)
        layers = self.gen_stage_layers(shard.gen_pp)
        return {"rank": rank, "train": {"pp": c.pp, "dp": c.dp, "tp": c.tp},
                "gen": {"pp": shard.gen_pp, "tp": shard.gen_tp, "dp": self.groups.gen_dp_rank(rank),
                        "micro_dp_rank": self.groups.micro_dp_rank(rank)},
                "gen_layers": [layers.start, layers.stop], "composed_of_ranks": self.composition(rank)}


def _split(payload: int, padding: int, parts: int, index: int) -> tuple[int, int]:
    """(payload, padding) of part `index` of a flat ZeRO-3 split of payload + padding into equal parts."""
    each = -(-(payload + padding) // parts)
    mine_payload = max(0, min(each, payload - index * each))
    return mine_payload, each - mine_payload


# ---- regrouping tensors (used by the reshard; pure torch, checked against Megatron-style sharding) ------
def generation_shard_from_training(training_shards: Sequence, spec: ParamSpec):
    """Form one generation TP shard from the s_t consecutive training TP shards of a parameter (in TP order).
    Replicated tensors: every training shard is the full tensor; the first is returned."""
    import torch

    if spec.partition_dim is None:
        return training_shards[0]
    if spec.regroup == CONCAT:
        return torch.cat(list(training_shards), dim=spec.partition_dim)
    if spec.regroup == GATED_HALVES:
        halves = [s.chunk(2, dim=spec.partition_dim) for s in training_shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=spec.partition_dim)
    raise LayoutError(f"unknown regroup rule {spec.regroup!r} for {spec.name}")


def training_shard_from_generation(gen_shard, spec: ParamSpec, s_t: int, index: int):
    """Inverse of generation_shard_from_training: the index-th (0 <= index < s_t) training shard inside a
    generation TP shard (used when switching back, and to locate a rank's slot in the buffer)."""
    import torch

    if spec.partition_dim is None:
        return gen_shard
    if spec.regroup == CONCAT:
        return gen_shard.chunk(s_t, dim=spec.partition_dim)[index]
    if spec.regroup == GATED_HALVES:
        gate, up = gen_shard.chunk(2, dim=spec.partition_dim)
        return torch.cat([gate.chunk(s_t, dim=spec.partition_dim)[index],
                          up.chunk(s_t, dim=spec.partition_dim)[index]], dim=spec.partition_dim)
    raise LayoutError(f"unknown regroup rule {spec.regroup!r} for {spec.name}")


__all__ = ["STRATEGIES", "HybridEnginePlan", "StageShardTable", "DpShardTable", "check_strategy", "tp_shard_elements",
           "generation_shard_from_training", "training_shard_from_generation"]
