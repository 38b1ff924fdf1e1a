"""Tiny random-weight Hugging Face models (Llama / Qwen2), created locally and deterministically."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

TINY_FAMILIES = ("llama", "qwen2")
TINY_HEADS = ("lm", "seq_cls")


def tiny_hf_config(family: str = "llama", *, vocab_size: int = 256, hidden: int = 64, layers: int = 4,
                   heads: int = 4, kv_heads: int = 2, ffn_hidden: int | None = None, tie: bool = False,
                   head: str = "lm", rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                   max_positions: int = 256) -> Any:
    if family not in TINY_FAMILIES:
        raise ValueError(f"family={family!r}; choose one of {TINY_FAMILIES}")
    if head not in TINY_HEADS:
        raise ValueError(f"head={head!r}; choose one of {TINY_HEADS}")
    from transformers import LlamaConfig, Qwen2Config

    config_cls, prefix = (LlamaConfig, "Llama") if family == "llama" else (Qwen2Config, "Qwen2")
    rope = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    config = config_cls(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn_hidden or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_parameters=rope, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        architectures=[f"{prefix}For{'CausalLM' if head == 'lm' else 'SequenceClassification'}"])
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


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The embedded default model: a tiny Llama over the bundled 64-character tokenizer, created
    deterministically on first use under $HYBRIDRL_CACHE (default ~/.cache/hybridrl) and reused after."""
    import os
    import shutil
    import tempfile

    from hybridrl.data.tokenizer import BUNDLED_TOKENIZER_DIR, VOCAB_SIZE

    base = Path(cache_dir or os.environ.get("HYBRIDRL_CACHE") or Path.home() / ".cache" / "hybridrl")
    name = "tiny-llama-v{vocab_size}-h{hidden}-l{layers}-s{seed}".format(**DEFAULT_TINY)
    target = base / name
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    assert DEFAULT_TINY["vocab_size"] == VOCAB_SIZE
    base.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=base))
    spec = dict(DEFAULT_TINY)
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
