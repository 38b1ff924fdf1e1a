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

    @register(Dispatch.ONE_TO_ALL)
    def bridge_open(self, host: str, port: int, size: int, offset: int, timeout_s: float) -> None:
        from hybridrl.hybrid_engine.bridge import open_bridge

        self._bridge = open_bridge(host, port, offset + self.rank, size, timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def bridge_receive(self, plan: list, metas: dict, train_layout: Any) -> dict:
        """This rank's generation shard from the training ranks, copied into the model in place."""
        from hybridrl.hybrid_engine.megatron_adapter import load_generation_weights

        from hybridrl.hybrid_engine.bridge import receive_shards

        start = time.perf_counter()
        tensors, received = receive_shards(self._bridge, plan, self.rank, metas, train_layout, self.dtype)
        load_generation_weights(self.model, tensors)
        if self.spec.engine == "native":
            self.engine.load_weights(None)
        else:
            from hybridrl.models.checkpoint_hf import iter_full_hf_tensors

            self.engine.load_weights(iter_full_hf_tensors(self.model, self.hf_config))
        self.version += 1
        expected = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return {"received_bytes": received, "shard_bytes": expected, "seconds": time.perf_counter() - start,
                "version": self.version}

    @register(Dispatch.ONE_TO_ALL)
    def generate_sequences(self, prompts: Batch, sampling: dict) -> tuple[int, Batch] | None:
        """This replica's share of the prompts; (replica, Batch) on its TP rank 0, None elsewhere."""
        from hybridrl.rollout import SamplingParams

        coords = self.layout.coords(self.rank)
        share = prompts.chunk(self.layout.dp)[coords.dp]
        if not len(share):
            return None
        sampling = dict(sampling)
        stops = tuple(sampling.pop("stop_token_ids", ()) or ()) or self.spec.stop_token_ids
        seed = sampling.pop("seed", None)
        self.engine.wake()
        try:
            with torch.no_grad():
                out = self.engine.generate(share, SamplingParams(**sampling, stop_token_ids=stops,
                                                                 seed=None if seed is None else int(seed) + coords.dp))
        finally:
            self.engine.release()
        out.meta["policy_version"] = self.version
        return (coords.dp, out) if coords.tp == 0 else None
