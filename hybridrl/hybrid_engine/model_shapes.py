"""Real parameter shapes of a model, without memory: the model is built on the meta device.

Each parameter gets Megatron-Core's tensor-parallel rule (partition dim or replicated) and its place in the
pipeline (embedding on the first stage, final norm and output layer on the last, layer i on stage
i // (layers / p)). Fused tensors are described as Megatron holds them: QKV (one row block per query group)
and the gated fc1 ([gate; up] per TP shard); the byte counts equal the separate HF tensors'.

TODO(models/): switch to hybridrl.models' Megatron GPTModel builder on the meta device once it lands; until
then the shapes come from the Hugging Face model built on meta plus the rule table below.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# How a generation TP shard is formed from consecutive training TP shards of a partitioned tensor.
CONCAT = "concat"            # plain concatenation along the partition dim
GATED_HALVES = "gated_halves"  # Megatron gated fc1: each shard is [gate_i; up_i] -> [gates...; ups...]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the hybrid engine sees it."""
    name: str
    shape: tuple[int, ...]
    partition_dim: int | None   # None: replicated over TP (norms)
    layer: int | None           # transformer layer index; None for embedding / final norm / output
    section: str                # "embedding" | "layer" | "final"
    regroup: str = CONCAT

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelShapes:
    """All parameters of a model plus the sizes the layouts are checked against."""
    name: str
    params: tuple[ParamSpec, ...]
    num_layers: int
    num_attention_heads: int
    num_query_groups: int

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


# Real Llama-2 7B/13B/70B and CodeLlama-34B sizes (public model cards / config.json), written in code.
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama-34b": dict(hidden_size=8192, intermediate_size=22016, num_hidden_layers=48, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=16384, rms_norm_eps=1e-5,
                      rope_theta=1e6),
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
}


def load_hf_config(model: str):
    """A preset name (llama-7b/13b/34b/70b) or a local Hugging Face config folder."""
    if model in LLAMA_PRESETS:
        from transformers import LlamaConfig

        return LlamaConfig(**LLAMA_PRESETS[model], tie_word_embeddings=False)
    if os.path.isdir(model):
        from hybridrl.models.config import load_hf_config as load_folder

        return load_folder(model)
    raise ValueError(f"--model {model!r} is neither a preset ({', '.join(LLAMA_PRESETS)}) nor a folder "
                     f"holding a Hugging Face config.json; pass a preset name or a local model folder")


# HF parameter-name suffix -> (partition dim, Megatron tensor it belongs to). Rows of q/k/v end up in the
# fused QKV (column parallel), gate/up in fc1 (column parallel), o_proj / down_proj are row parallel.
_TP_RULES: list[tuple[str, int | None, str]] = [
    ("embed_tokens.weight", 0, CONCAT),
    ("lm_head.weight", 0, CONCAT),
    ("q_proj.weight", 0, CONCAT), ("k_proj.weight", 0, CONCAT), ("v_proj.weight", 0, CONCAT),
    ("q_proj.bias", 0, CONCAT), ("k_proj.bias", 0, CONCAT), ("v_proj.bias", 0, CONCAT),
    ("o_proj.weight", 1, CONCAT),
    ("gate_proj.weight", 0, GATED_HALVES), ("up_proj.weight", 0, GATED_HALVES),
    ("down_proj.weight", 1, CONCAT),
    ("norm.weight", None, CONCAT), ("layernorm.weight", None, CONCAT),
]


def _rule(name: str) -> tuple[int | None, str]:
    for suffix, dim, regroup in _TP_RULES:
        if name.endswith(suffix):
            return dim, regroup
    raise ValueError(f"no tensor-parallel rule for parameter {name!r}; supported families: Llama-like "
                     f"(q/k/v/o_proj, gate/up/down_proj, RMSNorm). Add a rule in hybrid_engine/model_shapes.py")


def model_shapes(model: str) -> ModelShapes:
    """Parameter shapes of a preset or HF config folder, from the HF model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = load_hf_config(model)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(cfg)
    params = []
    for name, tensor in hf_model.named_parameters():  # tied weights appear once
        dim, regroup = _rule(name)
        layer: int | None = None
        section = "final" if name.startswith("lm_head") or name.endswith("model.norm.weight") else "embedding"
        if ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            section = "layer"
        params.append(ParamSpec(name, tuple(tensor.shape), dim, layer, section, regroup))
    if getattr(cfg, "tie_word_embeddings", False):
        logger.info("%s ties input and output embeddings: counted once, on the first stage", model)
    return ModelShapes(name=os.path.basename(os.path.normpath(model)), params=tuple(params),
                       num_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                       num_query_groups=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
