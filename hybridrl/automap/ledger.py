"""The memory ledger: what stays on one GPU of a pool in each phase of an RL step (issue 36 Must show 3).

Per role placed on the pool, per device (layout t, p, d; experts split over ep x etp; pb parameter bytes):
  weights      pb x the shard: dense parameters of the largest pipeline stage / t, experts / (p ep etp); a LoRA
               role adds its adapters (a share s of the parameters)
  gradients    trained roles: Megatron's fp32 main_grad buffer, 4 B per parameter of the shard (LoRA: the adapters')
  optimizer    trained roles, distributed optimizer: fp32 master weights (bf16 / fp16 models) + Adam's two moments,
               12 B per parameter (8 in fp32), over the data-parallel ranks that hold a tensor (dense: d; experts:
               t d / (ep etp))
  activations  one micro-batch of its max_tokens_per_micro_batch (cost.activation_bytes / cost.forward_bytes)
The actor's generation, on the pool it trains on:
  3D-HybridEngine  the generation shard (t_g, p_g = 1, every expert at TP t_g) beyond the actor's own training
                   shard, which is a slot of it; none when vLLM serves a LoRA actor's adapters (nothing resharded)
  vLLM             its own copy of the generation shard, its runtime beside weights and KV cache (activations of its
                   profile run, CUDA graphs, sampler: VLLM_RUNTIME_BYTES, an assumption until measured on a GPU by
                   scripts/gpu_check.sh) and its KV cache: vLLM takes gpu_memory_utilization x the device's memory for
                   all three (or weights + runtime + kv_cache_memory_bytes when that is set); asleep between
                   generations it keeps VLLM_ASLEEP_BYTES
  native engine    the KV cache of rollout.max_batch_size sequences of the context and their decode step's logits
                   and sampling (DECODE_BYTES_PER_LOGIT a vocabulary entry), or of as many as KV_SHARE_OF_FREE of
                   the room left in the phase holds (`decode_rows`, the engine's own rule)
  offload          actor.offload / critic.offload: gradients and optimizer state leave the GPU from the end of the
                   role's update to the start of its next; actor.offload.params: the actor's weights (and the
                   generation shard) while vLLM generates, after the push (during the push both copies are resident)
Phases: push:<role> (its weights and vLLM's copy both resident), generation:<role>, experience (forward passes:
log-probs, values, rewards; offloaded states away), update:<role> (its own states back, the others' away).
The capacity is the device's memory less Accelerator.memory_reserve_bytes (CUDA context, NCCL, fragmentation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridrl.automap.cost import ModelStats, activation_bytes, forward_bytes
from hybridrl.automap.hardware import Accelerator
from hybridrl.decode_memory import KV_SHARE_OF_FREE, decode_row_bytes, decode_rows

GiB = 1 << 30
VLLM_RUNTIME_BYTES = 3 * GiB  # vLLM awake besides weights and KV cache (assumed; gpu_check.sh measures it)
VLLM_ASLEEP_BYTES = 1 * GiB  # vLLM asleep: CUDA graphs' pool, NCCL buffers (assumed)
STATES = ("weights", "gradients", "optimizer")


@dataclass(frozen=True)
class RoleLoad:
    """One role's model on one device of its pool."""
    role: str
    model: ModelStats
    expert_params: int = 0          # routed-expert parameters of the whole model (0: dense)
    lm_head: bool = True
    trained: bool = False
    t: int = 1
    p: int = 1
    d: int = 1
    ep: int = 1
    etp: int | None = None          # experts' TP (None: t)
    dtype_bytes: int = 2
    adapters: float = 0.0           # LoRA: the adapters' share of the parameters
    offload_grads: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False    # the actor beside vLLM only
    tokens_per_micro_batch: int = 0  # activations of one micro-batch (0: none counted)
    megatron: bool = True           # False: only a vLLM engine holds this role's weights (a generating judge)

    def shard(self, tp: int | None = None, pp: int | None = None, training: bool = True) -> float:
        """Parameters on one device: at the training layout, or (training=False) at generation TP `tp`, p_g = 1,
        every expert on each generation rank at TP `tp`."""
        t, p = (self.t, self.p) if training else (tp, pp or 1)
        experts = self.expert_params / p
        experts /= (self.ep * (self.etp or self.t)) if training else t
        return self.model.shard_params(t, p, self.lm_head) - self.expert_params / (p * t) + experts

    def states(self) -> dict[str, float]:
        """weights, gradients and optimizer bytes resident between steps (before any offload)."""
        pb, shard = self.dtype_bytes, self.shard()
        out = {"weights": pb * shard * (1 + self.adapters) if self.megatron else 0.0, "gradients": 0.0,
               "optimizer": 0.0}
        if not self.trained:
            return out
        opt = 12 if pb < 4 else 8
        trained = shard * self.adapters if self.adapters else shard
        out["gradients"] = 4 * trained
        if self.adapters:
            out["optimizer"] = opt * trained / self.d
            return out
        expert_shard = self.expert_params / (self.p * self.ep * (self.etp or self.t))
        expert_dp = max(1, self.t * self.d // (self.ep * (self.etp or self.t)))
        out["optimizer"] = opt * ((shard - expert_shard) / self.d + expert_shard / expert_dp)
        return out

    def away(self, phase: str) -> set[str]:
        """The states this role keeps off the GPU in `phase` (its own update: none)."""
        if phase == f"update:{self.role}":
            return set()
        gone = {name for name, on in (("gradients", self.offload_grads), ("optimizer", self.offload_optimizer)) if on}
        if phase == "generation" and self.offload_params:
            gone.add("weights")
        return gone


@dataclass(frozen=True)
class Generation:
    """How a role (the actor, a judge) generates on its pool."""
    role: str
    engine: str                     # vllm | native
    tp: int                         # generation TP t_g (p_g = 1)
    context: int                    # prompt + response tokens of one sequence
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None
    max_batch_size: int = 32        # native: sequences decoded together
    own_weights: bool = False       # vLLM loaded the weights itself (a LoRA actor's frozen base, a judge): no push


@dataclass
class Ledger:
    """Bytes per device of one pool: what each role keeps, and the peak of every phase."""
    capacity: float
    memory: float
    resident: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> state -> bytes (no offload)
    phases: dict[str, float] = field(default_factory=dict)
    generation: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> buffer, engine's bytes
    kv_sequences: dict[str, int] = field(default_factory=dict)  # role -> sequences its KV cache holds at once
    max_vllm_utilization: dict[str, float] = field(default_factory=dict)  # role -> largest share that fits

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity and all(n >= 1 for n in self.kv_sequences.values())

    def summary(self, pool: str, device: str) -> str:
        """One line per pool, as the GPU recipes' headers quote it (tests/test_gpu_ledger.py checks them)."""
        phase = max(self.phases, key=self.phases.get)
        text = (f"pool {pool} on {device}: peak {self.peak / GiB:.1f} GiB ({phase}) of {self.capacity / GiB:.0f} "
                f"usable")
        for role, gen in self.generation.items():
            if "vllm_kv_cache" in gen:
                text += (f"; {role}'s vLLM {gen['vllm_weights'] / GiB:.1f} GiB weights + {gen['vllm_kv_cache'] / GiB:.1f}"
                         f" GiB KV cache ({self.kv_sequences[role]} sequences)")
        return text + ("" if self.fits else "; DOES NOT FIT")

    def to_json(self) -> dict:
        gib = lambda b: round(b / GiB, 2)  # noqa: E731
        return {"capacity_gib": gib(self.capacity), "peak_gib": gib(self.peak), "fits": self.fits,
                "phases_gib": {k: gib(v) for k, v in self.phases.items()},
                "resident_gib": {r: {k: gib(v) for k, v in s.items()} for r, s in self.resident.items()},
                "generation_gib": {r: {k: gib(v) for k, v in g.items()} for r, g in self.generation.items()},
                "kv_sequences": self.kv_sequences, "max_vllm_utilization": self.max_vllm_utilization}


def _resident(loads: list[RoleLoad], phase: str) -> float:
    return sum(v for load in loads for k, v in load.states().items() if k not in load.away(phase))


def _activations(load: RoleLoad, acc: Accelerator, update: bool) -> float:
    if not load.tokens_per_micro_batch:
        return 0.0
    if update:
        return activation_bytes(load.model, load.lm_head, load.t, load.p, 1, load.tokens_per_micro_batch, load.p,
                                False, acc)
    return forward_bytes(load.model, load.lm_head, load.t, 1, load.tokens_per_micro_batch, acc)


def pool_ledger(loads: list[RoleLoad], acc: Accelerator, gens: list[Generation] = ()) -> Ledger:
    """The ledger of one pool holding `loads`; `gens`: the roles that generate on it (the actor, a judge)."""
    ledger = Ledger(capacity=acc.memory_bytes - acc.memory_reserve_bytes, memory=acc.memory_bytes,
                    resident={load.role: load.states() for load in loads})
    asleep = VLLM_ASLEEP_BYTES * sum(1 for g in gens if g.engine == "vllm")
    ledger.phases["experience"] = _resident(loads, "experience") + asleep + max(
        [_activations(load, acc, False) for load in loads] or [0.0])
    for load in loads:
        if load.trained:
            ledger.phases[f"update:{load.role}"] = _resident(loads, f"update:{load.role}") + asleep + \
                _activations(load, acc, True)
    for gen in gens:
        others = asleep - (VLLM_ASLEEP_BYTES if gen.engine == "vllm" else 0.0)
        _generation(ledger, loads, next(load for load in loads if load.role == gen.role), gen, acc, others)
    return ledger


def _generation(ledger: Ledger, loads: list[RoleLoad], role: RoleLoad, gen: Generation, acc: Accelerator,
                others: float) -> None:
    """The phase `generation:<role>` (and `push:<role>`): `others` are the other engines asleep here."""
    pb = role.dtype_bytes
    gen_shard = pb * role.shard(gen.tp, training=False)
    buffer = 0.0 if gen.own_weights else max(0.0, gen_shard - pb * role.shard())
    per_sequence = gen.context * role.model.kv_bytes_per_token(gen.tp, 1, pb)
    resident = _resident(loads, "generation") + others  # offload.params: the actor's weights are away (away())
    buffer_generating = 0.0 if role.offload_params else buffer  # and its generation shard with them
    name = f"generation:{gen.role}"
    if gen.engine != "vllm":  # as many rows as the room holds, up to max_batch_size (none: it does not fit)
        room = ledger.capacity - resident - buffer
        per_row = decode_row_bytes(per_sequence, role.model.vocab)
        rows = decode_rows(gen.max_batch_size, room, per_row) if room * KV_SHARE_OF_FREE >= per_row else 0
        kv, logits = max(rows, 1) * per_sequence, max(rows, 1) * (per_row - per_sequence)
        ledger.generation[gen.role] = {"hybrid_engine_buffer": buffer, "kv_cache": kv, "decode_logits": logits}
        ledger.phases[name] = resident + buffer + kv + logits
        ledger.kv_sequences[gen.role] = rows
        return
    runtime = VLLM_RUNTIME_BYTES
    if gen.kv_cache_memory_bytes is not None:
        share = gen_shard + runtime + gen.kv_cache_memory_bytes
    else:
        share = gen.gpu_memory_utilization * acc.memory_bytes
    kv = share - gen_shard - runtime
    ledger.generation[gen.role] = {"hybrid_engine_buffer": buffer_generating, "vllm_weights": gen_shard,
                                   "vllm_runtime": runtime, "vllm_kv_cache": kv}
    ledger.phases[name] = resident + buffer_generating + share
    if not gen.own_weights:  # the push: the trainer's generation shard and vLLM's copy both resident, no KV cache
        ledger.phases[f"push:{gen.role}"] = _resident(loads, "experience") + others + buffer + gen_shard
    ledger.kv_sequences[gen.role] = max(0, math.floor(kv / per_sequence))
    room = ledger.capacity - resident - buffer_generating
    ledger.max_vllm_utilization[gen.role] = math.floor(100 * room / acc.memory_bytes) / 100


def load_of(role: str, model: ModelStats, expert_params: int, *, trained: bool, lm_head: bool, t: int, p: int,
            d: int, ep: int = 1, etp: int | None = None, dtype_bytes: int = 2, adapters: float = 0.0,
            offload: object | None = None, tokens_per_micro_batch: int = 0, megatron: bool = True) -> RoleLoad:
    """A RoleLoad from a role's settings (`offload`: a config.OffloadConfig or None)."""
    return RoleLoad(role, model, expert_params, lm_head, trained, t, p, d, ep, etp, dtype_bytes, adapters,
                    bool(getattr(offload, "grads", False)), bool(getattr(offload, "optimizer", False)),
                    bool(getattr(offload, "params", False)), tokens_per_micro_batch, megatron)
