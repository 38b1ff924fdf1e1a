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


def transition_time(plan: HybridEnginePlan, strategy: str, hw: Hardware = PAPER_HARDWARE) -> TransitionTime:
    """Project one strategy's transition time on `hw` under the cost model above."""
    check_strategy(strategy)
    groups = plan.gather_groups(strategy)
    intra: dict[int, int] = {}
    inter: dict[int, int] = {}
    for group in groups:
        slot = max(sum(plan.contribution(r, strategy)) for r in group)
        for rank in group:
            same = sum(1 for other in group if other != rank and hw.node_of(other) == hw.node_of(rank))
            intra[rank] = same * slot
            inter[rank] = (len(group) - 1 - same) * slot
    receivers_per_node: dict[int, int] = {}
    for rank, nbytes in inter.items():
        if nbytes:
            receivers_per_node[hw.node_of(rank)] = receivers_per_node.get(hw.node_of(rank), 0) + 1
    seconds, slowest = -1.0, 0
    for rank in sorted(intra):
        t = intra[rank] / (hw.nvlink_GBps * 1e9)
        if inter[rank]:
            share = hw.inter_node_GBps * 1e9 / receivers_per_node[hw.node_of(rank)]
            t += inter[rank] / share
        if t > seconds:
            seconds, slowest = t, rank
    return TransitionTime(strategy, seconds, slowest, intra[slowest], inter[slowest], len(groups),
                          groups_crossing_nodes(groups, hw))
