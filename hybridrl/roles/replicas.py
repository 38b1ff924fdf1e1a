"""Generation replicas on a pool of their own (disaggregated), fed by the actor's training ranks shard to shard
(hybrid_engine/bridge.py; workers/rollout.py on every device of their pool)."""
from __future__ import annotations

import dataclasses
from typing import Any

from hybridrl.config import RolloutConfig
from hybridrl.controller import ResourcePool, WorkerError, wait_all
from hybridrl.hybrid_engine.bridge import bridge_plan
from hybridrl.protocol import Batch
from hybridrl.roles.actor import Actor
from hybridrl.roles.base import Role
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.prompts import left_pad
from hybridrl.rollout.types import Rollout, merge_replicas, rollouts_from_replicas
from hybridrl.workers.rollout import RolloutWorker


def check_rollout_pool(rollout: RolloutConfig) -> None:
    """What generation on a pool of its own cannot combine (ValueError naming the options): partial rollouts
    interrupt the native engine only; generation expert parallelism runs in the native engine without them."""
    if rollout.partial and rollout.engine != "native":
        raise ValueError(f"rollout.partial=true interrupts the native engine's decoding; rollout.engine resolved to "
                         f"{rollout.engine}: set rollout.engine=native or rollout.partial=false")
    if rollout.ep > 1 and rollout.partial:
        raise ValueError(f"rollout.ep={rollout.ep} with rollout.partial=true is not supported: the expert-parallel "
                         f"replicas decode in lockstep, partial rollouts resume row groups each replica forms alone; "
                         f"unset one")
    if rollout.ep > 1 and rollout.engine != "native":
        raise ValueError(f"rollout.ep={rollout.ep}: generation expert parallelism runs in the native engine "
                         f"(rollout.engine resolved to {rollout.engine}): set rollout.engine=native, or rollout.ep=1")


class RolloutReplicas(Role):
    """Generation replicas on a pool of their own, fed by `actor` shard to shard. The actor's rollout settings
    apply (override fields with `rollout=`): `tp` the generation TP (dividing the actor's; the pool's devices /
    tp replicas split the prompts), `ep` (mixture-of-experts actors) generation expert parallelism, each replica
    holding 1/ep of the experts and decoding in lockstep with its expert-parallel peers, `partial=True` a
    generation in progress takes each new sync at once (each token's policy version in "policy_versions"; else
    syncs wait for the generations queued before them). Call `sync()` after each actor update;
    `generate_sequences` like the actor's."""

    def __init__(self, actor: Actor, resource_pool: ResourcePool, rollout: dict | RolloutConfig | None = None,
                 seed: int = 1, call_timeout_s: float | None = 3600.0, bridge_timeout_s: float = 600.0) -> None:
        if isinstance(rollout, dict):
            rollout = dataclasses.replace(actor.rollout, **rollout)
        rollout = rollout or actor.rollout
        check_rollout_pool(rollout)
        self.actor, self.rollout = actor, rollout
        per_rank = actor.group.bridge_metas()
        self.metas = {rank: info["metas"] for rank, info in enumerate(per_rank)}
        lora = actor.settings.lora if actor.settings.lora.enabled else None
        # LoRA: the replicas keep the frozen base they load and receive the adapters only (lora_sync.py)
        self.adapter_spec = next(s for s in actor.group.bridge_adapter_spec() if s is not None) if lora else None
        super().__init__(RolloutWorker, "rollout", resource_pool, {"tp": rollout.tp, "ep": rollout.ep},
                         {"model_path": actor.model_path, "dtype": actor.settings.model.dtype, "rollout": rollout,
                          "tokens": actor.tokens, "padded_vocab_size": per_rank[0]["padded_vocab_size"],
                          "lora": lora}, seed, call_timeout_s)
        self.plan = bridge_plan(actor.layout, rollout.tp, self.layout.world_size, gen_ep=rollout.ep)
        train_ranks = actor.layout.world_size
        size = train_ranks + self.layout.world_size
        host, port = actor.group.rendezvous_address()
        wait_all([actor.group.bridge_open.remote(host, port, size, bridge_timeout_s),
                  self.group.bridge_open.remote(host, port, size, train_ranks, bridge_timeout_s, self.plan, self.metas,
                                                actor.layout, self.adapter_spec)])
        self._receivers = list(range(train_ranks, size))
        self.version = 0  # syncs sent; the replicas start from the model folder's weights (= the actor's)
        self._receiving: list = []  # bridge_receive calls queued on the replicas

    def sync(self, in_flight: int = 1) -> dict[str, float]:
        """Send the actor's current weights to every replica. The training ranks pack copies and return (training
        may go on at once; `in_flight` syncs may be on their way before the oldest is waited for); the replicas
        take the new weights before their next generation, after any generation already queued (with `partial`:
        at once, in the middle of a generation). Returns the bytes sent and the version the replicas will hold."""
        while self._receiving and self._receiving[0].done():
            self._receiving.pop(0).result()  # earlier syncs' receives were posted (their errors surface here)
        try:
            sent = self.actor.group.bridge_send_adapters(self._receivers, in_flight) if self.adapter_spec else \
                self.actor.group.bridge_send(self.plan, in_flight)
        except WorkerError:  # the bridge broke: when the replicas are gone that is the cause, say so
            self.group.alive()
            raise
        self.version += 1
        self._receiving.append(self.group.bridge_receive.remote(self.version))
        return {"sent_bytes": float(sum(sent)), "version": float(self.version)}

    def sync_stats(self) -> dict:
        """Per rank, the last sync applied: received_bytes, shard_bytes (its generation shard), seconds, version."""
        return {k: [r[k] for r in self.group.bridge_stats()] for k in ("received_bytes", "shard_bytes", "seconds",
                                                                       "version")}

    def submit(self, prompts: Any, settings: list[dict]) -> "PendingRollouts":
        """Start generating (one Rollout per sampling setting, like Actor.generate_many) without waiting: the
        replicas work while the driver trains; `.result()` collects. Calls run in submission order."""
        actor = self.actor
        batch, texts, metadata = actor.encode_prompts(prompts)
        params = [actor.sampling_params(setting) for setting in settings]
        future = self.group.generate_sequences.remote(batch, params)
        return PendingRollouts(future, params, texts, metadata, actor.tokenizer, self.version)

    def generate_turn(self, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[Batch, int]:
        """One generate call on token-id prompts with full sampling params (the agent endpoint's calls): the Batch
        of rollout/base.py in prompt order, and the policy version the replicas generated it with (per token in
        "policy_versions" when partial rollouts switched weights half-way)."""
        pad = self.actor.tokens.pad
        batch = Batch(dict(zip(("input_ids", "attention_mask"), left_pad(prompt_ids, pad))))
        results = self.group.generate_sequences(batch, [params])
        out = merge_replicas([None if r is None else (r[0], r[1][0]) for r in results], pad)
        return out, int(out.meta.get("policy_version", self.version))

    def generate_many(self, prompts: Any, settings: list[dict]) -> list[Rollout]:
        return self.submit(prompts, settings).result()

    def generate_sequences(self, prompts: Any, greedy: bool = False, seed: int | None = None,
                           **sampling: Any) -> Rollout:
        return self.generate_many(prompts, [{"greedy": greedy, "seed": seed, **sampling}])[0]


class PendingRollouts:
    """Generation in flight on RolloutReplicas; `version`: the policy version it generates with."""

    def __init__(self, future: Any, params: list, texts: list[str], metadata: list[dict], tokenizer: Any,
                 version: int) -> None:
        self.future, self.params, self.texts, self.metadata = future, params, texts, metadata
        self.tokenizer, self.version = tokenizer, version

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> list[Rollout]:
        results = self.future.result()
        rollouts = rollouts_from_replicas(results, self.params, self.texts, self.metadata, self.tokenizer)
        for i, rollout in enumerate(rollouts):
            idle = max(r[1][i].meta["idle_s"] for r in results if r is not None)
            rollout.sequences.meta.update(policy_version=self.version, generation_idle_s=idle)
        return rollouts
