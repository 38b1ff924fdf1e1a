"""`Tensor.type()` reports CUDA type names inside the optimizer's dtype checks.

Upstream: megatron/core/optimizer/distrib_optimizer.py
`DistributedOptimizer._build_model_and_main_param_groups` and `DistributedOptimizer.__init__`,
megatron/core/optimizer/optimizer.py `Float16OptimizerWithFloat16Params.__init__`,
megatron/core/optimizer/clip_grads.py `clip_grad_by_total_norm_fp32` compare `param.type()` with
'torch.cuda.FloatTensor' / 'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor'. A CPU tensor says
'torch.FloatTensor', so the distributed optimizer fails with
"TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ..." and clipping asserts.
Fix: only while those functions run, `Tensor.type()` (no arguments) on a CPU float tensor returns the
CUDA name. Everything else in the process keeps the real `Tensor.type`.
Checked on megatron-core 0.16.1.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from packaging.specifiers import SpecifierSet

from hybridrl.versions import MEGATRON_CORE, MEGATRON_CORE_CHECKED
from megatron_patches._base import is_patched, replace, wraps

VERSIONS = SpecifierSet(MEGATRON_CORE)
CHECKED_ON = MEGATRON_CORE_CHECKED
UPSTREAM = ("megatron/core/optimizer/distrib_optimizer.py: DistributedOptimizer.__init__, "
            "_build_model_and_main_param_groups; optimizer/optimizer.py: Float16OptimizerWithFloat16Params"
            ".__init__; optimizer/clip_grads.py: clip_grad_by_total_norm_fp32")

CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                   torch.bfloat16: "torch.cuda.BFloat16Tensor"}

_lock = threading.RLock()
_depth = 0
_real_type = torch.Tensor.type


def _cuda_named_type(self, dtype=None, non_blocking: bool = False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in CUDA_TYPE_NAMES:
        return CUDA_TYPE_NAMES[self.dtype]
    return _real_type(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """While active, `Tensor.type()` names CPU float tensors as their CUDA counterparts."""
    global _depth
    with _lock:
        if _depth == 0:
            torch.Tensor.type = _cuda_named_type
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.Tensor.type = _real_type


def _scoped(fn):
    @wraps(fn)
    def scoped(*args, **kwargs):
        with cuda_type_names():
            return fn(*args, **kwargs)
    return scoped


def apply() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    dist_opt = distrib_optimizer.DistributedOptimizer
    if not is_patched(dist_opt, "__init__"):
        build = dist_opt.__dict__["_build_model_and_main_param_groups"]  # a classmethod object
        replace(dist_opt, "_build_model_and_main_param_groups", classmethod(_scoped(build.__func__)))
        replace(dist_opt, "__init__", _scoped(dist_opt.__init__))
    fp16_opt = optimizer.Float16OptimizerWithFloat16Params
    replace(fp16_opt, "__init__", _scoped(fp16_opt.__init__))
    scoped_clip = _scoped(clip_grads.clip_grad_by_total_norm_fp32)
    replace(clip_grads, "clip_grad_by_total_norm_fp32", scoped_clip)
    replace(optimizer, "clip_grad_by_total_norm_fp32", scoped_clip)  # imported by name there
