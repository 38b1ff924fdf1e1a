"""One pool of devices: the fastest layout for the roles placed on it (HybridFlow Algorithm 2, auto_parallel).

A pool holds a set of roles that run one after another (time-shared devices). Following hybridrl's trainer
(trainer/plan.py), colocated roles share one training layout (t, p, d); the actor additionally picks its
generation layout (t_g, p_g). For every (t, p, d) whose resident memory fits, every micro-batch size and
every generation layout are simulated with the cost model (cost.py) and the layout with the least busy
time of the pool (sum over the step's stages) wins. Layouts that do not fit are counted and excluded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridrl.automap.cost import (LM_ROLES, ModelStats, Net, Workload, activation_bytes, forward_bytes, forward_time,
                                   generation_buffer_bytes, generation_time, static_bytes, update_time)
from hybridrl.automap.hardware import Accelerator
from hybridrl.automap.judge_cost import JudgeWork, judge_cost
from hybridrl.automap.ledger import VLLM_RUNTIME_BYTES, RoleLoad
from hybridrl.hybrid_engine.cost_model import Hardware, transition_time
from hybridrl.hybrid_engine.model_shapes import ModelShapes
from hybridrl.hybrid_engine.plan import HybridEnginePlan
from hybridrl.parallel.generation import GenerationLayout, valid_generation_pp, valid_generation_tp
from hybridrl.parallel.layout import ParallelLayout, divisors

GEN, PREP, TRAIN = 0, 1, 2
STAGES = ("generation", "preparation", "training")
TRAINED = ("actor", "critic", "cost_critic")
LM = LM_ROLES + ("judge", "teacher")  # every role whose model ends in the LM head
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def stage_ops(roles: tuple[str, ...], work: Workload, reference_from_actor: bool = False) -> list[tuple[int, str, str]]:
    """(stage, role, op) of one RL step. Generation; experience preparation (log-probs, values, scores);
    training (actor and critic updates). reference_from_actor: a LoRA actor's adapters-off forward is the
    reference's log-prob pass."""
    ops = [(GEN, "actor", "generate")]
    if work.old_log_probs:
        ops.append((PREP, "actor", "log_prob"))
    if reference_from_actor:
        ops.append((PREP, "actor", "ref_log_prob"))
    for role in roles:
        if role in ("ref", "teacher"):
            ops.append((PREP, role, "log_prob"))
        elif role == "judge":
            ops.append((PREP, role, "judge"))
        elif role in ("critic", "cost_critic"):
            ops += [(PREP, role, "values"), (TRAIN, role, "update")]
        elif role in ("reward", "cost"):
            ops.append((PREP, role, "score"))
    ops.append((TRAIN, "actor", "update"))
    return ops


@dataclass
class Problem:
    """Everything the search needs besides the placement."""
    models: dict[str, ModelStats]   # role -> its model
    actor_shapes: ModelShapes       # for the 3D-HybridEngine transition (exact bytes)
    roles: tuple[str, ...]
    work: Workload
    acc: Accelerator
    gpus: int
    allow_generation_pp: bool = False  # hybridrl's trainer refuses rollout.pp > 1
    max_micro_batch: int | None = None  # largest micro-batch (sequences) to consider
    adapters: dict[str, float] = field(default_factory=dict)  # LoRA roles: adapter share of the parameters
    reference_from_actor: bool = False  # a LoRA actor is its own reference (no "ref" role)
    judge: JudgeWork | None = None  # a generative judge scores the responses (the "judge" role)
    engine: str = "native"  # the actor's rollout engine: vllm keeps its own copy of the weights (ledger.py)
    offload: tuple[bool, bool, bool] = (False, False, False)  # actor.offload grads, optimizer, params
    simulations: int = 0
    oom_excluded: int = 0
    _transitions: dict = field(default_factory=dict)

    def transition(self, t: int, p: int, d: int, tg: int, pg: int, per_node: int) -> float:
        """Training -> generation switch of the actor: the plan's exact bytes on this machine's links."""
        if (tg, pg) == (t, p):
            return 0.0
        key = (t, p, d, tg, pg, per_node)
        if key not in self._transitions:
            plan = HybridEnginePlan(ParallelLayout(tp=t, pp=p, dp=d), GenerationLayout(tp=tg, pp=pg),
                                    self.actor_shapes, dtype_bytes=self.acc.param_bytes)
            hw = Hardware(name=self.acc.name, gpus_per_node=per_node, nvlink_GBps=self.acc.intra_node_bw / 1e9,
                          inter_node_Gbps=self.acc.inter_node_bw * 8 / 1e9 * per_node / self.acc.gpus_per_node)
            self._transitions[key] = transition_time(plan, "hybrid", hw).seconds + self.acc.collective_latency
        return self._transitions[key]


@dataclass(frozen=True)
class PoolChoice:
    roles: tuple[str, ...]
    devices: int
    per_node: int
    tp: int
    pp: int
    dp: int
    gen_tp: int | None        # None: the actor is not here, or generates on a rollout pool
    gen_pp: int | None
    micro_batch: int
    recompute: bool
    stages: tuple[float, float, float]
    ops: dict                 # "role.op" -> seconds on this pool
    static_bytes: float
    peak_bytes: float
    vllm_utilization: float | None = None  # rollout.vllm.gpu_memory_utilization: the room vLLM may take here

    @property
    def busy(self) -> float:
        return sum(self.stages)


def _fits_model(models: list[ModelStats], t: int, p: int) -> bool:
    return all(m.heads % t == 0 and m.kv_heads % t == 0 and m.layers % p == 0 for m in models)


def _generation_layouts(prob: Problem, actor: ModelStats, t: int, p: int,
                        fixed: tuple[int, int] | None) -> list[tuple[int, int]]:
    if fixed is not None:
        return [fixed]
    pgs = valid_generation_pp(p, actor.layers) if prob.allow_generation_pp else [1]
    return [(tg, pg) for tg in valid_generation_tp(t, actor.heads, actor.kv_heads) for pg in pgs]


def best_pool(prob: Problem, roles: tuple[str, ...], devices: int, per_node: int, generates: bool = True,
              fixed: tuple[int, int, int, int] | None = None) -> PoolChoice | None:
    """The fastest layout of `roles` on `devices` (None: nothing fits). fixed = (t, p, t_g, p_g) pins it."""
    acc, work = prob.acc, prob.work
    models = [prob.models[r] for r in roles]
    cap = acc.memory_bytes - acc.memory_reserve_bytes
    net = Net(acc, per_node, devices)
    ops_here = [(stage, role, op) for stage, role, op in stage_ops(prob.roles, work, prob.reference_from_actor)
                if role in roles and not (op == "generate" and not generates)]
    best: PoolChoice | None = None
    for t in divisors(devices):
        if t > per_node or per_node % t or (fixed and t != fixed[0]):
            continue
        for p in divisors(devices // t):
            if (fixed and p != fixed[1]) or not _fits_model(models, t, p):
                continue
            d = devices // (t * p)
            if any(r in TRAINED and (work.sequences % d or work.sequences // d < work.mini_batches) for r in roles):
                continue
            prob.simulations += 1
            static = sum(static_bytes(prob.models[r], r in LM, r in TRAINED, t, p, d, acc, prob.adapters.get(r, 0.0))
                         for r in roles)
            if static > cap:
                prob.oom_excluded += 1
                continue
            gen = _best_generation(prob, t, p, d, per_node, static, cap, net,
                                   fixed[2:] if fixed else None) if "actor" in roles and generates else None
            if "actor" in roles and generates and gen is None:
                continue
            for choice in _micro_batches(prob, roles, ops_here, t, p, d, per_node, static, cap, net, gen):
                if best is None or choice.busy < best.busy:
                    best = choice
    return best


def _best_generation(prob: Problem, t: int, p: int, d: int, per_node: int, static: float, cap: float, net: Net,
                     fixed: tuple[int, int] | None) -> tuple[int, int, float, float, float, float | None] | None:
    """(t_g, p_g, generation s, transition s, peak bytes, vLLM's share of the device or None) of the fastest
    generation layout that fits."""
    actor, acc, work = prob.models["actor"], prob.acc, prob.work
    best = None
    for tg, pg in _generation_layouts(prob, actor, t, p, fixed):
        prob.simulations += 1
        buffer = generation_buffer_bytes(actor, t, p, tg, pg, acc)
        per_sequence = work.tokens * actor.kv_bytes_per_token(tg, pg, acc.param_bytes)
        resident, engine = static, 0.0
        if prob.engine == "vllm":  # vLLM's own copy and runtime beside what stays (ledger.py), offload counted
            resident, buffer = _vllm_resident(prob, t, p, d, static, buffer)
            engine = acc.param_bytes * actor.shard_params(tg, pg) + VLLM_RUNTIME_BYTES
        batch_cap = math.floor((cap - resident - buffer - engine) / per_sequence)
        if batch_cap < 1:
            prob.oom_excluded += 1
            continue
        replicas = t * p * d // (tg * pg)
        seconds = generation_time(actor, tg, pg, replicas, batch_cap, work, net)
        switch = prob.transition(t, p, d, tg, pg, per_node)
        used = min(batch_cap, math.ceil(work.generated / replicas), work.max_decode_batch)
        peak = resident + buffer + engine + used * per_sequence
        share = math.floor(100 * (cap - resident - buffer) / acc.memory_bytes) / 100 if prob.engine == "vllm" else None
        if best is None or seconds + switch < best[2] + best[3]:
            best = (tg, pg, seconds, switch, peak, share)
    return best


def _vllm_resident(prob: Problem, t: int, p: int, d: int, static: float, buffer: float) -> tuple[float, float]:
    """(bytes resident while vLLM generates, the hybrid engine's buffer then): the actor's offloaded states away;
    a LoRA actor's adapters are served on vLLM's own base (nothing resharded)."""
    grads, optimizer, params = prob.offload
    actor = RoleLoad("actor", prob.models["actor"], trained=True, t=t, p=p, d=d, dtype_bytes=prob.acc.param_bytes,
                     adapters=prob.adapters.get("actor", 0.0), offload_grads=grads, offload_optimizer=optimizer,
                     offload_params=params)
    states = actor.states()
    resident = static - sum(states[name] for name in actor.away("generation"))
    return resident, 0.0 if params or prob.reference_from_actor else buffer


def _micro_batches(prob: Problem, roles: tuple[str, ...], ops_here: list, t: int, p: int, d: int, per_node: int,
                   static: float, cap: float, net: Net, gen: tuple | None):
    """One PoolChoice per micro-batch size that fits (full recompute only where activations would not)."""
    acc, work = prob.acc, prob.work
    per_rank = math.ceil(work.sequences / d)
    for mb in MICRO_BATCHES:
        if mb > 1 and (mb > per_rank or (prob.max_micro_batch and mb > prob.max_micro_batch)):
            break
        prob.simulations += 1
        micro = math.ceil(math.ceil(work.sequences / (work.mini_batches * d)) / mb)
        fwd = max((forward_bytes(prob.models[r], r in LM, t, mb, work.tokens, acc) for r in roles), default=0.0)
        recompute = False
        train = max((activation_bytes(prob.models[r], r in LM, t, p, mb, work.tokens, min(p, micro), False, acc)
                     for r in roles if r in TRAINED), default=0.0)
        if static + train > cap:
            recompute = True
            train = max(activation_bytes(prob.models[r], r in LM, t, p, mb, work.tokens, min(p, micro), True,
                                         acc) for r in roles if r in TRAINED)
        if static + max(fwd, train) > cap:
            prob.oom_excluded += 1
            break  # larger micro-batches need more
        stages = [0.0, 0.0, 0.0]
        ops: dict[str, float] = {}
        peak_extra = 0.0  # the judge's generation buffer and KV cache, held while it judges
        for stage, role, op in ops_here:
            model, lm = prob.models[role], role in LM
            if op == "judge":
                judged = judge_cost(model, prob.judge or JudgeWork(), work, t, p, d, mb, net, static, cap)
                if judged is None:  # its KV cache does not fit beside what the pool holds
                    prob.oom_excluded += 1
                    return
                seconds, judge_peak = judged
                peak_extra = max(peak_extra, judge_peak)
            elif op == "generate":
                seconds = gen[2]
                ops["actor.transition"] = gen[3]
                stages[stage] += gen[3]
            elif op == "update":
                seconds = update_time(model, lm, t, p, d, mb, work, net, recompute, prob.adapters.get(role, 0.0))
            else:
                count = work.scored if op == "score" and role == "reward" else work.sequences
                seconds = forward_time(model, lm, t, p, d, mb, count, work.tokens, net)
            ops[f"{role}.{op}"] = seconds
            stages[stage] += seconds
        peak = max(static + fwd, static + train, gen[4] if gen else 0.0, peak_extra)
        yield PoolChoice(roles, t * p * d, per_node, t, p, d, gen[0] if gen else None, gen[1] if gen else None, mb,
                         recompute, tuple(stages), ops, static, peak, gen[5] if gen else None)


def best_rollout_pool(prob: Problem, devices: int, per_node: int) -> PoolChoice | None:
    """A separate rollout pool (disaggregated generation; hybridrl's trainer cannot run it yet): R replicas
    of (t_g, p_g) holding only generation weights and the KV cache."""
    actor, acc, work = prob.models["actor"], prob.acc, prob.work
    cap = acc.memory_bytes - acc.memory_reserve_bytes
    net = Net(acc, per_node, devices)
    best = None
    for tg in divisors(devices):
        if tg > per_node or per_node % tg or actor.heads % tg or actor.kv_heads % tg:
            continue
        for pg in divisors(devices // tg):
            if actor.layers % pg or (pg > 1 and not prob.allow_generation_pp):
                continue
            prob.simulations += 1
            weights = acc.param_bytes * actor.shard_params(tg, pg)
            per_sequence = work.tokens * actor.kv_bytes_per_token(tg, pg, acc.param_bytes)
            batch_cap = math.floor((cap - weights) / per_sequence)
            if batch_cap < 1:
                prob.oom_excluded += 1
                continue
            replicas = devices // (tg * pg)
            seconds = generation_time(actor, tg, pg, replicas, batch_cap, work, net)
            used = min(batch_cap, math.ceil(work.generated / replicas), work.max_decode_batch)
            choice = PoolChoice(("rollout",), devices, per_node, tg, pg, replicas, tg, pg, 0, False,
                                (seconds, 0.0, 0.0), {"rollout.generate": seconds}, weights,
                                weights + used * per_sequence)
            if best is None or choice.busy < best.busy:
                best = choice
    return best


def weight_sync_time(prob: Problem, rollout: PoolChoice) -> float:
    """Trainer -> rollout pool after each update: every rollout device receives its generation shard over
    the inter-node link (the pools sit on different nodes)."""
    acc = prob.acc
    nbytes = acc.param_bytes * prob.models["actor"].shard_params(rollout.gen_tp, rollout.gen_pp)
    return nbytes / (acc.inter_node_bw / acc.gpus_per_node) + acc.inter_node_latency
