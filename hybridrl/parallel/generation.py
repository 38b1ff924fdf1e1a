"""Generation-layout rank arithmetic for the 3D-HybridEngine (HybridFlow §5).

Training layout p-t-d (Megatron order, rank = tp + t*(dp + d*pp)); generation layout p_g-t_g-d_g-d with
d_g = p*t / (p_g*t_g). With strides s_t = t/t_g and s_p = p/p_g, training rank (pp, dp, tp):
  - holds generation shard (gen_pp, gen_tp) = (pp // s_p, tp // s_t);
  - has micro-DP rank (pp % s_p) * s_t + tp % s_t inside its micro-DP group, the d_g ranks of the same dp
    whose training shards (consecutive TP ranks x consecutive PP stages) together form that generation shard;
  - its generation TP group is the ranks of the same dp, micro-DP rank and gen_pp with varying gen_tp
    (ranks at stride s_t in TP); its generation PP group likewise varies gen_pp (stride s_p in PP);
  - generation DP replicas: d * d_g, replica index dp * d_g + micro-DP rank.
Example (HybridFlow §5, arXiv 2409.19256): training 1-4-2 -> t_g=2: generation TP groups [0,2],[1,3],[4,6],[5,7];
micro-DP groups [0,1],[2,3],[4,5],[6,7].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from hybridrl.parallel.layout import LayoutError, ParallelLayout, divisors


class GenShard(NamedTuple):
    """Which generation shard a rank holds: its generation PP stage and generation TP rank."""
    gen_pp: int
    gen_tp: int


@dataclass(frozen=True)
class GenerationLayout:
    """Generation model parallelism (t_g, p_g, e_g); the generation DP size follows from the training layout.
    e_g (expert parallelism while generating) divides the training ep: each generation rank holds one of e_g
    blocks of the experts (ep / e_g consecutive training expert blocks), so the expert-parallel gather stays
    inside ep / e_g training ranks, and the e_g generation replicas holding different blocks run their MoE
    layers together (the native engine decodes them in lockstep)."""
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"generation {name} must be a positive integer, got {value!r}")


def _nearest(valid: list[int], wanted: int) -> list[int]:
    """The valid values closest to `wanted` (both neighbours on a tie), for error messages."""
    if not valid:
        return []
    best = min(abs(v - wanted) for v in valid)
    return [v for v in valid if abs(v - wanted) == best]


def valid_generation_tp(train_tp: int, num_attention_heads: int | None = None,
                        num_query_groups: int | None = None) -> list[int]:
    """Generation TP sizes that divide the training TP size (and the heads / kv heads, when given)."""
    out = []
    for tg in divisors(train_tp):
        if num_attention_heads is not None and num_attention_heads % tg:
            continue
        if num_query_groups is not None and num_query_groups % tg:
            continue
        out.append(tg)
    return out


def valid_generation_pp(train_pp: int, num_layers: int | None = None) -> list[int]:
    """Generation PP sizes that divide the training PP size (and the layer count, when given)."""
    return [pg for pg in divisors(train_pp) if num_layers is None or num_layers % pg == 0]


def check_generation_layout(train: ParallelLayout, gen: GenerationLayout, *,
                            num_attention_heads: int | None = None, num_query_groups: int | None = None,
                            num_layers: int | None = None) -> None:
    """Refuse a (training, generation) pair the 3D-HybridEngine cannot regroup, with the reason and the
    nearest valid choices. Model sizes are optional; pass them to also check heads and layers."""
    valid_tp = valid_generation_tp(train.tp, num_attention_heads, num_query_groups)
    valid_pp = valid_generation_pp(train.pp, num_layers)
    problems: list[str] = []
    if gen.tp > train.tp:
        problems.append(f"--gen-tp {gen.tp} is larger than --train-tp {train.tp} (a generation shard is "
                        f"regrouped from whole training shards, so t_g <= t)")
    elif train.tp % gen.tp:
        problems.append(f"--train-tp {train.tp} is not divisible by --gen-tp {gen.tp}")
    if gen.tp <= train.tp and train.tp % gen.tp == 0:
        if num_attention_heads is not None and num_attention_heads % gen.tp:
            problems.append(f"num_attention_heads={num_attention_heads} is not divisible by --gen-tp {gen.tp}")
        if num_query_groups is not None and num_query_groups % gen.tp:
            problems.append(f"num_key_value_heads={num_query_groups} is not divisible by --gen-tp {gen.tp}")
    if gen.pp > train.pp:
        problems.append(f"--gen-pp {gen.pp} is larger than --train-pp {train.pp} (a generation stage is "
                        f"made of whole training stages, so p_g <= p)")
    elif train.pp % gen.pp:
        problems.append(f"--train-pp {train.pp} is not divisible by --gen-pp {gen.pp}")
    elif num_layers is not None and num_layers % gen.pp:
        problems.append(f"num_layers={num_layers} is not divisible by --gen-pp {gen.pp}")
    if gen.ep > 1 and train.expert_tp != train.tp:
        problems.append(f"--gen-ep {gen.ep} with --train-etp {train.expert_tp} other than --train-tp {train.tp}: the "
                        f"experts are regrouped into the dense TP layout, so generation runs e_g = 1")
    elif train.ep % gen.ep:
        problems.append(f"--gen-ep {gen.ep} does not divide --train-ep {train.ep} (a generation rank's experts "
                        f"are whole training expert blocks; choose --gen-ep in {divisors(train.ep)})")
    if problems:
        raise LayoutError(
            "invalid generation layout: " + "; ".join(problems)
            + f". Nearest valid --gen-tp: {_nearest(valid_tp, gen.tp)} (all valid: {valid_tp}); "
            f"nearest valid --gen-pp: {_nearest(valid_pp, gen.pp)} (all valid: {valid_pp})")


@dataclass(frozen=True)
class GenerationGroups:
    """All group memberships of the generation layout, derived from the training layout."""
    train: ParallelLayout
    gen: GenerationLayout

    def __post_init__(self) -> None:
        check_generation_layout(self.train, self.gen)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def tp_stride(self) -> int:
        """s_t = t / t_g: consecutive training TP ranks merged into one generation TP shard."""
        return self.train.tp // self.gen.tp

    @property
    def pp_stride(self) -> int:
        """s_p = p / p_g: consecutive training PP stages merged into one generation stage."""
        return self.train.pp // self.gen.pp

    @property
    def micro_dp_size(self) -> int:
        """d_g = p*t / (p_g*t_g)."""
        return self.tp_stride * self.pp_stride

    @property
    def gen_dp_size(self) -> int:
        """Generation data-parallel replicas: d * d_g."""
        return self.train.dp * self.micro_dp_size

    # ---- per rank ------------------------------------------------------------------------------
    def gen_shard(self, rank: int) -> GenShard:
        c = self.train.coords(rank)
        return GenShard(c.pp // self.pp_stride, c.tp // self.tp_stride)

    def micro_dp_rank(self, rank: int) -> int:
        c = self.train.coords(rank)
        return (c.pp % self.pp_stride) * self.tp_stride + c.tp % self.tp_stride

    def gen_dp_rank(self, rank: int) -> int:
        return self.train.coords(rank).dp * self.micro_dp_size + self.micro_dp_rank(rank)

    def rank_of(self, dp: int, micro_dp_rank: int, gen_pp: int, gen_tp: int) -> int:
        """The training rank at generation coordinates (inverse of the per-rank functions above)."""
        if not (0 <= micro_dp_rank < self.micro_dp_size and 0 <= gen_pp < self.gen.pp
                and 0 <= gen_tp < self.gen.tp):
            raise LayoutError(f"generation coordinates micro_dp_rank={micro_dp_rank} gen_pp={gen_pp} "
                              f"gen_tp={gen_tp} outside {self.describe()}")
        pp = gen_pp * self.pp_stride + micro_dp_rank // self.tp_stride
        tp = gen_tp * self.tp_stride + micro_dp_rank % self.tp_stride
        return self.train.rank(pp=pp, dp=dp, tp=tp)

    def training_shards_of(self, shard: GenShard) -> list[tuple[int, int]]:
        """(training pp stage, training tp rank) of the shards that compose a generation shard, in
        micro-DP rank order (PP-major: stage by stage, TP ranks consecutive inside a stage)."""
        return [(shard.gen_pp * self.pp_stride + i // self.tp_stride,
                 shard.gen_tp * self.tp_stride + i % self.tp_stride) for i in range(self.micro_dp_size)]

    # ---- groups ---------------------------------------------------------------------------------
    def micro_dp_groups(self) -> list[list[int]]:
        """Ranks that all-gather together, ordered by micro-DP rank; one group per (dp, gen_pp, gen_tp)."""
        return [[self.rank_of(d, m, gp, gt) for m in range(self.micro_dp_size)]
                for d in range(self.train.dp) for gp in range(self.gen.pp) for gt in range(self.gen.tp)]

    def gen_tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, m, gp, gt) for gt in range(self.gen.tp)]
                for d in range(self.train.dp) for m in range(self.micro_dp_size) for gp in range(self.gen.pp)]

    def gen_pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, m, gp, gt) for gp in range(self.gen.pp)]
                for d in range(self.train.dp) for m in range(self.micro_dp_size) for gt in range(self.gen.tp)]

    @property
    def expert_stride(self) -> int:
        """s_e = ep / e_g: consecutive training expert blocks merged into one generation expert block."""
        return self.train.ep // self.gen.ep

    def gen_expert_block(self, rank: int) -> int:
        """Which of the e_g generation expert blocks the rank holds (its generation expert-parallel rank)."""
        return self.train.coords(rank).dp % self.train.ep // self.expert_stride

    def gen_ep_groups(self) -> list[list[int]]:
        """The e_g generation replicas (same micro-DP rank and generation shard, DP ranks s_e apart inside one
        training expert-parallel group) that hold the e_g expert blocks, ordered by block."""
        ep, stride = self.train.ep, self.expert_stride
        return [[self.rank_of(edp * ep + block * stride + j, m, gp, gt) for block in range(self.gen.ep)]
                for edp in range(self.train.dp // ep) for j in range(stride) for m in range(self.micro_dp_size)
                for gp in range(self.gen.pp) for gt in range(self.gen.tp)]

    def gen_tp_ep_groups(self) -> list[list[int]]:
        """Generation TP x EP (TP fastest, as Megatron orders it): the ranks a MoE layer's dispatcher spans."""
        tp_of = {r: g for g in self.gen_tp_groups() for r in g}
        return [[r for member in group for r in tp_of[member]] for group in self.gen_ep_groups()
                if self.gen_shard(group[0]).gen_tp == 0]

    def gen_dp_groups(self) -> list[list[int]]:
        """Ranks holding the same generation shard, ordered by generation DP rank."""
        return [[self.rank_of(d, m, gp, gt) for d in range(self.train.dp) for m in range(self.micro_dp_size)]
                for gp in range(self.gen.pp) for gt in range(self.gen.tp)]

    def describe(self) -> str:
        return (f"training p={self.train.pp} t={self.train.tp} d={self.train.dp} -> generation "
                f"p_g={self.gen.pp} t_g={self.gen.tp} d_g={self.micro_dp_size} d={self.train.dp}")
