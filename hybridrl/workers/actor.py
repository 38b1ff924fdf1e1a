"""The actor (policy + rollout through the 3D-HybridEngine) and the reference policy, as Ray-side workers.

ActorWorker holds, on every rank of its pool:
- the policy as a trainable MegatronModel in the training layout (tp, pp, dp);
- a HybridEngine that turns it into this rank's generation-layout model (t_g, p_g = 1) on demand;
- a rollout engine (native Megatron or vLLM) that generates with that model.

`generate_sequences` runs the transition, splits the prompts over the generation replicas, generates, and
switches back; `compute_log_probs` and `update` run in the training layout over DP shards.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from hybridrl.algorithms import loss_agg
from hybridrl.config import RoleConfig, RolloutConfig
from hybridrl.controller import Dispatch, Worker, register
from hybridrl.hybrid_engine.bridge import PendingSends, open_bridge, send_shards
from hybridrl.hybrid_engine.engine import HybridEngine
from hybridrl.hybrid_engine.lora_sync import AdapterSpec, pack, send_adapters
from hybridrl.hybrid_engine.megatron_adapter import training_params
from hybridrl.hybrid_engine.reshard import ShardMeta
from hybridrl.models.checkpoint_hf import export_hf_checkpoint, iter_full_hf_tensors
from hybridrl.models.lora import MergedWeights, adapters_disabled, merged_adapters
from hybridrl.models.lora_io import adapter_factors_everywhere, gather_adapter_factors
from hybridrl.models.peft import model_config, model_files
from hybridrl.parallel.distributed import release_cached_memory
from hybridrl.parallel.generation import GenerationGroups, GenerationLayout
from hybridrl.protocol import Batch
from hybridrl.rollout import SamplingParams, TokenIds, build_rollout_engine
from hybridrl.rollout.vllm_lora import VllmAdapters, vllm_adapter_support, vllm_lora_rank
from hybridrl.workers.megatron_model import CheckpointedRole, MegatronModel
from hybridrl.workers.offload import HostCopy
from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms, response_log_probs, response_mask
from hybridrl.workers.sharding import gathered_parameters

logger = logging.getLogger(__name__)


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

    def __init__(self, role: RoleConfig, rollout: RolloutConfig, tokens: TokenIds, seed: int = 1) -> None:
        """role: the actor's settings (model.path a local folder); rollout: how it generates, with the engine and
        max_model_len resolved by the driver; tokens: the tokenizer's pad id."""
        self.rollout = rollout
        gen_layout = GenerationLayout(tp=rollout.tp, ep=rollout.ep)
        # LoRA on vLLM: the engine keeps the frozen base and serves the adapters as its LoRA adapter where it can
        lora = role.lora if role.lora is not None and role.lora.enabled else None
        adapters_in_vllm = rollout.engine == "vllm" and lora is not None and \
            vllm_adapter_support(lora, role.model.path, model_config(role.model.path)) is None
        if rollout.engine == "vllm":
            # vLLM starts first: at start it checks that its memory share (rollout.vllm) is free on the device,
            # which the training state would not leave; then it sleeps (weights and KV cache given back) until
            # the first generation pushes the actor's weights (it loads none itself: load_format dummy; serving
            # LoRA adapters it loads the frozen base once). Its TP groups are the hybrid engine's strided
            # generation TP groups.
            self.engine = build_rollout_engine(rollout, model_path=model_files(role.model.path), tokens=tokens,
                                               dtype=role.model.dtype, weights_pushed=not adapters_in_vllm,
                                               tp_groups=GenerationGroups(self.layout, gen_layout).gen_tp_groups(),
                                               lora_rank=vllm_lora_rank(lora.rank) if adapters_in_vllm else None)
            self.engine.release()
        self.model = MegatronModel.for_role(role, self.layout, seed=seed)
        self.model.routing_mode = None if rollout.routing_mode == "off" else rollout.routing_mode
        self.hybrid = HybridEngine(self.model.model, self.model.hf_config, self.layout, gen_layout,
                                   strategy=rollout.reshard, bucket_mb=rollout.bucket_mb)
        if rollout.engine != "vllm":  # the native engine generates with the hybrid engine's generation model
            self.engine = build_rollout_engine(rollout, model=self.hybrid.gen_model, vocab_size=self.model.vocab_size,
                                               tokens=tokens)
            self.engine.release()  # KV cache only while generating
        self._vllm_adapters = VllmAdapters(self.engine, lora) if adapters_in_vllm else None
        self._generating = False  # between begin_generation and end_generation
        self._merged = None  # LoRA: the merged weights while generating (their base kept aside)
        # actor.offload.params (vLLM): the actor's weights in host memory from the push to the end of generation
        self._weights_offload = HostCopy() if role.offload.params else None

    # ---- generation ------------------------------------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def generate_sequences(self, prompts: Batch, sampling: SamplingParams | list[SamplingParams]
                           ) -> tuple[int, Any] | None:
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
        """Training -> generation layout, then the engine's state machine in order (rollout/base.py): its
        weights' memory back, the new weights pushed, then its KV cache back; returns its seconds."""
        if self._generating:
            return 0.0
        start = time.perf_counter()
        if self._vllm_adapters is not None:  # the engine holds the frozen base: only the adapters go to it
            self.engine.wake_weights()
            self._vllm_adapters.load(adapter_factors_everywhere(self.model.model))
            self._generating = True
            self.engine.wake()
            return time.perf_counter() - start
        # LoRA: the generation weights are W + BA, merged here in the training layout and resharded as any weight
        # (lora.generation=forward: the training model generates with its adapters in the decode forward)
        lora = self.model.lora
        self._merged = MergedWeights(self.model.inner) if lora is not None and lora.generation == "merge" else None
        gen_model = self.hybrid.to_generation()
        if self._merged is not None:
            self.hybrid.last_stats.extra["lora_kept_bytes"] = self._merged.kept_bytes
        self._generating = True
        release_cached_memory()  # what torch's allocator holds free goes back: vLLM's own allocator wakes into it
        self.engine.wake_weights()
        self._push_weights(gen_model)
        if self._weights_offload is not None:  # vLLM holds its own copy now: ours waits in host memory
            self._weights_offload.offload(gen_model.parameters())
            release_cached_memory()
        self.engine.wake()
        return time.perf_counter() - start

    @register(Dispatch.ONE_TO_ALL)
    def generate_turn(self, prompts: Batch, sampling: SamplingParams | list[SamplingParams]
                      ) -> tuple[int, Any] | None:
        """Generate (in the generation layout, see begin_generation) for this replica's share of `prompts`;
        (replica index, Batch or [Batch per setting]) on generation TP rank 0, None elsewhere."""
        if not self._generating:
            raise RuntimeError("generate_turn() outside begin_generation() / end_generation()")
        settings = sampling if isinstance(sampling, list) else [sampling]
        replica, replicas = self.hybrid.gen_dp_rank, self.hybrid.gen_dp_size
        share = prompts.chunk(replicas)[replica]
        if not len(share):
            if self.rollout.ep > 1:  # the expert-parallel peers decode in lockstep: keep their pace
                for params in settings:
                    self.engine.generate_rows([], replica_params(params, replica))
            return None
        outs = [self.engine.generate(share, replica_params(params, replica)) for params in settings]
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
        if self._weights_offload is not None:
            self._weights_offload.restore()  # back before the switch: it reads the generation buffer
        self.hybrid.to_training()
        if self._merged is not None:  # the frozen base back, bit for bit
            self._merged.restore()
            self._merged = None
        self._generating = False
        return time.perf_counter() - start

    @register(Dispatch.ONE_TO_ALL)
    def engine_state(self) -> dict:
        """Where this rank's generation stands: the rollout engine's state (rollout/base.py) and whether the hybrid
        engine holds the generation layout (between steps: asleep, False)."""
        return {"engine": self.engine.state.value, "in_generation": self.hybrid.in_generation}

    def _push_weights(self, gen_model) -> None:
        if self.rollout.engine == "native":
            self.engine.load_weights(None)  # the generation model already holds the new weights
            return

        self.engine.load_weights(iter_full_hf_tensors(gen_model, self.model.hf_config))

    # ---- weights to a rollout pool of its own (hybrid_engine/bridge.py) -----------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def bridge_metas(self) -> dict:
        """What this rank's training shards look like (the receivers size their buffers from it)."""
        params = training_params(self.model.model, self.layout.coords(self.rank).pp)
        return {"metas": [ShardMeta.of(p) for p in params],
                "padded_vocab_size": self.model.inner.hybridrl_args.padded_vocab_size}

    @register(Dispatch.ONE_TO_ALL)
    def bridge_open(self, host: str, port: int, size: int, timeout_s: float) -> None:
        self._sends = []  # messages to a previous rollout pool (dead, when it is replaced) are abandoned
        self._bridge = open_bridge(host, port, self.rank, size, timeout_s, next(self.model.model.parameters()).device)

    @register(Dispatch.ONE_TO_ALL)
    def bridge_send(self, plan: list, in_flight: int = 1) -> int:
        """Start sending this rank's shards to the rollout ranks that need them (packed copies: training goes on
        at once); at most `in_flight` syncs' copies are held, the oldest waited for beyond that (the replicas take
        a sync only after the generations queued before it). Returns the payload bytes."""
        while len(self._sends) >= max(1, in_flight):
            self._sends.pop(0).wait()
        params = training_params(self.model.model, self.layout.coords(self.rank).pp)
        metas = [ShardMeta.of(p) for p in params]
        with merged_adapters(self.model.inner):  # LoRA: W + BA go (send_shards packs copies before returning)
            sends, sent = send_shards(self._bridge, plan, self.rank, {p.name: p.tensor for p in params}, metas,
                                      self.world_size)
        self._sends.append(sends)
        if self.rank == 0:  # the replicas of a partial rollout take the new weights at once
            self._bridge.announce()
        return sent

    # LoRA: the base is frozen, so a rollout pool keeps its own and receives the adapters only (lora_sync.py)
    @register(Dispatch.ONE_TO_ALL)
    def bridge_adapter_spec(self) -> AdapterSpec | None:
        """The adapter message's layout (collective; on training rank 0, None elsewhere)."""
        gathered = gather_adapter_factors(self.model.model)
        self._adapter_spec = None if gathered is None else AdapterSpec.of(gathered[0])
        return self._adapter_spec

    @register(Dispatch.ONE_TO_ALL)
    def bridge_send_adapters(self, receivers: list[int], in_flight: int = 1) -> int:
        """Gather the adapters whole (collective) and send them from training rank 0 to every rollout rank
        (bridge ranks `receivers`); returns the payload bytes sent (0 on the other ranks)."""
        while len(self._sends) >= max(1, in_flight):
            self._sends.pop(0).wait()
        gathered = gather_adapter_factors(self.model.model)
        if gathered is None:
            return 0
        flat = pack(gathered[0], self._adapter_spec, self._bridge.device)
        self._sends.append(PendingSends(send_adapters(self._bridge, flat, receivers), [flat]))
        self._bridge.announce()
        return flat.numel() * flat.element_size() * len(receivers)

    # ---- training layout ---------------------------------------------------------------------------------
    @register(Dispatch.DP_COMPUTE)
    def compute_log_probs(self, data: Batch) -> Batch:
        """"old_log_probs" [B, R] of the responses under the current policy (training layout)."""
        return self._log_probs(data, "old_log_probs")

    @register(Dispatch.DP_COMPUTE, pad=False)
    def update(self, data: Batch, loss: PolicyLossConfig, mini_batches: int = 1, epochs: int = 1) -> dict[str, float]:
        """PPO-style policy update: `epochs` passes, each cut into `mini_batches` optimizer steps.

        data: rollouts with "advantages" ([B, R]), "old_log_probs" (absent: on-policy), "ref_log_probs"
        when the loss has a KL term, and "rollout_log_probs" (the engine's) to measure / correct the mismatch.
        """
        cfg = loss
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
        """Write the current policy as a Hugging Face folder (collective; rank 0 writes); LoRA: merged."""
        with gathered_parameters(self.model.model), merged_adapters(self.model.inner):  # fsdp: whole TP shards
            export_hf_checkpoint(self.model.model, self.model.hf_config, out_dir)

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_probs(self, data: Batch) -> Batch:
        """"ref_log_probs" of a LoRA actor's base model (its adapters off): the reference policy, no second copy."""
        if self.model.lora is None:
            raise RuntimeError("the actor is its own reference only with LoRA adapters (actor.lora)")
        with adapters_disabled(self.model.inner):
            return self._log_probs(data, "ref_log_probs")


class ReferenceWorker(_LogProbMixin, Worker):
    """The frozen reference policy: log-probs of the responses under the initial weights."""

    def __init__(self, role: RoleConfig, seed: int = 1) -> None:
        self.model = MegatronModel.for_role(role, self.layout, trainable=False, seed=seed)

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_probs(self, data: Batch) -> Batch:
        return self._log_probs(data, "ref_log_probs")



def replica_params(params: SamplingParams, replica: int) -> SamplingParams:
    """A generation replica's sampling: its own random stream (the seed offset by the replica index)."""
    return params if params.seed is None else dataclasses.replace(params, seed=int(params.seed) + replica)
