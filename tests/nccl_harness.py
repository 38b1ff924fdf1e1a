"""A test harness that stands in for NCCL's device rule on CPU (issue 36 item 8).

On GPUs every process group hybridrl creates for a role is an NCCL group, and NCCL refuses a host tensor ("No
backend type associated with device type cpu") or a dtype it has no type for. On CPU everything is a CPU tensor
through gloo, so such a bug cannot show. Inside `device_collectives()`:

  - hybridrl's own code is watched (a TorchFunctionMode): a tensor it creates without naming a device (the
    default device, the host) or moves to the host (`.cpu()`, `.to("cpu")`, numpy), and every value computed
    only from such tensors, is marked as a host tensor, with the line that made it. A device named in the call
    (`device=device()`, `device=param.device`) is what runs on the GPU there, so those tensors are not marked;
    nor are tensors made inside Megatron or torch (CPU-initialised weights here, on the GPU there);
  - every torch.distributed tensor collective rejects a marked tensor, and a dtype NCCL cannot carry.

Use it around the code under test on every rank:

    with device_collectives() as seen:
        ... the code whose collectives must be NCCL-safe ...
    assert seen.checked > 0
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

HYBRIDRL = str(Path(__file__).resolve().parent.parent / "hybridrl")
# frames that only forward a call (torch's own Python, the CPU shims wrapping torch's factories, this module)
FORWARDERS = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parent.parent / "megatron_patches"),
              __file__)
MARK = "_host_tensor_made_at"

# dtypes ProcessGroupNCCL maps to an NCCL type (bool travels as uint8); float8 / unsigned wider ints do not
NCCL_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
               torch.int64, torch.bool}

# by name: the CPU shims (megatron_patches.cuda_device) replace torch.zeros & co. with wrappers of the originals
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "linspace",
             "eye", "from_numpy", "empty_strided"}
LIKE = {"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "new_tensor", "new_zeros",
        "new_ones", "new_full", "new_empty"}
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "send", "recv", "isend", "irecv", "all_to_all",
               "all_to_all_single", "gather", "scatter")


def _caller() -> str | None:
    """file:line of the first frame outside torch and this module, if it is hybridrl's code."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(FORWARDERS):
            return f"{Path(name).name}:{frame.f_lineno}" if name.startswith(HYBRIDRL) else None
        frame = frame.f_back
    return None


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _is_host_device(value) -> bool:
    return isinstance(value, str) and value.split(":")[0] == "cpu"


class _HostMarks(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = self._made_on_host(func, args, kwargs)
        if made:
            site = _caller()
            if site is not None:
                for tensor in _tensors(out):
                    setattr(tensor, MARK, site)
        elif func is torch.Tensor.to and self._moved_to_device(args, kwargs):
            for tensor in _tensors(out):  # .to(the device) of a CPU tensor returns it as it is here, a copy there
                if hasattr(tensor, MARK):
                    delattr(tensor, MARK)
        return out

    @staticmethod
    def _moved_to_device(args, kwargs) -> bool:
        where = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return where is not None and not _is_host_device(where)

    @staticmethod
    def _made_on_host(func, args, kwargs) -> bool:
        inputs = [t for t in _tensors((args, kwargs))]
        if getattr(func, "__name__", None) in FACTORIES:  # torch.zeros & co. (no Tensor method has these names)
            return kwargs.get("device") is None
        if getattr(func, "__name__", None) in LIKE:
            return kwargs.get("device") is None and any(getattr(t, MARK, None) for t in inputs[:1])
        if func is torch.Tensor.cpu:
            return True
        if func is torch.Tensor.to:
            where = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
            if where is not None:
                return _is_host_device(where)
            other = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
            return bool(getattr(other if other is not None else args[0], MARK, None))
        if getattr(func, "__name__", "").endswith("_") or func is torch.Tensor.__setitem__:
            return False  # in place: the tensor stays where it was
        # an op runs where its tensors are: on the host only when every one of them is
        return bool(inputs) and all(getattr(t, MARK, None) for t in inputs)


class Seen:
    checked = 0


def _guard(name: str, collective, seen: Seen):
    def call(*args, **kwargs):
        tensors = list(_tensors((args, kwargs)))
        if name in ("send", "recv", "isend", "irecv") or tensors:
            for tensor in tensors:
                site = getattr(tensor, MARK, None)
                if site is not None:
                    raise AssertionError(f"torch.distributed.{name} got a host tensor (made at {site}): on GPUs "
                                         f"the group is NCCL, which refuses it; create it on the group's device")
                if tensor.dtype not in NCCL_DTYPES:
                    raise AssertionError(f"torch.distributed.{name} got dtype {tensor.dtype}, which NCCL cannot carry")
            seen.checked += 1
        return collective(*args, **kwargs)

    return call


def _guard_batch(batch, seen: Seen):
    def call(ops):
        for op in ops:
            _guard("batch_isend_irecv", lambda *a, **k: None, seen)(op.tensor)
        return batch(ops)

    return call


@contextlib.contextmanager
def device_collectives():
    """Mark host tensors made by hybridrl's code and refuse them in collectives (see the module docstring)."""
    seen = Seen()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    originals["batch_isend_irecv"] = dist.batch_isend_irecv
    try:
        for name, fn in originals.items():
            setattr(dist, name, _guard_batch(fn, seen) if name == "batch_isend_irecv" else _guard(name, fn, seen))
        with _HostMarks():
            yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
