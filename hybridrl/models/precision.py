"""The precision a model runs in: `dtype: auto` (every model's default) made concrete for the machine and the model.

auto is bfloat16 where it is both native and worth it, float32 elsewhere:
- a CUDA GPU with bf16 (Ampere and later): bfloat16, Megatron's mixed precision (bf16 layers, fp32 main weights in
  the optimizer), what verl, NeMo-RL and TRL run by default;
- a CPU that multiplies bf16 natively (AMX or AVX512-BF16) and a model whose hidden size is at least
  CPU_BF16_MIN_HIDDEN: there the matmuls decide a step and bf16's run several times faster (measured on this
  project's 2-core Sapphire Rapids: the 25M peer job 1.4-1.9x TRL in bf16 against 1.1-1.2x in fp32). Below it a
  step is per-op overhead and bf16's casts cost more than its matmuls save (the 0.3M job: ~12k tokens/s in fp32,
  ~10k in bf16), so tiny models, the tests' included, stay in float32;
- anything else (an older GPU, a CPU without bf16 units): float32.

It is decided once on the driver (the run plan, the short API's roles), where hybridrl expects a node of the kind its
workers run on, and every role, the rollout engine and the memory plan then read the same concrete name.
"""
from __future__ import annotations

from typing import Any

import torch

from hybridrl.models.config import hf_config_for_plan
from hybridrl.models.peft import is_peft_adapter, model_config

AUTO = "auto"
CONCRETE_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = (AUTO, *CONCRETE_DTYPES)
CPU_BF16_MIN_HIDDEN = 512  # hidden size from which bf16 pays on a CPU with bf16 units (see above)


def cpu_has_native_bf16() -> bool:
    """AMX tiles or AVX512-BF16: oneDNN's bf16 matmuls run in hardware, not emulated through fp32."""
    probes = (getattr(torch.cpu, "_is_amx_tile_supported", None), getattr(torch.cpu, "_is_avx512_bf16_supported", None))
    return any(probe is not None and probe() for probe in probes)


def auto_dtype(hidden_size: int, on_gpu: bool | None = None, cpu_bf16: bool | None = None) -> str:
    """What auto means for a model of `hidden_size` on a GPU (on_gpu; None: this machine has CUDA) or a CPU
    (cpu_bf16: whether it multiplies bf16 natively; None: this machine's)."""
    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    if on_gpu:  # planned from a machine without CUDA (hybridrl plan --memory --gpu): a GPU with bf16
        return "float32" if torch.cuda.is_available() and not torch.cuda.is_bf16_supported() else "bfloat16"
    if cpu_bf16 is None:
        cpu_bf16 = cpu_has_native_bf16()
    return "bfloat16" if cpu_bf16 and hidden_size >= CPU_BF16_MIN_HIDDEN else "float32"


def resolve_dtype(name: str, hf_config: Any, on_gpu: bool | None = None) -> str:
    """`name` as a concrete dtype name: itself unless it is auto, then auto_dtype for the model's hidden size."""
    if name != AUTO:
        return name
    return auto_dtype(int(hf_config.hidden_size), on_gpu)


def model_dtype(name: str, model_path: Any, on_gpu: bool | None = None) -> str:
    """resolve_dtype for a model folder (or a PEFT adapter folder: its base model's size), read without weights."""
    if name != AUTO:
        return name
    return resolve_dtype(name, model_config(model_path) if is_peft_adapter(model_path)
                         else hf_config_for_plan(model_path), on_gpu)
