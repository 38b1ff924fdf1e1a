"""The actor (policy + rollout through the 3D-HybridEngine) and the reference policy, as Ray-side workers.

ActorWorker holds, on every rank of its pool:
- the policy as a trainable MegatronModel in the training layout (tp, pp, dp);
- a HybridEngine that turns it into this rank's generation-layout model (t_g, p_g = 1) on demand;
- a rollout engine (native Megatron or vLLM) that generates with that model.

`generate_sequences` runs the transition, splits the prompts over the generation replicas, generates, and
switches back; `compute_log_probs` and `update` run in the training layout over DP shards.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from hybridrl.algorithms import loss_agg
from hybridrl.controller import Dispatch, Worker, register
from hybridrl.protocol import Batch
from hybridrl.workers.megatron_model import CheckpointedRole, MegatronModel, model_spec
from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms, response_log_probs, response_mask

logger = logging.getLogger(__name__)


@dataclass
class RolloutSpec:
    """How the actor generates (the rollout part of the config, plus what the tokenizer decides)."""

    engine: str = "native"
    tp: int = 1
    ep: int = 1  # generation expert parallelism (e_g)
    reshard: str = "hybrid"
    bucket_mb: float = 32.0  # most MiB one reshard collective outputs
    max_model_len: int = 512
    max_batch_size: int = 64
    pad_token_id: int = 0
    stop_token_ids: tuple[int, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)  # engine options (e.g. vLLM's)
    # mixture-of-experts: off, or the rollout records each token's experts and the actor's forwards "measure"
    # how many they route otherwise (moe/routing_mismatch) or "replay" them (models/routing_replay.py)
    routing: str = "off"

    def __post_init__(self) -> None:
        if self.routing not in ("off", "measure", "replay"):
            raise ValueError(f"rollout routing={self.routing!r}; choose off, measure or replay")


class _LogProbMixin:
    model: MegatronModel

    def _log_probs(self, data: Batch, key: str) -> Batch | None:
        model = self.model

        def per_micro_batch(mb, logits):
            return response_log_probs(mb, logits, model.vocab_size, model.tp_group if model.tp > 1 else None)[0]

        values = model.forward(data, per_micro_batch, {"response_mask": data["response_mask"]})
        if values is None:  # not the last pipeline stage: the driver collects from the last one
            return None
        return Batch({key: values * data["response_mask"]})


class ActorWorker(_LogProbMixin, CheckpointedRole, Worker):
    """Policy training (Megatron DDP + optimizer) and generation (HybridEngine + rollout engine)."""

    def __init__(self, model: dict, rollout: dict, seed: int = 1) -> None:
        from hybridrl.hybrid_engine.engine import HybridEngine
        from hybridrl.parallel.generation import GenerationLayout

        self.model = MegatronModel(model_spec(model, self.layout), seed=seed)
        self.rollout_spec = RolloutSpec(**{**rollout, "stop_token_ids": tuple(rollout.get("stop_token_ids", ()))})
        self.model.routing_mode = None if self.rollout_spec.routing == "off" else self.rollout_spec.routing
        self.hybrid = HybridEngine(self.model.model, self.model.hf_config, self.layout,
                                   GenerationLayout(tp=self.rollout_spec.tp, ep=self.rollout_spec.ep),
                                   strategy=self.rollout_spec.reshard,
                                   bucket_mb=self.rollout_spec.bucket_mb)
        self.engine = self._build_engine()
        self.engine.release()  # KV cache only while generating
        self._generating = False  # between begin_generation and end_generation

    def _build_engine(self):
        from hybridrl.rollout import build_rollout_engine

        spec = self.rollout_spec
        options = dict(spec.options)
        if spec.engine == "native":
            options.setdefault("max_batch_size", spec.max_batch_size)
            options.setdefault("record_routing", spec.routing != "off")
        else:  # vLLM's TP group must be the hybrid engine's strided generation TP group
            options.setdefault("tp_groups", self.hybrid.groups.gen_tp_groups())
        return build_rollout_engine({"engine": spec.engine, "tp": spec.tp}, model=self.hybrid.gen_model,
                                    model_path=self.model.spec.path, vocab_size=self.model.vocab_size,
                                    max_model_len=spec.max_model_len, pad_token_id=spec.pad_token_id, **options)

    # ---- generation ------------------------------------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def generate_sequences(self, prompts: Batch, sampling: dict | list[dict]) -> tuple[int, Any] | None:
        """Generate for this rank's generation replica's share of `prompts` (left-padded "input_ids" +
        "attention_mask"); returns (replica index, Batch) on generation TP rank 0, None elsewhere. The
        Batch's meta carries the transition and generation seconds.

        `sampling` may be a list of settings (e.g. sampled + greedy for ReMax): all are generated inside one
        transition, and the result is (replica index, [Batch per setting])."""
        transition_s = self.begin_generation()
        start = time.perf_counter()
        try:
            result = self.generate_turn(prompts, sampling)
        finally:
            generation_s = time.perf_counter() - start
            transition_s += self.end_generation()
        if result is None:
            return None
        for out in (result[1] if isinstance(sampling, list) else [result[1]]):
            # the transition is shared: each result reports it (the driver takes the max)
            out.meta["timing"] = {"transition": transition_s, "generation": generation_s}
        return result

    # A multi-turn rollout holds the generation layout over several calls: begin, one generate_turn per
    # turn of the episodes, end (the driver always ends, also after a failed turn).
    @register(Dispatch.ONE_TO_ALL)
    def begin_generation(self) -> float:
        """Training -> generation layout, new weights into the engine, KV cache back; returns its seconds."""
        if self._generating:
            return 0.0
        start = time.perf_counter()
        gen_model = self.hybrid.to_generation()
        self._generating = True
        self._push_weights(gen_model)
        self.engine.wake()
        return time.perf_counter() - start

    @register(Dispatch.ONE_TO_ALL)
    def generate_turn(self, prompts: Batch, sampling: dict | list[dict]) -> tuple[int, Any] | None:
        """Generate (in the generation layout, see begin_generation) for this replica's share of `prompts`;
        (replica index, Batch or [Batch per setting]) on generation TP rank 0, None elsewhere."""
        if not self._generating:
            raise RuntimeError("generate_turn() outside begin_generation() / end_generation()")
        settings = sampling if isinstance(sampling, list) else [sampling]
        replica, replicas = self.hybrid.gen_dp_rank, self.hybrid.gen_dp_size
        share = prompts.chunk(replicas)[replica]
        if not len(share):
            if self.rollout_spec.ep > 1:  # the expert-parallel peers decode in lockstep: keep their pace
                for setting in settings:
                    self.engine.generate_rows([], self._sampling_params(dict(setting), replica))
            return None
        outs = [self._generate(share, dict(setting), replica) for setting in settings]
        if not self.hybrid.is_gen_collect_rank:
            return None
        for out in outs:
            out.meta["reshard_recv_bytes"] = self.hybrid.last_stats.recv_payload_bytes
        return replica, (outs if isinstance(sampling, list) else outs[0])

    @register(Dispatch.ONE_TO_ALL)
    def end_generation(self) -> float:
        """KV cache released, generation -> training layout; returns its seconds."""
        if not self._generating:
            return 0.0
        start = time.perf_counter()
        self.engine.release()
        self.hybrid.to_training()
        self._generating = False
        return time.perf_counter() - start

    def _sampling_params(self, sampling: dict, replica: int):
        from hybridrl.rollout import SamplingParams

        stops = tuple(sampling.pop("stop_token_ids", ()) or ()) or self.rollout_spec.stop_token_ids
        seed = sampling.pop("seed", None)
        return SamplingParams(**sampling, stop_token_ids=stops, seed=None if seed is None else int(seed) + replica)

    def _generate(self, share: Batch, sampling: dict, replica: int) -> Batch:
        return self.engine.generate(share, self._sampling_params(sampling, replica))

    def _push_weights(self, gen_model) -> None:
        if self.rollout_spec.engine == "native":
            self.engine.load_weights(None)  # the generation model already holds the new weights
            return
        from hybridrl.models.checkpoint_hf import iter_full_hf_tensors

        self.engine.load_weights(iter_full_hf_tensors(gen_model, self.model.hf_config))

    # ---- weights to a rollout pool of its own (hybrid_engine/bridge.py) -----------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def bridge_metas(self) -> dict:
        """What this rank's training shards look like (the receivers size their buffers from it)."""
        from hybridrl.hybrid_engine.reshard import ShardMeta
        from hybridrl.hybrid_engine.megatron_adapter import training_params

        params = training_params(self.model.model, self.layout.coords(self.rank).pp)
        return {"metas": [ShardMeta.of(p) for p in params],
                "padded_vocab_size": self.model.inner.hybridrl_args.padded_vocab_size}

    @register(Dispatch.ONE_TO_ALL)
    def bridge_open(self, host: str, port: int, size: int, timeout_s: float) -> None:
        from hybridrl.hybrid_engine.bridge import open_bridge

        self._sends = []  # messages to a previous rollout pool (dead, when it is replaced) are abandoned
        self._bridge = open_bridge(host, port, self.rank, size, timeout_s, next(self.model.model.parameters()).device)

    @register(Dispatch.ONE_TO_ALL)
    def bridge_send(self, plan: list, in_flight: int = 1) -> int:
        """Start sending this rank's shards to the rollout ranks that need them (packed copies: training goes on
        at once); at most `in_flight` syncs' copies are held, the oldest waited for beyond that (the replicas take
        a sync only after the generations queued before it). Returns the payload bytes."""
        from hybridrl.hybrid_engine.bridge import send_shards
        from hybridrl.hybrid_engine.reshard import ShardMeta
        from hybridrl.hybrid_engine.megatron_adapter import training_params

        while len(self._sends) >= max(1, in_flight):
            self._sends.pop(0).wait()
        params = training_params(self.model.model, self.layout.coords(self.rank).pp)
        metas = [ShardMeta.of(p) for p in params]
        sends, sent = send_shards(self._bridge, plan, self.rank, {p.name: p.tensor for p in params}, metas,
                                  self.world_size)
        self._sends.append(sends)
        if self.rank == 0:  # the replicas of a partial rollout take the new weights at once
            self._bridge.announce()
        return sent

    # ---- training layout ---------------------------------------------------------------------------------
    @register(Dispatch.DP_COMPUTE)
    def compute_log_probs(self, data: Batch) -> Batch:
        """"old_log_probs" [B, R] of the responses under the current policy (training layout)."""
        return self._log_probs(data, "old_log_probs")

    @register(Dispatch.DP_COMPUTE, pad=False)
    def update(self, data: Batch, loss: dict, mini_batches: int = 1, epochs: int = 1) -> dict[str, float]:
        """PPO-style policy update: `epochs` passes, each cut into `mini_batches` optimizer steps.

        data: rollouts with "advantages" ([B, R]), "old_log_probs" (absent: on-policy), "ref_log_probs"
        when the loss has a KL term, and "rollout_log_probs" (the engine's) to measure / correct the mismatch.
        """
        cfg = PolicyLossConfig(**loss)
        model = self.model
        tp_group = model.tp_group if model.tp > 1 else None
        keys = ["response_mask", "advantages"] + (["ref_log_probs"] if cfg.kl_loss_coef else [])
        missing = [k for k in keys if k not in data]
        keys += [k for k in ("old_log_probs", "rollout_log_probs") if k in data]
        if missing:
            raise KeyError(f"actor.update needs {missing} in the batch")

        def loss_terms(mb, logits):
            return actor_loss_terms(mb, logits, model.vocab_size, tp_group, cfg)

        def units(mb):  # algorithm.loss_agg's denominator share of a micro-batch
            return loss_agg.units(response_mask(mb), cfg.loss_agg, cfg.loss_agg_length, rows=mb["row_valid"])

        return model.train_epochs(data, loss_terms, keys, mini_batches, epochs, role="actor.update", units=units)

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> None:
        """Write the current policy as a Hugging Face folder (collective; rank 0 writes)."""
        from hybridrl.models.checkpoint_hf import export_hf_checkpoint

        export_hf_checkpoint(self.model.model, self.model.hf_config, out_dir)


class ReferenceWorker(_LogProbMixin, Worker):
    """The frozen reference policy: log-probs of the responses under the initial weights."""

    def __init__(self, model: dict, seed: int = 1) -> None:
        self.model = MegatronModel(model_spec(model, self.layout, optim=None), seed=seed)

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_probs(self, data: Batch) -> Batch:
        return self._log_probs(data, "ref_log_probs")

