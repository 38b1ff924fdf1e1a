"""A rollout pool of its own (disaggregated generation): generation replicas apart from the actor's training ranks.

Every rank of the pool holds a generation-layout Megatron model (t_g = the pool layout's tp, p_g = 1) and a
rollout engine on it; the pool's dp replicas split the prompts. New weights come shard to shard from the actor's
training ranks over the bridge (hybrid_engine/bridge.py); until the first sync the model holds the HF folder's.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from hybridrl.controller import Dispatch, Worker, register
from hybridrl.protocol import Batch
from hybridrl.workers.actor import RolloutSpec


class RolloutWorker(Worker):
    def __init__(self, model: dict, rollout: dict, padded_vocab_size: int | None = None) -> None:
        from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
        from hybridrl.rollout import build_rollout_engine
        from hybridrl.workers.megatron_model import DTYPES

        self.path = model["path"]
        self.hf_config = load_hf_config(self.path)
        self.dtype = DTYPES[model.get("dtype", "float32")]
        # the actor's padded vocabulary (it depends on the training TP), so its shards fit this model
        self.model = build_gpt_model(self.hf_config, dtype=self.dtype, padded_vocab_size=padded_vocab_size).eval()
        load_hf_weights(self.model, self.path, self.hf_config)
        self.spec = RolloutSpec(**{**rollout, "stop_token_ids": tuple(rollout.get("stop_token_ids", ()))})
        options = dict(self.spec.options)
        if self.spec.engine == "native":
            options.setdefault("max_batch_size", self.spec.max_batch_size)
        self.engine = build_rollout_engine({"engine": self.spec.engine, "tp": self.layout.tp}, model=self.model,
                                           model_path=self.path, vocab_size=int(self.hf_config.vocab_size),
                                           max_model_len=self.spec.max_model_len, pad_token_id=self.spec.pad_token_id,
                                           **options)
        self.version = 0  # policy versions received
        self._incoming = None  # posted receives of the next version
        self.last_sync: dict = {}
        self._idle_since = time.perf_counter()  # generation idle: between the end of a call and the next

    @register(Dispatch.ONE_TO_ALL)
    def bridge_open(self, host: str, port: int, size: int, offset: int, timeout_s: float) -> None:
        from hybridrl.hybrid_engine.bridge import open_bridge

        self._bridge = open_bridge(host, port, offset + self.rank, size, timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def bridge_receive(self, plan: list, metas: dict, train_layout: Any) -> None:
        """Post the receives of the next weights; they are applied before the next generation (a generation
        in progress is never switched to new weights half-way)."""
        from hybridrl.hybrid_engine.bridge import PendingReceive

        if self._incoming is not None:
            self._apply()
        self._incoming = PendingReceive(plan, self.rank, metas, train_layout, self._bridge, self.dtype)

    @register(Dispatch.ONE_TO_ALL)
    def alive(self) -> bool:
        return True

    @register(Dispatch.ONE_TO_ALL)
    def bridge_stats(self) -> dict:
        """The last applied sync: bytes received and this rank's generation shard bytes, seconds, version."""
        if self._incoming is not None:
            self._apply()
        return dict(self.last_sync)

    def _apply(self) -> None:
        from hybridrl.hybrid_engine.megatron_adapter import load_generation_weights

        start = time.perf_counter()
        tensors, received = self._incoming.assemble()
        self._incoming = None
        load_generation_weights(self.model, tensors)
        self.engine.load_weights(None)  # the native engine reads the model's parameters: drop the KV cache
        self.version += 1
        self.last_sync = {"received_bytes": received, "seconds": time.perf_counter() - start, "version": self.version,
                          "shard_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters())}

    @register(Dispatch.ONE_TO_ALL)
    def generate_sequences(self, prompts: Batch, sampling: list[dict]) -> tuple[int, list[Batch]] | None:
        """This replica's share of the prompts for each sampling setting, with the newest weights received;
        (replica, [Batch per setting]) on its TP rank 0, None elsewhere. Each Batch's meta: the policy version
        it was generated with and the seconds this rank sat idle before the call."""
        from hybridrl.rollout import SamplingParams

        idle_s = time.perf_counter() - self._idle_since
        if self._incoming is not None:
            self._apply()
        coords = self.layout.coords(self.rank)
        share = prompts.chunk(self.layout.dp)[coords.dp]
        outs = []
        self.engine.wake()
        try:
            for setting in sampling if len(share) else []:
                setting = dict(setting)
                stops = tuple(setting.pop("stop_token_ids", ()) or ()) or self.spec.stop_token_ids
                seed = setting.pop("seed", None)
                params = SamplingParams(**setting, stop_token_ids=stops,
                                        seed=None if seed is None else int(seed) + coords.dp)
                with torch.no_grad():
                    outs.append(self.engine.generate(share, params))
        finally:
            self.engine.release()
            self._idle_since = time.perf_counter()
        if not outs or coords.tp != 0:
            return None
        for out in outs:
            out.meta.update(policy_version=self.version, idle_s=idle_s)
        return coords.dp, outs
