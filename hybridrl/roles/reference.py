"""The reference policy role: the frozen initial policy's log-probs (workers/actor.py ReferenceWorker)."""
from __future__ import annotations

from typing import Any

import torch

from hybridrl.config import ModelConfig, ParallelConfig, RoleConfig
from hybridrl.controller import ResourcePool
from hybridrl.data.tokenizer import tokenizer_for
from hybridrl.models.hub import resolve_model
from hybridrl.models.peft import tokenizer_folder
from hybridrl.models.precision import model_dtype
from hybridrl.parallel.layout import ParallelLayout
from hybridrl.roles.base import DEFAULT_MAX_TOKENS_PER_MICRO_BATCH, Role, parallel_argument
from hybridrl.rollout.prompts import check_prompts
from hybridrl.rollout.types import SEQUENCE_KEYS, as_sequences
from hybridrl.workers.actor import ReferenceWorker


class ReferencePolicy(Role):
    """The frozen initial policy; by default it takes the pool's layout (colocated with the actor)."""

    def __init__(self, model: str | None = None, resource_pool: ResourcePool | None = None,
                 parallel: dict | ParallelConfig | ParallelLayout | None = None, micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
                 dtype: str = "auto", seed: int = 1, role: str = "ref", tokenizer: Any = None,
                 call_timeout_s: float | None = 3600.0,
                 parallel_config: dict | ParallelConfig | ParallelLayout | None = None) -> None:
        parallel = parallel_argument(parallel, parallel_config, "ReferencePolicy")
        path = resolve_model(model, "ReferencePolicy(model=...)")
        self.tokenizer = tokenizer_for(tokenizer_folder(path), tokenizer)  # to check the prompts given to get_log_probs
        settings = RoleConfig(model=ModelConfig(path, model_dtype(dtype, path)), micro_batch_size=micro_batch_size,
                              max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        super().__init__(ReferenceWorker, role, resource_pool, parallel, {"role": settings, "seed": seed}, seed,
                         call_timeout_s)

    def get_log_probs(self, prompts: Any, sequences: Any = None) -> torch.Tensor:
        """[B, R] log-probs of the responses in `sequences` under the reference policy.

        get_log_probs(prompts, sequences): the prompts must be those the sequences were generated from (the
        sequences hold them; a mismatch is an error). get_log_probs(rollout): the rollout alone."""
        if sequences is None:
            sequences = prompts
        else:
            check_prompts(self.tokenizer, prompts, as_sequences(sequences), "ref_policy.get_log_probs(prompts, ...)")
        data = as_sequences(sequences).select(*SEQUENCE_KEYS)
        return self.group.compute_ref_log_probs(data)["ref_log_probs"]
