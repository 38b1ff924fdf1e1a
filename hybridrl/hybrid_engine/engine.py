"""HybridEngine: the actor's switch between its training layout and its generation layout.

One object per rank, built once (collectively) next to the training model:

    engine = HybridEngine(train_model, hf_config, layout, GenerationLayout(tp=1), strategy="hybrid")
    gen_model = engine.to_generation()   # reshard: training shards -> this rank's generation shard
    ... generate with gen_model (rollout engine) ...
    engine.to_training()                 # release what generation held; training weights untouched

When the generation layout equals the training layout (t_g = t, p = p_g = 1) nothing moves: the training
model itself generates. Otherwise a generation-layout Megatron model is built on the strided generation
groups (parallel/generation.py) and filled by the Resharder.
"""
from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from hybridrl.hybrid_engine.megatron_adapter import (generation_pg_collection, load_generation_weights,
                                                     training_params)
from hybridrl.hybrid_engine.reshard import Resharder, ReshardStats
from hybridrl.parallel.generation import GenerationGroups, GenerationLayout, check_generation_layout
from hybridrl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)


class HybridEngine:
    """Training <-> generation layout for one rank's actor model (construction is collective)."""

    def __init__(self, train_model: Any, hf_config: Any, layout: ParallelLayout, gen_layout: GenerationLayout,
                 strategy: str = "hybrid") -> None:
        from hybridrl.models.builder import build_gpt_model, unwrap

        check_generation_layout(layout, gen_layout, num_attention_heads=hf_config.num_attention_heads,
                                num_query_groups=getattr(hf_config, "num_key_value_heads", None),
                                num_layers=hf_config.num_hidden_layers)
        self.groups = GenerationGroups(layout, gen_layout)
        self.rank = dist.get_rank()
        self.train_model = train_model
        self.identity = self.groups.micro_dp_size == 1 and gen_layout.pp == layout.pp == 1
        self.last_stats = ReshardStats()
        if self.identity:
            self.resharder = None
            self.gen_model = unwrap(train_model)
            self.tp_group = None
            return
        stage = layout.coords(self.rank).pp
        self.resharder = Resharder(self.groups, training_params(train_model, stage), strategy)
        pgs = generation_pg_collection(self.groups)
        inner = unwrap(train_model)
        self.gen_model = build_gpt_model(hf_config, pg_collection=pgs, dtype=next(inner.parameters()).dtype,
                                         padded_vocab_size=inner.hybridrl_args.padded_vocab_size)
        self.gen_model.eval()
        self.tp_group = pgs.tp

    # ---- where this rank generates -------------------------------------------------------------------
    @property
    def gen_dp_rank(self) -> int:
        """Which generation replica this rank belongs to (prompts are split over replicas)."""
        return self.groups.gen_dp_rank(self.rank)

    @property
    def gen_dp_size(self) -> int:
        return self.groups.gen_dp_size

    @property
    def is_gen_collect_rank(self) -> bool:
        """True on generation TP rank 0 (of the single generation stage): it returns the replica's output."""
        return self.groups.gen_shard(self.rank).gen_tp == 0

    # ---- the transition ------------------------------------------------------------------------------
    def to_generation(self) -> Any:
        """Fill the generation-layout model from the current training weights; returns it."""
        if self.resharder is not None:
            tensors = self.resharder.to_generation()
            load_generation_weights(self.gen_model, tensors)
            self.last_stats = self.resharder.last_stats
        return self.gen_model

    def to_training(self) -> None:
        """Drop what the transition allocated (the training parameters were never modified)."""
        if self.resharder is not None:
            self.resharder.to_training()
