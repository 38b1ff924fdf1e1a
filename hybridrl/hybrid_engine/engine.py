"""HybridEngine: the actor's switch between its training layout and its generation layout.

One object per rank, built once (collectively) next to the training model:

    engine = HybridEngine(train_model, hf_config, layout, GenerationLayout(tp=1), strategy="hybrid")
    gen_model = engine.to_generation()   # reshard: training shards -> this rank's generation shard
    ... generate with gen_model (rollout engine) ...
    engine.to_training()                 # release what generation held; training weights bit-identical

When the generation layout equals the training layout (t_g = t, p = p_g = 1, no expert parallelism) nothing
moves: the training model itself generates. Mixture-of-experts models generate with one of e_g blocks of the
experts on each rank (every expert when e_g = 1): with expert parallelism in training, the experts of the other
training blocks in the rank's generation block are all-gathered first, or regrouped into the dense TP layout
when the experts' TP differs from the TP (experts.py).
Otherwise a generation-layout Megatron model (t_g, p_g; the rollout engines use p_g = 1, a p_g > 1 model is a
pipeline stage run by the caller) is built on the strided generation groups
(parallel/generation.py) and its parameters are pointed at the Resharder's generation buffer on each
to_generation() (hybrid: in place, see reshard.py; the model object stays the same, so a rollout engine built
on `gen_model` once keeps working). Between transitions the generation model holds no parameter memory, and
with release_training the training storages are freed while generating (zero redundancy).
"""
from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from hybridrl.hybrid_engine.experts import expert_stage
from hybridrl.hybrid_engine.megatron_adapter import (attach_generation_weights, build_generation_model,
                                                     detach_generation_weights, generation_pg_collection,
                                                     training_params)
from hybridrl.hybrid_engine.reshard import Resharder, ReshardStats
from hybridrl.models.builder import unwrap
from hybridrl.parallel.generation import GenerationGroups, GenerationLayout, check_generation_layout
from hybridrl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)


class HybridEngine:
    """Training <-> generation layout for one rank's actor model (construction is collective).

    bucket_mb: most megabytes (MiB) one reshard collective outputs; bounds the transient scratch.
    release_training (hybrid): free the training parameter storages while generating and restore them in
    to_training() (bit-identical); False keeps them (the rank's shard is then held twice while generating).
    """

    def __init__(self, train_model: Any, hf_config: Any, layout: ParallelLayout, gen_layout: GenerationLayout,
                 strategy: str = "hybrid", *, bucket_mb: float = 32.0, release_training: bool = True) -> None:
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb!r}: the reshard bucket must be a positive size in MiB "
                             f"(e.g. 32)")
        if gen_layout.ep > 1 and (strategy != "hybrid" or gen_layout.pp != 1):
            raise ValueError(f"generation expert parallelism e_g={gen_layout.ep} runs with the hybrid strategy and "
                             f"p_g = 1 (got {strategy}, p_g={gen_layout.pp})")
        if layout.ep > 1 and strategy == "ds_chat":
            raise ValueError("strategy ds_chat is the ZeRO-3 baseline, which has no expert parallelism; with "
                             f"ep={layout.ep} use hybrid or hybridflow_v")
        check_generation_layout(layout, gen_layout, num_attention_heads=hf_config.num_attention_heads,
                                num_query_groups=getattr(hf_config, "num_key_value_heads", None),
                                num_layers=hf_config.num_hidden_layers)
        self.groups = GenerationGroups(layout, gen_layout)
        self.rank = dist.get_rank()
        self.train_model = train_model
        # sequence parallelism splits activations along the sequence: decoding one token at a time cannot use
        # it, so a sequence-parallel training model always gets a separate generation model
        # fully sharded parameters are gathered into a generation model too (fsdp_gather.py)
        self.identity = (self.groups.micro_dp_size == 1 and gen_layout.pp == layout.pp == 1
                         and not layout.sequence_parallel and layout.ep == 1 and layout.dp_shards == 1)
        self.last_stats = ReshardStats()
        self.in_generation = False
        if self.identity:
            self.resharder = None
            self.gen_model = unwrap(train_model)
            self.tp_group = None
            return
        stage = layout.coords(self.rank).pp
        pgs = generation_pg_collection(self.groups)
        inner = unwrap(train_model)
        first = next(inner.parameters())
        # no memory for its weights (meta build): they will view the generation buffer
        self.gen_model, self._gen_shapes = build_generation_model(
            hf_config, pgs, first.dtype, inner.hybridrl_args.padded_vocab_size, first.device,
            local_spec=getattr(inner, "hybridrl_local_spec", False))
        params = training_params(train_model, stage)
        self.experts = None  # expert parallelism: the other ranks' experts are gathered first (experts.py)
        if layout.ep > 1 or layout.expert_tp != layout.tp:
            self.experts = expert_stage(params, inner.config.num_moe_experts, layout, self.rank, gen_layout.ep,
                                        bucket_bytes=max(1, int(bucket_mb * (1 << 20))))
            params = self.experts.params(params) if self.experts is not None else params
        self.resharder = Resharder(self.groups, params, strategy,
                                   bucket_bytes=max(1, int(bucket_mb * (1 << 20))),
                                   release_training=release_training, generation_names=set(self._gen_shapes))
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
        """True on generation TP rank 0 of the last generation stage: it returns the replica's output."""
        shard = self.groups.gen_shard(self.rank)
        return shard.gen_tp == 0 and shard.gen_pp == self.groups.gen.pp - 1

    # ---- the transition ------------------------------------------------------------------------------
    def to_generation(self) -> Any:
        """Fill the generation-layout model from the current training weights; returns it. While generating
        (hybrid, release_training) the training parameters have no storage: call to_training() before
        training or reading them."""
        if self.resharder is not None and not self.in_generation:
            expert_bytes = self.experts.gather() if self.experts is not None else 0
            tensors = self.resharder.to_generation()
            attach_generation_weights(self.gen_model, tensors, self._gen_shapes)
            self.last_stats = self.resharder.last_stats
            if self.experts is not None:  # the gathered experts' buffers: allocated now, released as training
                stats = self.last_stats  # parameters with release_training
                stats.extra["expert_recv_bytes"] = expert_bytes
                stats.recv_payload_bytes += expert_bytes
                stats.recv_wire_bytes += expert_bytes
                stats.held_bytes += self.experts.allocated_bytes
                if self.resharder.release_training:
                    stats.released_training_bytes -= self.experts.allocated_bytes
                stats.collectives += self.experts.collectives
                stats.messages += self.experts.messages
        self.in_generation = True
        return self.gen_model

    def to_training(self) -> None:
        """Free the generation buffer and restore the training parameters (bit-identical)."""
        if self.resharder is not None and self.in_generation:
            detach_generation_weights(self.gen_model)
            self.resharder.to_training()
            if self.experts is not None:
                self.experts.release()
        self.in_generation = False
