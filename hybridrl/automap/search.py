"""Automatic device mapping (HybridFlow Algorithm 1): placement, device counts and layouts chosen by simulation.

For every placement of the algorithm's roles (every set partition: all colocated, actor+ref vs
critic+reward, fully standalone, ... and, when asked, the actor's generation on a pool of its own), for
every split of the devices into those pools, each pool gets its fastest layout (pools.best_pool) and the
step is simulated stage by stage (d_cost): roles on one pool add up; roles on different pools run a stage
in parallel ("hybridflow" execution, the paper's model) or one after another ("trainer": hybridrl train
today blocks on every call). The fastest mapping wins.

Units that hybridrl's config places together: the critic and Safe-RLHF's cost critic share `critic:`.

Pruning (so 70B on 128 GPUs takes seconds): pools are whole nodes ("hybridflow") or an even share of every
node ("trainer": hybridrl's ResourcePool spreads each pool over all nodes); TP stays inside a node; each
(roles, devices) pool is solved once and reused across placements (the paper's caching); allocations skip
pool sizes on which the pool's roles do not fit (A_min); layouts that do not fit memory are not timed further.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator

from hybridrl.automap.cost import ModelStats
from hybridrl.automap.pools import STAGES, PoolChoice, Problem, best_pool, best_rollout_pool, weight_sync_time
from hybridrl.hybrid_engine.model_shapes import model_shapes
from hybridrl.models.lora import adapter_numel

UNITS: dict[str, tuple[str, ...]] = {"actor": ("actor",), "ref": ("ref",), "critic": ("critic", "cost_critic"),
                                     "reward": ("reward",), "cost": ("cost",), "judge": ("judge",),
                                     "teacher": ("teacher",)}
GiB = 1 << 30


@dataclass(frozen=True)
class Execution:
    name: str
    concurrent: bool   # roles on different pools run a stage in parallel
    whole_nodes: bool  # a pool is whole nodes (else: an even share of every node)
    description: str


EXECUTIONS = {
    "hybridflow": Execution("hybridflow", True, True,
                            "HybridFlow's d_cost: pools are whole nodes; different pools run a stage in parallel"),
    "trainer": Execution("trainer", False, False,
                         "hybridrl train today: every call blocks, so pools run one after another; each pool "
                         "spans all nodes evenly (ResourcePool)"),
}


def roles_for(algorithm: str, reward_model: bool = True, cost_model: bool = True, reference: bool = True,
              judge: bool = False, teacher: bool = False) -> tuple[str, ...]:
    """The roles with devices of one algorithm (from its registry entry); reward / cost as models or not; a
    generative judge and a distillation teacher when given."""
    # start-up time: the registry imports torch (its estimators); every `hybridrl` command imports this
    # module with its parser (cli/plan.py); only `plan --auto` and resources.auto_map search
    import hybridrl.algorithms  # noqa: F401  (registers the built-in algorithms)
    from hybridrl.algorithms.registry import get_algorithm

    spec = get_algorithm(algorithm)
    roles = ["actor"]
    if reference and spec.uses_reference:
        roles.append("ref")
    if spec.needs_critic:
        roles.append("critic")
        if spec.needs_cost_model:
            roles.append("cost_critic")
    if reward_model:
        roles.append("reward")
    if spec.needs_cost_model and cost_model:
        roles.append("cost")
    return tuple(roles + ["judge"] * judge + ["teacher"] * (teacher or spec.needs_teacher))


def make_problem(model: str, algorithm: str, acc, gpus: int, work, critic_model: str | None = None,
                 reward_model: str | None = "same", cost_model: str | None = "same", reference: bool = True,
                 allow_generation_pp: bool = False, lora: dict[str, tuple[int, list[str] | None]] | None = None,
                 judge_model: str | None = None, judge_work=None, teacher_model: str | None = None,
                 engine: str = "native", offload: tuple[bool, bool, bool] = (False, False, False)) -> Problem:
    """The search's input. model: a preset or HF folder (the actor and reference); critic_model: the critics'
    (None: the actor's); reward_model / cost_model: "same" (the actor's size), None (a rule function: no
    devices) or another preset / folder; lora: {role: (rank, target_modules)} of the LoRA roles (actor, critic):
    their adapters' share of the parameters is trained, and a LoRA actor is its own reference; judge_model: a
    generative judge (preset / folder, "same"; its automap.judge_cost.JudgeWork in judge_work); teacher_model: an
    on-policy distillation teacher; engine: the actor's rollout engine (vllm counts its own copy, runtime and KV
    cache beside what stays on the GPU); offload: actor.offload (grads, optimizer, params)."""
    shapes = model_shapes(model)
    actor = ModelStats.from_shapes(shapes)
    lora = lora or {}
    from_actor = reference and "actor" in lora
    reference = reference and not from_actor

    def stats(name: str | None) -> ModelStats:
        return actor if name in (None, "same", model) else ModelStats.from_shapes(model_shapes(name))

    roles = roles_for(algorithm, reward_model=reward_model is not None, cost_model=cost_model is not None,
                      reference=reference, judge=judge_model is not None, teacher=teacher_model is not None)
    if "teacher" in roles and teacher_model is None:
        raise ValueError(f"algorithm {algorithm!r} distils from a teacher: give its model (--teacher-model)")
    models = {"actor": actor, "ref": actor, "critic": stats(critic_model), "cost_critic": stats(critic_model),
              "reward": stats(reward_model), "cost": stats(cost_model), "judge": stats(judge_model),
              "teacher": stats(teacher_model)}
    adapters = {}
    for role, (rank, targets) in lora.items():
        role_shapes = shapes if role == "actor" or critic_model in (None, "same", model) else model_shapes(critic_model)
        adapters[role] = adapter_numel(((s.name, s.shape) for s in role_shapes.params), rank, targets) / \
            role_shapes.numel
        if role == "critic":
            adapters["cost_critic"] = adapters[role]
    return Problem({r: models[r] for r in roles}, shapes, roles, work, acc, gpus, allow_generation_pp,
                   adapters=adapters, reference_from_actor=from_actor, judge=judge_work, engine=engine,
                   offload=tuple(offload))


def set_partitions(items: list[str]) -> Iterator[list[list[str]]]:
    """Every way to split `items` into non-empty blocks (Bell number many)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        for i in range(len(partition)):
            yield partition[:i] + [[first] + partition[i]] + partition[i + 1:]
        yield [[first]] + partition


@dataclass
class Mapping:
    pools: list[PoolChoice]
    stages: tuple[float, float, float]
    sync_s: float = 0.0   # weight sync to a separate rollout pool
    notes: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return sum(self.stages)

    @property
    def runnable(self) -> bool:
        """hybridrl's trainer can run it (no separate rollout pool, generation without pipeline stages)."""
        return all(p.roles != ("rollout",) and (p.gen_pp or 1) == 1 for p in self.pools)

    def units(self) -> list[list[str]]:
        return [[u for u, members in UNITS.items() if members[0] in p.roles] or list(p.roles) for p in self.pools]

    @property
    def kind(self) -> str:
        blocks = [sorted(b) for b in self.units() if b != ["rollout"]]
        rollout = any(p.roles == ("rollout",) for p in self.pools)
        if len(blocks) == 1:
            kind = "colocate"
        elif all(len(b) == 1 for b in blocks):
            kind = "standalone"
        elif len(blocks) == 2 and ["actor", "ref"] in blocks:
            kind = "split"
        else:
            kind = "custom"
        return kind + (" + rollout pool" if rollout else "")

    @property
    def label(self) -> str:
        return " | ".join(f"{'+'.join(b)}:{p.devices}" for b, p in zip(self.units(), self.pools))


def pool_name(choice: PoolChoice) -> str:
    """hybridrl's pool names: the actor's pool is `default`; others are named after their units."""
    if "actor" in choice.roles:
        return "default"
    return "_".join(u for u, members in UNITS.items() if members[0] in choice.roles) or "_".join(choice.roles)


@dataclass
class SearchResult:
    best: Mapping
    top: list[Mapping]
    by_kind: dict[str, Mapping]
    execution: Execution
    counts: dict[str, int]
    seconds: float


class Mapper:
    """Algorithm 1 over one Problem and one Execution; pools are solved once and cached."""

    def __init__(self, prob: Problem, execution: str = "hybridflow") -> None:
        if execution not in EXECUTIONS:
            raise ValueError(f"execution {execution!r}; choose one of {', '.join(EXECUTIONS)}")
        self.prob, self.execution = prob, EXECUTIONS[execution]
        acc, gpus = prob.acc, prob.gpus
        self.nodes = 1 if gpus <= acc.gpus_per_node else gpus // acc.gpus_per_node
        if gpus > acc.gpus_per_node and gpus % acc.gpus_per_node:
            raise ValueError(f"--gpus {gpus} is not a whole number of {acc.gpus_per_node}-GPU nodes (--nodes-of)")
        if self.nodes == 1:
            self.sizes = list(range(1, gpus + 1))
        elif self.execution.whole_nodes:
            self.sizes = list(range(acc.gpus_per_node, gpus + 1, acc.gpus_per_node))
        else:
            self.sizes = list(range(self.nodes, gpus + 1, self.nodes))
        self._pools: dict[tuple, PoolChoice | None] = {}
        self.mappings = 0

    def per_node(self, devices: int) -> int:
        if self.nodes == 1:
            return devices
        return min(devices, self.prob.acc.gpus_per_node) if self.execution.whole_nodes else devices // self.nodes

    def pool(self, roles: tuple[str, ...], devices: int, generates: bool = True,
             fixed: tuple[int, int, int, int] | None = None) -> PoolChoice | None:
        key = (roles, devices, generates, fixed)
        if key not in self._pools:
            if roles == ("rollout",):
                self._pools[key] = best_rollout_pool(self.prob, devices, self.per_node(devices))
            else:
                self._pools[key] = best_pool(self.prob, roles, devices, self.per_node(devices), generates, fixed)
        return self._pools[key]

    def combine(self, pools: list[PoolChoice]) -> Mapping:
        """d_cost: per stage, roles on one pool add up; pools in parallel (max) or in sequence (sum)."""
        sync = 0.0
        stages = []
        for i in range(len(STAGES)):
            per_pool = [p.stages[i] for p in pools]
            stages.append(max(per_pool) if self.execution.concurrent else sum(per_pool))
        rollout = next((p for p in pools if p.roles == ("rollout",)), None)
        if rollout is not None:
            sync = weight_sync_time(self.prob, rollout)
            stages[0] += sync
        return Mapping(pools, tuple(stages), sync)

    def _allocations(self, blocks: list[tuple[str, ...]], generates: list[bool], left: int) -> Iterator[list[PoolChoice]]:
        if not blocks:
            if left == 0:
                yield []
            return
        for size in self.sizes:
            if size > left:
                break
            if len(blocks) == 1 and size != left:
                continue
            choice = self.pool(blocks[0], size, generates[0])
            if choice is None:
                continue
            for rest in self._allocations(blocks[1:], generates[1:], left - size):
                yield [choice] + rest

    def search(self, top_k: int = 5, rollout_pool: bool = False, alone: tuple[str, ...] = ()) -> SearchResult:
        """The fastest mappings; `alone`: units that must have a pool of their own (e.g. the judge, served apart)."""
        start = time.perf_counter()
        prob = self.prob
        units = [u for u, members in UNITS.items() if members[0] in prob.roles]
        heap: list[tuple[float, int, Mapping]] = []
        by_kind: dict[str, Mapping] = {}
        placements = 0
        counter = itertools.count()
        for partition in set_partitions(units):
            if any(unit in units and [unit] not in partition for unit in alone):
                continue
            partition.sort(key=lambda block: "actor" not in block)  # the actor's pool first
            blocks = [tuple(r for u in block for r in UNITS[u] if r in prob.roles) for block in partition]
            variants = [(blocks, [True] * len(blocks))]
            if rollout_pool:
                variants.append((blocks + [("rollout",)], [False] * len(blocks) + [False]))
            for pool_roles, generates in variants:
                placements += 1
                for pools in self._allocations(pool_roles, generates, prob.gpus):
                    self.mappings += 1
                    mapping = self.combine(pools)
                    kind = mapping.kind
                    if kind not in by_kind or mapping.step_s < by_kind[kind].step_s:
                        by_kind[kind] = mapping
                    item = (-mapping.step_s, next(counter), mapping)
                    if len(heap) < top_k:
                        heapq.heappush(heap, item)
                    elif item > heap[0]:
                        heapq.heapreplace(heap, item)
        if not heap:
            raise ValueError(f"no mapping fits: the roles {list(prob.roles)} do not fit in the memory of "
                             f"{prob.gpus} x {prob.acc.name} at any layout; use more or larger devices")
        top = [m for _, _, m in sorted(heap, key=lambda item: -item[0])]
        counts = {"placements": placements, "mappings": self.mappings,
                  "pool_layouts_solved": sum(1 for v in self._pools.values() if v is not None),
                  "simulations": prob.simulations, "oom_excluded": prob.oom_excluded}
        return SearchResult(top[0], top, by_kind, self.execution, counts, time.perf_counter() - start)

    def evaluate(self, pools: list[tuple[tuple[str, ...], int, tuple[int, int, int, int] | None]]) -> Mapping | None:
        """A given mapping: [(roles, devices, (t, p, t_g, p_g) or None: the pool's best)] (None: infeasible)."""
        choices = []
        for roles, devices, fixed in pools:
            choice = self.pool(roles, devices, True, fixed)
            if choice is None:
                return None
            choices.append(choice)
        return self.combine(choices)


def mapping_json(mapping: Mapping, prob: Problem) -> dict:
    """The mapping as `hybridrl plan --auto --json` prints it."""
    placement, roles, ops = {}, {}, {}
    rollout = next((p for p in mapping.pools if p.roles == ("rollout",)), None)
    for choice in mapping.pools:
        name = pool_name(choice)
        placement[name] = {"roles": list(choice.roles), "devices": choice.devices,
                           "peak_gb_per_gpu": round(choice.peak_bytes / GiB, 2)}
        ops.update(choice.ops)
        if choice.roles == ("rollout",):
            continue
        for role in choice.roles:
            roles[role] = {"pool": name, "parallel": {"tp": choice.tp, "pp": choice.pp, "dp": choice.dp},
                           "micro_batch_size": choice.micro_batch, "recompute": choice.recompute}
        if "actor" in choice.roles:
            gen = rollout or choice
            roles["actor"]["generation"] = {"tp": gen.gen_tp, "pp": gen.gen_pp,
                                            "replicas": gen.devices // (gen.gen_tp * gen.gen_pp),
                                            "pool": pool_name(gen), "engine": prob.engine}
            if gen.vllm_utilization is not None:  # what rollout.vllm.gpu_memory_utilization may be here
                roles["actor"]["generation"]["vllm_gpu_memory_utilization"] = gen.vllm_utilization
    if mapping.sync_s:
        ops["rollout.weight_sync"] = mapping.sync_s
    work = prob.work
    return {
        "placement": placement, "kind": mapping.kind, "label": mapping.label, "roles": roles,
        "runnable": mapping.runnable,
        "estimate": {"step_s": round(mapping.step_s, 4),
                     "stages": {name: round(s, 4) for name, s in zip(STAGES, mapping.stages)},
                     "ops": {k: round(v, 4) for k, v in ops.items()},
                     "tokens_per_s": round(work.sequences * work.tokens / mapping.step_s, 1)},
        "memory": {"peak_gb_per_gpu": round(max(p.peak_bytes for p in mapping.pools) / GiB, 2), "unit": "GiB",
                   "capacity_gb_per_gpu": round(prob.acc.memory_bytes / GiB, 2)},
    }
