"""CUDA device calls mapped to the CPU.

Upstream: ~120 `torch.cuda.current_device()` sites and ~40 literal `"cuda"` / `.cuda()` sites across
megatron/core (e.g. utils.py GlobalMemoryBuffer, tensor_parallel/mappings.py and layers.py,
pipeline_parallel/p2p_communication.py and schedules.py, distributed/param_and_grad_buffer.py,
optimizer/optimizer.py found_inf, optimizer/clip_grads.py, models/common/language_module), plus
`torch.cuda.synchronize`, `torch.cuda.nvtx.*`, `torch.cuda.Stream` / `Event` / `current_stream` /
`stream`, and `pin_memory`. Without CUDA these fail with "AssertionError: Torch not compiled with CUDA
enabled" / "RuntimeError: NVTX functions not installed" / "pin_memory=True requires a CUDA ...".
Fix (process-global, so installed only when CUDA is absent): `current_device()` returns the CPU device;
synchronize / empty_cache / nvtx are no-ops; Stream / Event / current_stream are inert stand-ins; tensor
factories, `Tensor.to`, `Tensor.cuda` and `pin_memory` map a CUDA device to the CPU. A TorchFunctionMode
cannot do this: autograd.backward pops it (torch 2.13).
Checked on megatron-core 0.16.1 with torch 2.13.0+cpu.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from hybridrl.versions import MEGATRON_CORE, MEGATRON_CORE_CHECKED
from megatron_patches._base import replace, wraps

VERSIONS = SpecifierSet(MEGATRON_CORE)
CHECKED_ON = MEGATRON_CORE_CHECKED
UPSTREAM = ("megatron/core/**: torch.cuda.current_device/synchronize/nvtx/Stream/Event/current_stream, "
            "device='cuda' tensor factories, Tensor.cuda(), Tensor.to('cuda'), pin_memory")

CPU = torch.device("cpu")

# Tensor factories Megatron-Core calls with device=... (and pin_memory=...).
FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "linspace", "rand", "randn",
             "randint", "randperm", "eye", "empty_strided", "empty_like", "zeros_like", "ones_like",
             "full_like", "rand_like", "randn_like", "randint_like")
TENSOR_NEW = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def is_cuda_device(device: Any) -> bool:
    """True for 'cuda', 'cuda:N', torch.device('cuda', N) and a bare device index."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _map_device_kwargs(kwargs: dict) -> dict:
    if is_cuda_device(kwargs.get("device")):
        kwargs["device"] = CPU
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def _wrap_factory(fn):
    @wraps(fn)
    def factory(*args, **kwargs):
        return fn(*args, **_map_device_kwargs(kwargs))
    return factory


class DummyStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else DummyEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class DummyEvent:
    """Stands in for torch.cuda.Event."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0


def _noop(*args, **kwargs) -> None:
    return None


def apply() -> None:
    cuda = torch.cuda
    replace(cuda, "current_device", lambda: CPU)
    replace(cuda, "synchronize", _noop)
    replace(cuda, "empty_cache", _noop)
    replace(cuda, "Stream", DummyStream)
    replace(cuda, "Event", DummyEvent)
    replace(cuda, "current_stream", lambda device=None: DummyStream())
    replace(cuda, "default_stream", lambda device=None: DummyStream())
    replace(cuda, "stream", lambda stream=None: contextlib.nullcontext(stream))
    for name in ("range_push", "range_pop", "mark"):
        replace(cuda.nvtx, name, _noop)
    replace(cuda.nvtx, "range", lambda *args, **kwargs: contextlib.nullcontext())

    # `with torch.device("meta")` (transformers' loading, torch.get_default_device) redirects the
    # functions in this lru-cached set, compared by identity: build it from the real factories
    # before they are replaced (the wrappers call them, so the redirect still applies).
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in FACTORIES:
        replace(torch, name, _wrap_factory(getattr(torch, name)))
    tensor = torch.Tensor
    for name in TENSOR_NEW:
        replace(tensor, name, _wrap_factory(getattr(tensor, name)))

    upstream_to = tensor.to

    @wraps(upstream_to)
    def to(self, *args, **kwargs):
        if args and is_cuda_device(args[0]):
            args = (CPU,) + args[1:]
        return upstream_to(self, *args, **_map_device_kwargs(kwargs))

    def cuda_(self, device=None, non_blocking: bool = False, memory_format=torch.preserve_format):
        return self  # already on this process's device

    replace(tensor, "to", to)
    replace(tensor, "cuda", cuda_)
    replace(tensor, "pin_memory", lambda self, device=None: self)
    replace(tensor, "record_stream", lambda self, stream: None)
