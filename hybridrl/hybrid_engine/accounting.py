"""Byte and memory accounting of the training -> generation transition, per rank and per strategy.

Every strategy is an all-gather inside its gather groups (plan.gather_groups). An all-gather needs equal
slots, so a group's slot is its largest contribution; what fills the slots beyond real data is padding and
is reported apart (it comes from unequal pipeline stages: the embedding on the first, the output layer on the
last, and from partition dims that do not divide). Per rank:
  recv_payload   bytes of other ranks' parameters received (Table 2 "communication volume")
  sent_payload   bytes sent, ring all-gather order (every chunk but the successor's)
  buffer_payload parameter bytes materialised for generation (Table 2 "peak memory"): the generation shard
                 (hybrid, in place: the rank's own training shard is its slot) or the whole model (baselines)
  redundant      bytes of the rank's training parameters also held in that buffer (Table 2 "redundancy")
Fully sharded data parallel (train.fsdp): a rank's training shard is its 1/d of the rows of its TP shard; hybrid
gathers inside the generation DP group (the d micro-DP groups of a generation shard, fsdp_gather.py), so a rank
receives its generation shard minus its own rows: Table 2's hybrid becomes (t p d - t_g p_g)/(t_g p_g t p d) M,
M/(t_g p_g), 0. DS-Chat's gather is unchanged (its ZeRO-3 partition is what fsdp holds); HybridFlow-V has no
whole TP x PP shard to gather and is not accounted.
Table 2 (M = model bytes): DS-Chat (tpd-1)/(tpd) M, M, M/(tpd); HybridFlow-V (tp-1)/(tp) M, M, M/(tp);
HybridFlow (tp - t_g p_g)/(t_g p_g t p) M, M/(t_g p_g), 0. The per-rank means reproduce these exactly when
every parameter is TP-partitioned; norms replicated over TP make the hybrid's generation shards hold them
once per generation TP rank, so its exact means use M' = P + t_g*R (P partitioned, R replicated bytes).
Mixture-of-experts (plan.py): hybrid's expert-parallel first stage adds its bytes to recv/sent; Table 2 then
holds for the dense part D = M - E and the experts E apart, with t p ep and t_g p_g e_g as the experts'
model-parallel sizes (table2's expert_bytes). With expert_tp != tp the first stage is a regroup (plan.py) and
Table 2 holds for the dense part only; the per-rank accounting here is exact either way.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction

from hybridrl.hybrid_engine.model_shapes import DTYPE_BYTES, model_shapes
from hybridrl.hybrid_engine.plan import HybridEnginePlan, check_strategy
from hybridrl.parallel.generation import GenerationLayout, check_generation_layout
from hybridrl.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class RankCost:
    rank: int
    recv_payload: int
    recv_padding: int
    sent_payload: int
    sent_padding: int
    buffer_payload: int
    buffer_padding: int
    redundant: int


@dataclass(frozen=True)
class StrategyCost:
    strategy: str
    ranks: tuple[RankCost, ...]

    def mean(self, field: str) -> Fraction:
        """Exact mean over ranks of a RankCost field."""
        return Fraction(sum(getattr(r, field) for r in self.ranks), len(self.ranks))

    def max(self, field: str) -> int:
        return max(getattr(r, field) for r in self.ranks)

    def summary(self) -> dict[str, float | int]:
        return {
            "bytes_per_gpu_mean": float(self.mean("recv_payload")),
            "bytes_per_gpu_max": self.max("recv_payload"),
            "padding_bytes_per_gpu_max": self.max("recv_padding"),
            "sent_bytes_per_gpu_max": self.max("sent_payload"),
            "peak_extra_bytes_per_gpu": self.max("buffer_payload"),
            "peak_extra_bytes_per_gpu_mean": float(self.mean("buffer_payload")),
            "peak_padding_bytes_per_gpu_max": self.max("buffer_padding"),
            "redundant_bytes_per_gpu_max": self.max("redundant"),
        }

    def per_rank(self) -> list[dict[str, int]]:
        return [asdict(r) for r in self.ranks]


def account(plan: HybridEnginePlan, strategy: str) -> StrategyCost:
    """Per-rank bytes sent/received and buffer memory of one strategy, from per-parameter shard sizes."""
    check_strategy(strategy)
    stage = plan.expert_first_stage(strategy)  # experts moved before the gather (received, sent, copied)
    first = {rank: moved[0] for rank, moved in stage.items()}
    first_sent = {rank: moved[1] for rank, moved in stage.items()}
    copied = {rank: moved[2] for rank, moved in stage.items()}
    costs: dict[int, RankCost] = {}
    for group in plan.gather_groups(strategy):
        contrib = [plan.contribution(r, strategy) for r in group]
        payloads = [c[0] for c in contrib]
        slot = max(c[0] + c[1] for c in contrib)
        total, n = sum(payloads), len(group)
        for i, rank in enumerate(group):
            recv = total - payloads[i] + first.get(rank, 0)
            sent = (total - payloads[(i + 1) % n] if n > 1 else 0) + first_sent.get(rank, 0)
            if strategy == "hybrid":
                # the rank's own training shard (and the experts gathered into its slot) is its slot of the
                # generation buffer (in place); only replicated tensors it holds but does not own in this group
                # are held twice (and, with expert_tp != tp, its training experts, which no slot is)
                redundant = plan.training_bytes(rank) + first.get(rank, 0) + copied.get(rank, 0) - payloads[i]
            elif strategy == "hybridflow_v":  # its training shard stays beside the gathered model
                redundant = plan.training_bytes(rank)
            else:  # ds_chat: the rank's ZeRO-3 partition stays beside the gathered full model
                redundant = payloads[i]
            pad_recv, pad_sent = ((n - 1) * slot - (total - payloads[i]),
                                  (n - 1) * slot - (sent - first_sent.get(rank, 0)))
            costs[rank] = RankCost(rank=rank, recv_payload=recv, recv_padding=pad_recv,
                                   sent_payload=sent, sent_padding=pad_sent if n > 1 else 0,
                                   buffer_payload=total, buffer_padding=n * slot - total, redundant=redundant)
    return StrategyCost(strategy, tuple(costs[r] for r in sorted(costs)))


def account_all(plan: HybridEnginePlan) -> dict[str, StrategyCost]:
    return {s: account(plan, s) for s in plan.strategies}


def table2(strategy: str, model_bytes: int | Fraction, train: ParallelLayout,
           gen: GenerationLayout, expert_bytes: int | Fraction = 0) -> dict[str, Fraction]:
    """HybridFlow Table 2 per-GPU communication, peak memory and redundancy, as exact fractions. With experts
    (expert_bytes E of model_bytes M) each formula is applied to the dense part and the experts apart, the
    experts' model-parallel sizes being t p ep (training) and t_g p_g e_g (generation)."""
    check_strategy(strategy)
    m, e = Fraction(model_bytes), Fraction(expert_bytes)
    t, p, d, tg, pg = train.tp, train.pp, train.dp, gen.tp, gen.pp
    if strategy == "ds_chat":
        return {"comm": Fraction(t * p * d - 1, t * p * d) * m, "peak": m, "redundancy": m / (t * p * d)}
    mp, emp = t * p, t * p * train.ep
    if strategy == "hybridflow_v":
        return {"comm": Fraction(mp - 1, mp) * (m - e) + Fraction(emp - 1, emp) * e, "peak": m,
                "redundancy": (m - e) / mp + e / emp}
    gmp, egmp = tg * pg, tg * pg * gen.ep
    if train.dp_shards > 1:  # fully sharded: a rank holds 1/d of its TP shard, and receives the rest of its
        return {"comm": Fraction(mp * d - gmp, gmp * mp * d) * m, "peak": m / gmp,  # generation shard
                "redundancy": Fraction(0)}
    return {"comm": Fraction(mp - gmp, gmp * mp) * (m - e) + Fraction(emp - egmp, egmp * emp) * e,
            "peak": (m - e) / gmp + e / egmp, "redundancy": Fraction(0)}


def hybrid_effective_bytes(plan: HybridEnginePlan) -> int:
    """M' = P + t_g*R: bytes of one replica's generation shards (norms once per generation TP rank)."""
    partitioned = sum(sum(row) for row in plan.table.partitioned)
    replicated = sum(plan.table.replicated)
    return (partitioned + plan.gen.tp * replicated) * plan.dtype_bytes


def plan_report(model: str, train: ParallelLayout, gen: GenerationLayout, dtype: str = "bf16",
                per_rank: bool = False) -> dict:
    """The plan of `model` (a preset or an HF config folder) for train -> gen and the cost of every strategy,
    as plain data (`hybridrl plan --json`). The layouts are checked before the model's shapes are built."""
    check_generation_layout(train, gen)  # layout-only checks first: cheap, before the model is built
    shapes = model_shapes(model)
    plan = HybridEnginePlan(train, gen, shapes, dtype_bytes=DTYPE_BYTES[dtype])
    costs = account_all(plan)
    report = {
        "model": model, "dtype": dtype, "model_bytes": plan.model_bytes,
        "expert_bytes": plan.expert_bytes, "num_experts": shapes.num_experts,
        "train": {"tp": train.tp, "pp": train.pp, "dp": train.dp, "ep": train.ep, "expert_tp": train.expert_tp,
                  "fsdp": train.fsdp},
        "gen": {"tp": gen.tp, "pp": gen.pp, "ep": gen.ep, "micro_dp": plan.groups.micro_dp_size,
                "dp": plan.groups.gen_dp_size},
        "expert_gather_groups": plan.expert_gather_groups("hybrid"),
        "micro_dp_groups": plan.groups.micro_dp_groups(),
        # fully sharded: the d micro-DP groups of each generation shard gather together (empty otherwise)
        "fsdp_gather_groups": plan.gather_groups("hybrid") if plan.dp_table else [],
        "gen_tp_groups": plan.groups.gen_tp_groups(),
        "gen_pp_groups": plan.groups.gen_pp_groups(),
        "gen_dp_groups": plan.groups.gen_dp_groups(),
        "strategies": {name: cost.summary() for name, cost in costs.items()},
    }
    if per_rank:
        report["ranks"] = [plan.describe_rank(r) for r in train.ranks()]
        report["per_rank_costs"] = {name: cost.per_rank() for name, cost in costs.items()}
    return report
