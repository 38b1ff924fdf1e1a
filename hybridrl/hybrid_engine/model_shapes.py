"""Real parameter shapes of a model, without memory: the model is built on the meta device.

Each parameter gets Megatron-Core's tensor-parallel rule (partition dim or replicated) and its place in the
pipeline (embedding on the first stage, final norm and output layer on the last, layer i on stage
i // (layers / p)). Fused tensors are described as Megatron holds them: QKV (one row block per query group)
and the gated fc1 ([gate; up] per TP shard); the byte counts equal the separate HF tensors'.
Mixture-of-experts layers: transformers 5 holds each layer's experts as two 3-D tensors; they are split into one
spec per expert (`expert` = its global number), as Megatron holds them (an expert's fc1 / fc2 at the TP rules of
a dense MLP). Routers and the shared-expert gate are replicated. Multi-head latent attention (DeepSeek-V3):
the down projections and their norms are replicated, the up projections column-parallel, as Megatron's MLA.

The shapes come from the Hugging Face model built on meta plus the rule table below, not from hybridrl.models'
Megatron builder: that one needs Megatron's process groups for the layout, and `hybridrl plan` sizes a 70B
model on 128 GPUs without Megatron, a process group or a GPU.
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
    expert: int | None = None   # global expert number of a mixture-of-experts weight; None: dense

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
    num_experts: int = 0        # routed experts per MoE layer (0: dense model)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def expert_numel(self) -> int:
        return sum(p.numel for p in self.params if p.expert is not None)


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
    # Llama-3 / 3.1 70B: Llama-2-70B's layers with a 128k vocabulary
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0),
}

# Mixture-of-experts models (their public config.json; DeepSeek-V3 without its multi-token-prediction layer,
# which transformers does not build): preset -> (transformers config class, arguments).
MOE_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)),
    "mixtral-8x7b": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5)),
    "deepseek-v3": ("DeepseekV3Config", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
        max_position_embeddings=163840, rms_norm_eps=1e-6)),
}
PRESETS = (*LLAMA_PRESETS, *MOE_PRESETS)


def load_hf_config(model: str):
    """A preset name (PRESETS) or a local Hugging Face config folder."""
    if model in LLAMA_PRESETS:
        from transformers import LlamaConfig

        return LlamaConfig(**LLAMA_PRESETS[model], tie_word_embeddings=False)
    if model in MOE_PRESETS:
        import transformers

        class_name, kwargs = MOE_PRESETS[model]
        return getattr(transformers, class_name)(**kwargs, tie_word_embeddings=False)
    if os.path.isdir(model):
        # start-up time: hybridrl.models imports torch, and every `hybridrl` command imports this module with
        # its parser (cli/plan.py)
        from hybridrl.models.config import load_hf_config as load_folder

        return load_folder(model)
    raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a folder "
                     f"holding a Hugging Face config.json; pass a preset name or a local model folder")


# HF parameter-name suffix -> (partition dim, Megatron tensor it belongs to). Rows of q/k/v end up in the
# fused QKV (column parallel), gate/up in fc1 (column parallel), o_proj / down_proj are row parallel. Fused
# experts (per expert after the split): gate_up_proj [2I, H] is a gated fc1, down_proj [H, I] a row-parallel fc2.
_TP_RULES: list[tuple[str, int | None, str]] = [
    ("experts.gate_up_proj", 0, GATED_HALVES), ("experts.down_proj", 1, CONCAT),
    ("mlp.gate.weight", None, CONCAT), ("shared_expert_gate.weight", None, CONCAT),
    ("q_a_proj.weight", None, CONCAT), ("kv_a_proj_with_mqa.weight", None, CONCAT),
    ("q_b_proj.weight", 0, CONCAT), ("kv_b_proj.weight", 0, CONCAT),
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
                     f"(q/k/v/o_proj, gate/up/down_proj, RMSNorm), their mixture-of-experts variants and "
                     f"DeepSeek-V3's latent attention. Add a rule in hybrid_engine/model_shapes.py")


_FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def _specs(name: str, shape: tuple[int, ...]) -> list[ParamSpec]:
    """The specs of one HF parameter: one, or one per expert for a fused [experts, ...] tensor."""
    dim, regroup = _rule(name)
    layer: int | None = None
    section = "final" if name.startswith("lm_head") or name.endswith("model.norm.weight") else "embedding"
    if ".layers." in name:
        layer = int(name.split(".layers.")[1].split(".")[0])
        section = "layer"
    if name.endswith(_FUSED_EXPERTS):
        prefix, _, leaf = name.rpartition(".")
        return [ParamSpec(f"{prefix}.{e}.{leaf}", shape[1:], dim, layer, section, regroup, expert=e)
                for e in range(shape[0])]
    return [ParamSpec(name, shape, dim, layer, section, regroup)]


def model_shapes(model: str) -> ModelShapes:
    """Parameter shapes of a preset or HF config folder, from the HF model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = load_hf_config(model)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(cfg)
    params = [spec for name, tensor in hf_model.named_parameters()  # tied weights appear once
              for spec in _specs(name, tuple(tensor.shape))]
    if getattr(cfg, "tie_word_embeddings", False):
        logger.info("%s ties input and output embeddings: counted once, on the first stage", model)
    experts = {p.expert for p in params if p.expert is not None}
    return ModelShapes(name=os.path.basename(os.path.normpath(model)), params=tuple(params),
                       num_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                       num_query_groups=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                       num_experts=len(experts))
