"""Hugging Face config -> Megatron-Core TransformerConfig + GPTModel arguments (the families of families.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridrl.models.families import ModelDims, UnsupportedModelError, family_for

logger = logging.getLogger(__name__)

# Megatron-Core's llama3 RoPE scaling has these constants built in (rotary_pos_embedding._apply_scaling).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class CheckpointError(ValueError):
    """A missing, truncated or inconsistent checkpoint."""


@dataclass
class RopeSettings:
    theta: float = 10000.0
    llama3_factor: float | None = None          # Llama-3.x scaling (Megatron rope_scaling=True)
    linear_factor: float | None = None          # linear position interpolation


@dataclass
class GPTArgs:
    """Everything GPTModel needs besides the TransformerConfig and the layer spec."""
    vocab_size: int                 # HF vocab
    padded_vocab_size: int          # Megatron vocab (multiple of tp)
    max_sequence_length: int
    rope: RopeSettings = field(default_factory=RopeSettings)
    tie_embeddings: bool = False


def load_hf_config(path: str | Path) -> Any:
    """AutoConfig from a folder, with a clear error when config.json is missing or unreadable."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; pass a Hugging Face model folder "
                              f"(save_pretrained output)")
    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as exc:  # transformers 5: OSError for a malformed JSON file
        raise CheckpointError(f"{path}/config.json cannot be read by transformers: {exc}") from None


# what the run plan reads of a model (layouts, experts): found in config.json under these names for every family
# hybridrl builds; another layout of the file goes through transformers
_PLAN_KEYS = ("num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")


def hf_config_for_plan(path: str | Path) -> Any:
    """The config.json of a model folder as attributes, read without transformers (whose config classes import for
    seconds): for the run plan's checks. Falls back to load_hf_config for a file that does not name its sizes
    plainly (a nested text_config, another family's key names)."""
    import json
    import types

    path = Path(path)
    try:
        values = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return load_hf_config(path)  # its error names the problem
    if not isinstance(values, dict) or not all(isinstance(values.get(k), int) for k in _PLAN_KEYS) \
            or any("expert" in k for k in values):  # experts' keys have per-family aliases (num_local_experts)
        return load_hf_config(path)
    return types.SimpleNamespace(**values)


def rope_settings(hf_config: Any) -> RopeSettings:
    """RoPE theta and scaling from either transformers 5 `rope_parameters` or older `rope_theta/rope_scaling`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "default":
        return RopeSettings(theta=theta)
    if rope_type == "linear":
        return RopeSettings(theta=theta, linear_factor=float(merged["factor"]))
    if rope_type == "llama3":
        for key, value in _MEGATRON_LLAMA3_ROPE.items():
            if key in merged and float(merged[key]) != value:
                raise UnsupportedModelError(
                    f"rope_scaling llama3 with {key}={merged[key]} is not supported (Megatron-Core fixes "
                    f"{key}={value}); use a checkpoint with the standard Llama-3.1 rope_scaling")
        return RopeSettings(theta=theta, llama3_factor=float(merged["factor"]))
    raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported; supported: "
                                f"default (none), linear, llama3")


def check_supported(hf_config: Any) -> None:
    """Refuse config features the Megatron model would silently get wrong."""
    family = family_for(hf_config)
    if family.name == "llama" and getattr(hf_config, "attention_bias", False):
        raise UnsupportedModelError("Llama with attention_bias=True (bias on o_proj too) is not supported")
    if getattr(hf_config, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported (Megatron add_bias_linear would add all biases)")
    if getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedModelError("use_sliding_window=True is not supported; set it to false in config.json")
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise UnsupportedModelError("router_jitter_noise > 0 (random router noise in training) is not supported; "
                                    "set it to 0 in config.json")
    if family.moe is not None and ModelDims.from_hf(hf_config).moe is None:
        raise UnsupportedModelError(f"a {family.name} config without experts (num_experts=0) is not supported")
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported (SwiGLU needs silu)")
    rope_settings(hf_config)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Smallest multiple of tp holding the vocab: Megatron splits vocab rows evenly over TP."""
    return -(-vocab_size // tp) * tp


def gpt_args_from_hf(hf_config: Any, tp: int, padded_vocab_size: int | None = None) -> GPTArgs:
    check_supported(hf_config)
    padded = padded_vocab_size or padded_vocab(hf_config.vocab_size, tp)
    if padded % tp or padded < hf_config.vocab_size:
        raise CheckpointError(f"padded vocab {padded} is not a multiple of tp={tp} covering vocab "
                              f"{hf_config.vocab_size}; convert the checkpoint at a tp that divides {padded}")
    return GPTArgs(vocab_size=hf_config.vocab_size, padded_vocab_size=padded,
                   max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
                   rope=rope_settings(hf_config),
                   tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))


def compiled_softmax_available() -> bool:
    """Whether the masked-softmax kernels Megatron's local attention fuses with are importable (apex's / Megatron's
    compiled extensions; the local spec imports them inside its forward, so a fusion without them fails there)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None
               for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))


def wgrad_fusion_available() -> bool:
    """Whether apex's fused weight-gradient kernel imports: Megatron's own ColumnParallelLinear (the output layer in
    every spec, every linear in the local spec) raises at build with gradient_accumulation_fusion on without it,
    Transformer Engine or not."""
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def fusion_settings(on_gpu: bool, transformer_engine: bool, softmax_kernels: bool,
                    wgrad_kernel: bool = False) -> dict[str, bool]:
    """Megatron's kernel fusions this process can run (issue 36 items 9, 10: a GPU without TE or apex must not
    assert):
    - bias-activation (SwiGLU) and bias-dropout fusions are torch.jit / torch.compile kernels: every GPU (on CPU
      they compile through torch.compile for 15-20 s per process: off);
    - RoPE fusion is Transformer Engine's kernel: with TE layers only;
    - gradient-accumulation fusion (weight gradients straight into Megatron's fp32 main_grad) needs apex's
      fused_weight_gradient_mlp_cuda for Megatron's own linears, the output layer included: with it only (TE's
      linears alone would not need it, but the flag is one for the whole model);
    - persist_layer_norm is apex's persistent LayerNorm kernel; the local spec's torch RMSNorm asserts it off;
    - the masked-softmax fusion is used by the local attention only, with compiled kernels present."""
    return dict(bias_activation_fusion=on_gpu, bias_dropout_fusion=on_gpu,
                apply_rope_fusion=on_gpu and transformer_engine,
                gradient_accumulation_fusion=on_gpu and wgrad_kernel,
                masked_softmax_fusion=on_gpu and not transformer_engine and softmax_kernels,
                persist_layer_norm=False)


def transformer_config_from_hf(hf_config: Any, *, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                               dtype: torch.dtype = torch.float32, on_gpu: bool = False, ep: int = 1,
                               expert_tp: int | None = None, transformer_engine: bool = False, **overrides: Any):
    """The Megatron TransformerConfig of a Llama/Qwen2 HF config (fusions by fusion_settings, CPU init on CPU). For a
    mixture-of-experts model `ep` and `expert_tp` must be the sizes the model runs at: Megatron's expert layers
    read them from the config to mark their weights expert-parallel (`param.allreduce=False`), which DDP and the
    optimizer use to reduce their gradients over the expert-data-parallel group instead of the whole DP group."""
    from megatron.core.transformer import TransformerConfig

    check_supported(hf_config)
    family = family_for(hf_config)
    d = ModelDims.from_hf(hf_config)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UnsupportedModelError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    kwargs: dict[str, Any] = dict(
        num_layers=d.num_layers, hidden_size=d.hidden, ffn_hidden_size=d.ffn_hidden,
        num_attention_heads=d.num_heads, num_query_groups=d.num_query_groups, kv_channels=d.head_dim,
        normalization="RMSNorm", layernorm_epsilon=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=family.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True,
        **fusion_settings(on_gpu, transformer_engine, on_gpu and compiled_softmax_available(),
                          on_gpu and wgrad_fusion_available()),
        cross_entropy_loss_fusion=False,
        use_cpu_initialization=not on_gpu,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        qk_layernorm=family.qk_norm,
    )
    if d.moe is not None:
        kwargs.update(_moe_kwargs(d.moe), expert_model_parallel_size=ep, expert_tensor_parallel_size=expert_tp or tp)
    elif ep != 1 or expert_tp not in (None, tp):
        raise UnsupportedModelError(f"expert parallelism (ep={ep}, expert_tp={expert_tp}) for a model without experts")
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _moe_kwargs(moe: Any) -> dict[str, Any]:
    """Megatron's MoE settings for the HF router: top-k over softmax(logits), renormalised (Mixtral, Qwen3-MoE
    with norm_topk_prob) = Megatron's softmax over the top-k logits; not renormalised (Qwen2-MoE) = its
    pre-softmax router. No load-balancing loss or z-loss unless the caller sets them (they change the loss,
    never the logits); tokens are exchanged with the all-to-all dispatcher, none dropped."""
    kwargs = dict(num_moe_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.ffn_hidden,
                  moe_router_pre_softmax=not moe.normalize_topk, moe_token_dispatcher_type="alltoall",
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                  moe_layer_freq=[int(is_moe) for is_moe in moe.layers])
    if moe.shared_ffn_hidden:
        kwargs.update(moe_shared_expert_intermediate_size=moe.shared_ffn_hidden, moe_shared_expert_gate=True)
    return kwargs
