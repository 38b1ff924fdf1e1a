"""Tiny random-weight Hugging Face models (Llama, Qwen2, Qwen3 and the MoE families), created locally and
deterministically."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

from hybridrl.data.tokenizer import BUNDLED_TOKENIZER_DIR, VOCAB_SIZE

logger = logging.getLogger(__name__)

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
_CONFIG_CLASSES = {"llama": ("LlamaConfig", "Llama"), "qwen2": ("Qwen2Config", "Qwen2"),
                   "qwen3": ("Qwen3Config", "Qwen3"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2Moe"),
                   "qwen3_moe": ("Qwen3MoeConfig", "Qwen3Moe"), "mixtral": ("MixtralConfig", "Mixtral")}
TINY_HEADS = ("lm", "seq_cls")


def tiny_hf_config(family: str = "llama", *, vocab_size: int = 256, hidden: int = 64, layers: int = 4,
                   heads: int = 4, kv_heads: int = 2, ffn_hidden: int | None = None, tie: bool = False,
                   head: str = "lm", rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                   max_positions: int = 256, experts: int = 4, topk: int = 2, expert_ffn_hidden: int | None = None,
                   norm_topk_prob: bool = True, dense_layers: tuple[int, ...] = ()) -> Any:
    """A small config of `family`. MoE families: `experts` experts of `expert_ffn_hidden` (default hidden),
    `topk` per token, the layers in `dense_layers` with a dense MLP instead (Qwen MoE), Qwen2-MoE with a
    shared expert of 2 * hidden."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"family={family!r}; choose one of {TINY_FAMILIES}")
    if head not in TINY_HEADS:
        raise ValueError(f"head={head!r}; choose one of {TINY_HEADS}")
    import transformers

    class_name, prefix = _CONFIG_CLASSES[family]
    rope = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    extra: dict[str, Any] = {}
    if family.startswith("qwen3"):
        extra["head_dim"] = hidden // heads  # Qwen3's default is 128
    expert_ffn = expert_ffn_hidden or hidden
    if family == "mixtral":
        extra.update(num_local_experts=experts, num_experts_per_tok=topk, router_jitter_noise=0.0)
    elif family.endswith("_moe"):
        extra.update(num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=expert_ffn,
                     norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=list(dense_layers))
        if family == "qwen2_moe":
            extra["shared_expert_intermediate_size"] = 2 * hidden
    config = getattr(transformers, class_name)(
        vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=expert_ffn if family == "mixtral" else ffn_hidden or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_parameters=rope, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        architectures=[f"{prefix}For{'CausalLM' if head == 'lm' else 'SequenceClassification'}"], **extra)
    if head == "seq_cls":
        config.num_labels = 1
    return config


def create_tiny_model(out_dir: str | Path, family: str = "llama", *, vocab_size: int = 256, hidden: int = 64,
                      layers: int = 4, heads: int = 4, kv_heads: int = 2, seed: int = 0, head: str = "lm",
                      tie: bool = False, **config_kwargs: Any) -> Path:
    """Save a random-weight HF model (safetensors + config.json) to out_dir; same seed -> same bytes."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = tiny_hf_config(family, vocab_size=vocab_size, hidden=hidden, layers=layers, heads=heads,
                            kv_heads=kv_heads, tie=tie, head=head, **config_kwargs)
    model_cls = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_cls.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # HF inits norms to 1 and some biases to 0: randomise so tests see every tensor
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith(".bias"):
                    param.add_(0.1 * torch.randn_like(param))
    finally:
        torch.random.set_rng_state(generator_state)
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    logger.info("wrote tiny %s %s model to %s", family, head, out_dir)
    return out_dir


DEFAULT_TINY = {"family": "llama", "vocab_size": 64, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "seed": 0}
# models a config can name as `tiny:<name>` (actor.model.path), created on first use like the default
BUNDLED_MODELS = {
    "llama": DEFAULT_TINY,
    # 4 experts of 64, top-2 renormalised, q/k norms: the Qwen3-30B-A3B architecture at toy size
    "qwen3_moe": {"family": "qwen3_moe", "vocab_size": 64, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
                  "seed": 0, "experts": 4, "topk": 2, "expert_ffn_hidden": 64},
}
TINY_PREFIX = "tiny:"
# models a short run on the bundled task makes (not random weights), named like the bundled ones (tiny:<name>):
# name -> (build(out_dir) run on first use, or None when another tool makes it; how it is made, for errors)
MADE_MODELS: dict[str, tuple[Callable[[Path], None] | None, str]] = {}


def register_made_model(name: str, build: Callable[[Path], None] | None, how: str) -> None:
    MADE_MODELS[name] = (build, how)


def made_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the made model `name` lives (complete once it has config.json)."""
    return _cache_base(cache_dir) / f"made-{name}"


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The embedded default model: a tiny Llama over the bundled 64-character tokenizer, created
    deterministically on first use under $HYBRIDRL_CACHE (default ~/.cache/hybridrl) and reused after."""
    return bundled_model_dir("llama", cache_dir)


def resolve_model_path(path: str | None) -> str:
    """A model folder from a config value: None is the default tiny model, `tiny:<name>` a bundled one."""
    if path is None:
        return str(default_model_dir())
    if str(path).startswith(TINY_PREFIX):
        return str(bundled_model_dir(str(path)[len(TINY_PREFIX):]))
    return str(path)


def bundled_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """A bundled tiny model (BUNDLED_MODELS) over the bundled tokenizer, created once and reused."""
    import shutil
    import tempfile

    if name in MADE_MODELS:
        return _made_model(name, cache_dir)
    if name not in BUNDLED_MODELS:
        raise ValueError(f"{TINY_PREFIX}{name} is not a bundled model; choose one of "
                         f"{[TINY_PREFIX + n for n in [*BUNDLED_MODELS, *MADE_MODELS]]}")
    spec = dict(BUNDLED_MODELS[name])
    base = _cache_base(cache_dir)
    folder = "tiny-{family}-v{vocab_size}-h{hidden}-l{layers}".format(**spec) + \
        ("-e{experts}k{topk}".format(**spec) if "experts" in spec else "") + "-s{seed}".format(**spec)
    target = base / folder
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    assert spec["vocab_size"] == VOCAB_SIZE
    base.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder}-", dir=base))
    create_tiny_model(staging, spec.pop("family"), **spec)
    for item in BUNDLED_TOKENIZER_DIR.iterdir():
        shutil.copy(item, staging / item.name)
    try:
        staging.rename(target)  # atomic: concurrent first uses end with one complete folder
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def _cache_base(cache_dir: str | Path | None = None) -> Path:
    import os

    return Path(cache_dir or os.environ.get("HYBRIDRL_CACHE") or Path.home() / ".cache" / "hybridrl")


def _made_model(name: str, cache_dir: str | Path | None) -> Path:
    """A made model's folder, built on first use when its builder runs here (staged, then renamed: atomic)."""
    import shutil
    import tempfile

    build, how = MADE_MODELS[name]
    target = made_model_dir(name, cache_dir)
    if (target / "config.json").is_file():
        return target
    if build is None:
        raise ValueError(f"{TINY_PREFIX}{name} is not made yet: {how}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".made-{name}-", dir=target.parent))
    try:
        build(staging)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
