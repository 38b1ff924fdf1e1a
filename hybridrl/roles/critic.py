"""The critic role: a value model with a scalar head, trained on returns (workers/value.py CriticWorker)."""
from __future__ import annotations

from typing import Any

import torch

from hybridrl.config import LoraConfig, ModelConfig, OffloadConfig, OptimConfig, ParallelConfig, RoleConfig, as_section
from hybridrl.controller import ResourcePool
from hybridrl.models.hub import resolve_model
from hybridrl.models.precision import model_dtype
from hybridrl.parallel.layout import ParallelLayout
from hybridrl.roles.base import (DEFAULT_MAX_TOKENS_PER_MICRO_BATCH, Role, average_metrics, checked_lora,
                                 parallel_argument)
from hybridrl.rollout.types import SEQUENCE_KEYS, as_sequences
from hybridrl.workers.offload import check_offload
from hybridrl.workers.sharding import check_sharding
from hybridrl.workers.value import CriticWorker


class Critic(Role):
    """A value model (scalar head) trained on returns; starts from a causal-LM or a scalar-head checkpoint.
    optim: config.OptimConfig; lora: config.LoraConfig (adapters + the value head trained, the rest frozen); each
    may be a dict (checked and converted)."""

    def __init__(self, model: str | None = None, resource_pool: ResourcePool | None = None,
                 parallel: dict | ParallelConfig | ParallelLayout | None = None,
                 optim: dict | OptimConfig | None = None, micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
                 dtype: str = "auto", seed: int = 1, role: str = "critic",
                 call_timeout_s: float | None = 3600.0,
                 parallel_config: dict | ParallelConfig | ParallelLayout | None = None,
                 lora: dict | LoraConfig | None = None, offload: dict | OffloadConfig | None = None) -> None:
        parallel = parallel_argument(parallel, parallel_config, "Critic")
        path = resolve_model(model, "Critic(model=...)")
        settings = RoleConfig(model=ModelConfig(path, model_dtype(dtype, path)),
                              optim=as_section(OptimConfig, optim, "Critic(optim=...)"),
                              lora=checked_lora(lora, "Critic(lora=...)"),
                              micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                              offload=as_section(OffloadConfig, offload, "Critic(offload=...)"))
        check_offload(settings.offload, "critic")
        check_sharding(role, getattr(parallel, "fsdp", "no_shard"), settings.lora, settings.offload)  # before Ray
        super().__init__(CriticWorker, role, resource_pool, parallel, {"role": settings, "seed": seed}, seed,
                         call_timeout_s)

    def compute_values(self, sequences: Any) -> torch.Tensor:
        return self.group.compute_values(as_sequences(sequences).select(*SEQUENCE_KEYS))["values"]

    def update(self, sequences: Any, returns: torch.Tensor, values: torch.Tensor, clip_range: float | None = 0.2,
               mini_batches: int = 1, epochs: int = 1) -> dict[str, float]:
        data = as_sequences(sequences).select(*SEQUENCE_KEYS)
        data["returns"], data["values"] = returns.float(), values.float()
        return average_metrics(self.group.update(data, clip_range, mini_batches, epochs))

    def save_checkpoint(self, out_dir: str) -> None:
        """Value model, optimizer, LR scheduler and RNG states, as Actor.save_checkpoint."""
        self.group.save_checkpoint(str(out_dir))

    def load_checkpoint(self, ckpt_dir: str, load_optimizer: bool = True) -> None:
        self.group.load_checkpoint(str(ckpt_dir), load_optimizer)
