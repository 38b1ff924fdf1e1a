"""Projected training -> generation transition time from the plan's exact per-rank bytes.

Cost model (bandwidth-bound, stated so the numbers can be checked by hand):
  - GPUs are placed in rank order, `gpus_per_node` per node (node = rank // gpus_per_node).
  - Every strategy is one all-gather per gather group, all groups at once. Each member's slot (payload +
    padding: both travel) goes directly to every other member of its group; no forwarding, no overlap with
    compute, no latency term.
  - Bytes from a member on the same node move over NVLink at `nvlink_GBps` per GPU; bytes from another
    node share that node's inter-node link (`inter_node_Gbps`, per node) equally among the node's GPUs that
    receive across nodes.
  - A rank's time = intra-node bytes / NVLink + inter-node bytes / its share; the transition time is the
    slowest rank's.
Defaults are the HybridFlow paper's cluster: 8 x A100-80GB per node, NVLink 600 GB/s, 200 Gb/s between nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridrl.hybrid_engine.plan import HybridEnginePlan, check_strategy


@dataclass(frozen=True)
class Hardware:
    name: str = "HybridFlow testbed: 8 x A100-80GB per node, NVLink 600 GB/s, 200 Gb/s between nodes"
    gpus_per_node: int = 8
    nvlink_GBps: float = 600.0       # per GPU, inside a node
    inter_node_Gbps: float = 200.0   # per node, shared by its GPUs

    @property
    def inter_node_GBps(self) -> float:
        return self.inter_node_Gbps / 8.0

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node


PAPER_HARDWARE = Hardware()


@dataclass(frozen=True)
class TransitionTime:
    strategy: str
    seconds: float
    slowest_rank: int
    intra_node_bytes: int   # of the slowest rank
    inter_node_bytes: int   # of the slowest rank
    groups: int
    groups_crossing_nodes: int


def groups_crossing_nodes(groups: list[list[int]], hw: Hardware = PAPER_HARDWARE) -> int:
    return sum(1 for g in groups if len({hw.node_of(r) for r in g}) > 1)


def _stage_times(groups: list[list[int]], slot_of, hw: Hardware) -> dict[int, tuple[float, int, int]]:
    """Per rank (seconds, intra-node bytes, inter-node bytes) of one all-gather stage, all groups at once."""
    intra: dict[int, int] = {}
    inter: dict[int, int] = {}
    for group in groups:
        slot = max(slot_of(r) for r in group)
        for rank in group:
            same = sum(1 for other in group if other != rank and hw.node_of(other) == hw.node_of(rank))
            intra[rank] = same * slot
            inter[rank] = (len(group) - 1 - same) * slot
    receivers_per_node: dict[int, int] = {}
    for rank, nbytes in inter.items():
        if nbytes:
            receivers_per_node[hw.node_of(rank)] = receivers_per_node.get(hw.node_of(rank), 0) + 1
    times = {}
    for rank in sorted(intra):
        t = intra[rank] / (hw.nvlink_GBps * 1e9)
        if inter[rank]:
            t += inter[rank] / (hw.inter_node_GBps * 1e9 / receivers_per_node[hw.node_of(rank)])
        times[rank] = (t, intra[rank], inter[rank])
    return times


def transition_time(plan: HybridEnginePlan, strategy: str, hw: Hardware = PAPER_HARDWARE) -> TransitionTime:
    """Project one strategy's transition time on `hw` under the cost model above. With expert parallelism
    there are two stages one after the other (the expert-parallel gather, then the strategy's gather): their
    slowest ranks' times add; the bytes reported are the slowest rank's of the last stage plus its own of the
    first."""
    check_strategy(strategy)
    groups = plan.gather_groups(strategy)
    stages = [(groups, lambda r: sum(plan.contribution(r, strategy)))]
    if plan.expert_gather_groups(strategy):
        stages.insert(0, (plan.expert_gather_groups(strategy),
                          lambda r: sum(plan.expert_share(r, plan.train.ep))))
    seconds, intra, inter = 0.0, {}, {}
    for stage_groups, slot_of in stages:
        times = _stage_times(stage_groups, slot_of, hw)
        seconds += max(t for t, _, _ in times.values())
        for rank, (_, a, b) in times.items():
            intra[rank], inter[rank] = intra.get(rank, 0) + a, inter.get(rank, 0) + b
    slowest = max(sorted(times), key=lambda r: times[r][0])  # of the last stage
    return TransitionTime(strategy, seconds, slowest, intra[slowest], inter[slowest], len(groups),
                          groups_crossing_nodes(groups, hw))
