"""ParallelLayout: the one owner of rank arithmetic for tensor/pipeline/data parallelism.

Ranks follow Megatron-Core's default order "tp-cp-ep-dp-pp" (cp = 1 here):
    rank = tp_rank + tp * (dp_rank + dp * pp_rank)
so TP ranks are consecutive, DP strides by tp, PP strides by tp*dp. Expert parallelism (ep, for MoE models)
splits each DP group's ranks into groups of `ep` consecutive DP replicas that hold different experts (the
attention and dense weights stay replicated over DP); an expert's own TP is the layout's tp.

With an expert TP (`etp`) other than tp, Megatron lays the experts out on their own grid: inside a pipeline
stage the tp*dp ranks, numbered L = tp_rank + tp*dp_rank, are re-split as L = etp_rank + etp*(ep_rank +
ep*edp_rank) (its expert rank generator, order tp-ep-dp-pp). Below tp, expert-parallel groups span TP ranks,
so ep may exceed dp (e.g. tp=2, etp=1, ep=2 on two ranks); above it, an expert-TP group spans DP replicas (e.g.
tp=1, etp=2, ep=2 on four ranks). hybridrl supports etp dividing tp or a multiple of it, with ep > 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, NamedTuple

# Fully sharded data parallel (ParallelConfig.fsdp): what a role's model shards over its DP group.
FSDP_MODES = ("no_shard", "shard_grad_op", "full_shard")


class LayoutError(ValueError):
    """A parallel layout that cannot work (bad sizes, wrong world size, indivisible model)."""


class RankCoords(NamedTuple):
    pp: int
    dp: int
    tp: int


class ExpertCoords(NamedTuple):
    """A rank's place on Megatron's expert grid: expert TP rank, expert-parallel rank (which block of experts),
    expert-data-parallel rank (which replica of that block)."""
    etp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    vpp: int | None = None  # virtual pipeline chunks per stage (optional)
    ep: int = 1  # expert parallel: DP replicas that split the experts of each MoE layer
    etp: int | None = None  # expert tensor parallel (None: tp); divides tp or is a multiple of it (then ep > 1)
    # how the role's model shards over its DP group (FSDP_MODES). Not part of the process layout: colocated roles
    # with different fsdp share the same processes and Megatron state, so layouts compare equal without it
    fsdp: str = field(default="no_shard", compare=False)

    def __post_init__(self) -> None:
        self._check_fsdp()
        for name in ("tp", "pp", "dp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise LayoutError(f"parallel.expert_tp must be a positive integer or unset, got {self.etp!r}")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("sequence_parallel needs tp > 1 (it splits activations over the TP group)")
        if self.vpp is not None and (self.vpp < 1 or self.pp == 1):
            raise LayoutError("vpp (virtual pipeline) needs pp > 1 and vpp >= 1")
        if self.tp % self.expert_tp and self.expert_tp % self.tp:
            raise LayoutError(f"expert_tp={self.expert_tp} must divide tp={self.tp} or be a multiple of it (an "
                              f"expert's TP shard is made of whole dense TP shards, or the other way round); choose "
                              f"expert_tp in {divisors(self.tp)} or a multiple of {self.tp}")
        stage = self.tp * self.dp  # ranks of a pipeline stage, re-split into the expert grid
        if stage % self.expert_tp:
            raise LayoutError(f"expert_tp={self.expert_tp} must divide tp*dp = {self.tp}*{self.dp} = {stage} (the "
                              f"ranks of a pipeline stage); choose expert_tp in {divisors(stage)}")
        if self.ep == 1 and self.expert_tp != self.tp:
            raise LayoutError(f"expert_tp={self.expert_tp} other than tp={self.tp} needs ep > 1: Megatron-Core reduces "
                              f"the experts' gradients over their expert-data-parallel group (which then differs from "
                              f"the DP group) only under expert parallelism; set ep in "
                              f"{divisors(stage // self.expert_tp)[1:]} or leave expert_tp unset")
        if self.ep > 1 and self.expert_tp == self.tp and self.dp % self.ep:
            raise LayoutError(f"ep={self.ep} must divide dp={self.dp}: expert-parallel ranks are data-parallel "
                              f"replicas of the rest of the model; choose ep in {divisors(self.dp)} (or set "
                              f"expert_tp below tp to spread the experts over TP ranks too)")
        slots = stage // self.expert_tp  # expert-TP groups per pipeline stage
        if slots % self.ep:
            raise LayoutError(f"ep={self.ep} must divide tp*dp/expert_tp = {self.tp}*{self.dp}/{self.expert_tp} = "
                              f"{slots} (the expert-TP groups of a pipeline stage); choose ep in {divisors(slots)}")

    def _check_fsdp(self) -> None:
        if self.fsdp not in FSDP_MODES:
            raise LayoutError(f"parallel.fsdp={self.fsdp!r}: choose one of {list(FSDP_MODES)}")
        if self.fsdp == "no_shard":
            return
        # Megatron-LM refuses these with its PyTorch-FSDP2 wrapper (megatron/training/arguments.py, use_torch_fsdp2)
        if self.pp > 1:
            raise LayoutError(f"parallel.fsdp={self.fsdp} with pp={self.pp}: Megatron-Core's fully sharded data "
                              f"parallel does not run with pipeline parallelism; set pp=1 (shard over dp, split "
                              f"with tp) or fsdp=no_shard")
        if self.ep > 1:
            raise LayoutError(f"parallel.fsdp={self.fsdp} with ep={self.ep}: Megatron-Core's fully sharded data "
                              f"parallel does not run with expert parallelism; set ep=1 or fsdp=no_shard")

    # ---- fully sharded data parallel ---------------------------------------------------------------
    @property
    def dp_shards(self) -> int:
        """Pieces each trained TP shard is cut into over the DP group: dp with fsdp, else 1."""
        return self.dp if self.fsdp != "no_shard" else 1

    def fsdp_rows(self, rows: int, dp_rank: int) -> tuple[int, int]:
        """(first row, row count) of a TP shard's dim 0 that DP rank `dp_rank` holds under fsdp (FSDP2's even
        split: chunks of ceil(rows / dp) rows, the last ones shorter or empty); (0, rows) without fsdp."""
        return shard_rows(rows, self.dp_shards, dp_rank if self.dp_shards > 1 else 0)

    def with_fsdp(self, fsdp: str) -> "ParallelLayout":
        """The same processes, with the role's own model sharding."""
        return self if fsdp == self.fsdp else replace(self, fsdp=fsdp)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size (the dense tp unless etp is set)."""
        return self.etp or self.tp

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise LayoutError(
                f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world_size} does not match the "
                f"{world_size} processes/devices available; change parallel.tp/pp/dp or the device count"
            )

    def check_model(self, num_attention_heads: int, num_query_groups: int, num_layers: int,
                    vocab_size: int | None = None, num_experts: int = 0, expert_ffn_hidden: int = 0) -> None:
        """Refuse a model that cannot be split by this layout, naming the option and the fix."""
        if num_attention_heads % self.tp:
            raise LayoutError(f"num_attention_heads={num_attention_heads} is not divisible by tp={self.tp}; "
                              f"choose tp in {divisors(num_attention_heads)}")
        if num_query_groups % self.tp:
            raise LayoutError(f"num_key_value_heads={num_query_groups} is not divisible by tp={self.tp}; "
                              f"choose tp in {divisors(num_query_groups)}")
        if self.ep > 1 and (not num_experts or num_experts % self.ep):
            raise LayoutError(f"ep={self.ep} needs a mixture-of-experts model whose experts it divides (the model "
                              f"has {num_experts}); choose ep in {divisors(num_experts) if num_experts else [1]}")
        widest = max(self.tp, self.expert_tp)  # an expert's shards: expert-TP ones, and dense TP ones to generate
        if num_experts and expert_ffn_hidden % widest:
            raise LayoutError(f"the experts' intermediate size {expert_ffn_hidden} is not divisible by max(tp, "
                              f"expert_tp) = {widest}; choose tp and expert_tp in {divisors(expert_ffn_hidden)}")
        stages = self.pp * (self.vpp or 1)
        if num_layers % stages:
            raise LayoutError(f"num_layers={num_layers} is not divisible by pp*vpp={stages}; "
                              f"choose pp in {divisors(num_layers)}")

    # ---- rank <-> coordinates ----------------------------------------------------------------
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return RankCoords(pp_rank, dp_rank, tp_rank)

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        if not (0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= tp < self.tp):
            raise LayoutError(f"coordinates pp={pp} dp={dp} tp={tp} outside layout {self}")
        return tp + self.tp * (dp + self.dp * pp)

    def ranks(self) -> Iterator[int]:
        return iter(range(self.world_size))

    # ---- groups (same membership Megatron builds) ---------------------------------------------
    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(p, d, t) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(p, d, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(p, d, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def model_parallel_groups(self) -> list[list[int]]:
        """TP x PP group of each DP replica, ordered by model-parallel rank (pp-major, tp-minor)."""
        return [[self.rank(p, d, t) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)]

    @property
    def expert_replicas(self) -> int:
        """Expert-data-parallel replicas of each expert-TP shard of each expert block, per pipeline stage."""
        return self.tp * self.dp // (self.expert_tp * self.ep)

    def expert_shards_of_tp_shard(self, tp_rank: int) -> list[int]:
        """The expert-TP shards an expert's dense TP shard `tp_rank` lies in (expert_tp <= tp: the one holding it)
        or is made of (expert_tp > tp: expert_tp / tp consecutive ones)."""
        if self.expert_tp <= self.tp:
            return [tp_rank // (self.tp // self.expert_tp)]
        join = self.expert_tp // self.tp
        return list(range(tp_rank * join, (tp_rank + 1) * join))

    def expert_coords(self, rank: int) -> ExpertCoords:
        """Where a rank sits on the expert grid (with etp = tp: expert block dp % ep, replica dp // ep)."""
        local = rank % (self.tp * self.dp)  # its index inside its pipeline stage
        return ExpertCoords(local % self.expert_tp, local // self.expert_tp % self.ep,
                            local // (self.expert_tp * self.ep))

    def _expert_rank(self, pp: int, etp: int, ep: int, edp: int) -> int:
        return pp * self.tp * self.dp + etp + self.expert_tp * (ep + self.ep * edp)

    def expert_parallel_groups(self) -> list[list[int]]:
        """Ranks holding different expert blocks at the same expert TP shard, by expert-parallel rank."""
        edp = self.expert_replicas
        return [[self._expert_rank(p, t, e, d) for e in range(self.ep)]
                for p in range(self.pp) for d in range(edp) for t in range(self.expert_tp)]

    def expert_tp_groups(self) -> list[list[int]]:
        """Ranks holding the expert TP shards of the same experts, by expert TP rank."""
        edp = self.expert_replicas
        return [[self._expert_rank(p, t, e, d) for t in range(self.expert_tp)]
                for p in range(self.pp) for d in range(edp) for e in range(self.ep)]

    def group_of(self, rank: int, groups: list[list[int]]) -> list[int]:
        for group in groups:
            if rank in group:
                return group
        raise LayoutError(f"rank {rank} is in no group")

    def model_parallel_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c.pp * self.tp + c.tp

    def is_collect_rank(self, rank: int) -> bool:
        """The rank whose output represents its DP shard: TP rank 0 of the last PP stage."""
        c = self.coords(rank)
        return c.tp == 0 and c.pp == self.pp - 1

    def collect_ranks(self) -> list[int]:
        """One rank per DP replica, in DP order, whose outputs the driver collects."""
        return [self.rank(self.pp - 1, d, 0) for d in range(self.dp)]

    def describe(self) -> str:
        extra = ", sp" if self.sequence_parallel else ""
        extra += f", vpp={self.vpp}" if self.vpp else ""
        extra += f", ep={self.ep}" if self.ep > 1 else ""
        extra += f", expert_tp={self.etp}" if self.etp is not None and self.etp != self.tp else ""
        extra += f", fsdp={self.fsdp}" if self.fsdp != "no_shard" else ""
        return f"tp={self.tp}, pp={self.pp}, dp={self.dp}{extra}"


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """(first row, row count) of piece `index` when `rows` are cut into `shards` pieces as FSDP2 cuts dim 0 (its
    Shard(0) placement: pieces of ceil(rows / shards) rows, the last ones shorter or empty)."""
    each = -(-rows // shards)
    start = min(rows, index * each)
    return start, min(each, rows - start)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def role_layout(parallel, devices: int, option: str, pool: str, held: "tuple[str, ParallelLayout] | None" = None
                ) -> ParallelLayout:
    """A role's layout from its `parallel` settings (config.ParallelConfig) on a pool of `devices`: dp fills the
    pool unless given. `held` = (first role, its layout) when the pool's processes already hold a layout:
    colocated roles share it, so an explicit tp/pp that differs is refused. The one check behind both the
    trainer's plan and the short API's constructors; LayoutError names `option` and the fix."""
    own = _own_layout(parallel, devices, option, pool)
    if held is None:
        return own
    first, shared = held
    explicit = (parallel.tp, parallel.pp) != (1, 1)
    if explicit and (own.tp, own.pp) != (shared.tp, shared.pp):
        raise LayoutError(f"{option}.parallel (tp={own.tp}, pp={own.pp}) differs from {first}'s (tp={shared.tp}, "
                          f"pp={shared.pp}) on the shared pool {pool!r}: colocated roles share one layout; drop "
                          f"{option}.parallel or put the role on a pool of its own ({option}.pool + resources.pools)")
    try:  # the shared processes, sharded as this role asks
        return shared.with_fsdp(getattr(parallel, "fsdp", "no_shard"))
    except LayoutError as exc:
        raise LayoutError(f"{option}.parallel: {exc}") from None


def _own_layout(parallel, devices: int, option: str, pool: str) -> ParallelLayout:
    if parallel.tp < 1 or parallel.pp < 1:
        raise LayoutError(f"{option}.parallel.tp/pp must be >= 1")
    if devices % (parallel.tp * parallel.pp):
        raise LayoutError(f"{option}.parallel: tp={parallel.tp} x pp={parallel.pp} does not divide pool {pool!r}'s "
                          f"{devices} devices; choose tp*pp in {divisors(devices)}")
    dp = parallel.dp or devices // (parallel.tp * parallel.pp)
    if parallel.tp * parallel.pp * dp != devices:
        raise LayoutError(f"{option}.parallel: tp*pp*dp = {parallel.tp}*{parallel.pp}*{dp} != {devices} devices of "
                          f"pool {pool!r}; leave dp unset to fill the pool")
    try:
        return ParallelLayout(tp=parallel.tp, pp=parallel.pp, dp=dp, sequence_parallel=parallel.sequence_parallel,
                              ep=parallel.ep, etp=parallel.expert_tp, fsdp=getattr(parallel, "fsdp", "no_shard"))
    except LayoutError as exc:
        raise LayoutError(f"{option}.parallel: {exc}") from None
