"""Batch: the one container that moves between the driver and the workers.

A Batch holds rows that share batch dimension 0:
  * tensors     -- a tensordict.TensorDict with batch_size [N] (token ids, masks, log-probs, ...);
  * non_tensors -- per-row object arrays of length N (prompt texts, sample ids, ...);
  * meta        -- a plain dict for batch-level values (temperature, step, metrics).

It is cheap to pickle: tensors travel as numpy buffers (pickle protocol 5 out-of-band), so Ray's
object store stores them without an extra copy, and a receiver copies each tensor at most once
(only when the store hands back read-only shared memory, which must not be written in place).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from tensordict import TensorDict


def _tensordict() -> type:
    # start-up time: tensordict imports torch._dynamo (~1.5 s), which commands that only check a config never need
    from tensordict import TensorDict

    return TensorDict

# numpy has no bfloat16 / float8: such tensors travel as same-width integer views.
_NUMPY_VIEW_DTYPES = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}


class BatchError(ValueError):
    """A Batch operation on inconsistent data (row counts, conflicting keys, bad sizes)."""


def _as_object_array(values: Any, key: str) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise BatchError(f"non-tensor field {key!r} must be a per-row list or 1-D array, got {type(values).__name__}")
    out = np.empty(len(values), dtype=object)
    out[:] = list(values) if not isinstance(values, np.ndarray) else [v for v in values]
    return out


def _tensor_to_wire(tensor: torch.Tensor) -> tuple[np.ndarray, torch.dtype, torch.Size]:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    dtype = tensor.dtype
    if dtype in _NUMPY_VIEW_DTYPES:
        tensor = tensor.view(_NUMPY_VIEW_DTYPES[dtype])
    return tensor.contiguous().numpy(), dtype, tensor.shape


def _tensor_from_wire(array: np.ndarray, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    if not array.flags.writeable:
        array = array.copy()  # read-only shared memory (Ray object store): never write through it
    tensor = torch.from_numpy(array).reshape(shape)
    return tensor.view(dtype) if dtype in _NUMPY_VIEW_DTYPES else tensor


class Batch:
    """Rows of tensors and per-row Python objects plus batch-level meta; see the module docstring."""

    def __init__(self, tensors: dict[str, torch.Tensor] | TensorDict | None = None,
                 non_tensors: dict[str, list | np.ndarray] | None = None,
                 meta: dict | None = None) -> None:
        non_tensors = {k: _as_object_array(v, k) for k, v in (non_tensors or {}).items()}
        lengths = {f"non_tensors[{k!r}]": len(v) for k, v in non_tensors.items()}
        TensorDict = _tensordict()
        if isinstance(tensors, TensorDict):
            td = tensors
            if td.batch_dims < 1:
                raise BatchError("a TensorDict given to Batch needs batch_size [N]")
            if td.batch_dims > 1:
                td = td.clone(False)
                td.batch_size = td.batch_size[:1]
            if len(td.keys()):
                lengths["tensors"] = td.batch_size[0]
        else:
            tensors = dict(tensors or {})
            for key, value in tensors.items():
                if not isinstance(value, torch.Tensor):
                    raise BatchError(f"tensor field {key!r} is a {type(value).__name__}; put non-tensors in non_tensors")
                if value.dim() == 0:
                    raise BatchError(f"tensor field {key!r} is a scalar; batch-level values belong in meta")
                lengths[f"tensors[{key!r}]"] = value.shape[0]
            td = None
        if len(set(lengths.values())) > 1:
            raise BatchError(f"all fields must share batch dim 0, got lengths {lengths}")
        size = next(iter(lengths.values()), 0 if td is None else td.batch_size[0])
        if td is None:
            td = TensorDict(tensors, batch_size=[size])
        elif td.batch_size[0] != size:  # an empty TensorDict beside non-tensors takes their length
            td = TensorDict({}, batch_size=[size], device=td.device)
        self.tensors: TensorDict = td
        self.non_tensors: dict[str, np.ndarray] = non_tensors
        self.meta: dict = dict(meta or {})

    # ---- mapping-like access ----------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def keys(self) -> list[str]:
        return list(self.tensors.keys()) + list(self.non_tensors.keys())

    def __contains__(self, key: str) -> bool:
        return key in self.tensors.keys() or key in self.non_tensors

    def __getitem__(self, item):
        if isinstance(item, str):
            if item in self.non_tensors:
                return self.non_tensors[item]
            if item in self.tensors.keys():
                return self.tensors[item]
            raise KeyError(f"Batch has no field {item!r}; fields: {self.keys()}")
        return self.index(item)

    def __setitem__(self, key: str, value) -> None:
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != len(self):
                raise BatchError(f"field {key!r} has shape {tuple(value.shape)}; need {len(self)} rows")
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            array = _as_object_array(value, key)
            if len(array) != len(self):
                raise BatchError(f"field {key!r} has {len(array)} rows; need {len(self)}")
            if key in self.tensors.keys():
                del self.tensors[key]
            self.non_tensors[key] = array

    def __repr__(self) -> str:
        fields = [f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items()]
        fields += [f"{k}: [{len(v)}] object" for k, v in self.non_tensors.items()]
        return f"Batch(len={len(self)}, {{{', '.join(fields)}}}, meta={sorted(self.meta)})"

    # ---- field selection ----------------------------------------------------------------------
    def _check_keys(self, keys: Iterable[str]) -> None:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no field(s) {missing}; fields: {self.keys()}")

    def select(self, *keys: str) -> "Batch":
        """A new Batch with only `keys` (tensors shared, not copied)."""
        self._check_keys(keys)
        tensor_keys = [k for k in keys if k in self.tensors.keys()]
        return Batch(self.tensors.select(*tensor_keys),
                     {k: self.non_tensors[k] for k in keys if k in self.non_tensors}, self.meta)

    def pop(self, *keys: str) -> "Batch":
        """Remove `keys` from this Batch and return them as a new Batch."""
        out = self.select(*keys)
        for key in keys:
            if key in self.non_tensors:
                del self.non_tensors[key]
            else:
                del self.tensors[key]
        return out

    def union(self, other: "Batch") -> "Batch":
        """Fields of both batches (same rows). A key present in both must hold equal values."""
        if len(other) != len(self):
            raise BatchError(f"union of batches with {len(self)} and {len(other)} rows")
        out = Batch(self.tensors.clone(False), dict(self.non_tensors), dict(self.meta))
        for key, value in other.tensors.items():
            if key in out.tensors.keys() and not torch.equal(out.tensors[key], value):
                raise BatchError(f"union: tensor field {key!r} differs between the two batches")
            out.tensors[key] = value
        for key, value in other.non_tensors.items():
            if key in out.non_tensors and not np.array_equal(out.non_tensors[key], value):
                raise BatchError(f"union: non-tensor field {key!r} differs between the two batches")
            out.non_tensors[key] = value
        for key, value in other.meta.items():
            if key in out.meta and not _meta_equal(out.meta[key], value):
                raise BatchError(f"union: meta {key!r} differs ({out.meta[key]!r} vs {value!r})")
            out.meta[key] = value
        return out

    # ---- rows -------------------------------------------------------------------------------
    def index(self, idx) -> "Batch":
        """Rows by int, slice, list/array/tensor of ints, or boolean mask (always returns a Batch)."""
        if isinstance(idx, (int, np.integer)) and not isinstance(idx, bool):
            idx = int(idx)
            idx = slice(idx, idx + 1) if idx != -1 else slice(-1, None)
        if isinstance(idx, slice):
            np_idx = idx
            td_idx = idx
        else:
            np_idx = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
            td_idx = torch.as_tensor(np_idx)
        return Batch(self.tensors[td_idx], {k: v[np_idx] for k, v in self.non_tensors.items()}, self.meta)

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all batches in order; fields must match; meta taken from the first."""
        if not batches:
            raise BatchError("Batch.concat needs at least one batch")
        keys = sorted(batches[0].keys())
        for i, batch in enumerate(batches[1:], 1):
            if sorted(batch.keys()) != keys:
                raise BatchError(f"Batch.concat: batch {i} has fields {sorted(batch.keys())}, batch 0 has {keys}")
        tensors = torch.cat([b.tensors for b in batches], dim=0)
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in batches[0].non_tensors}
        return Batch(tensors, non_tensors, batches[0].meta)

    def split(self, sizes: Sequence[int]) -> list["Batch"]:
        """Consecutive pieces with the given row counts (must sum to len(self))."""
        if any(s < 0 for s in sizes) or sum(sizes) != len(self):
            raise BatchError(f"split sizes {list(sizes)} must be >= 0 and sum to {len(self)}")
        out, start = [], 0
        for size in sizes:
            out.append(self.index(slice(start, start + size)))
            start += size
        return out

    def chunk(self, n: int) -> list["Batch"]:
        """n consecutive pieces in order; sizes differ by at most one (the first ones are larger)."""
        if n < 1:
            raise BatchError(f"chunk count must be >= 1, got {n}")
        base, extra = divmod(len(self), n)
        return self.split([base + (1 if i < extra else 0) for i in range(n)])

    def repeat_interleave(self, n: int) -> "Batch":
        """Each row repeated n times in place (n samples per prompt): rows a,b -> a,a,b,b."""
        if n < 1:
            raise BatchError(f"repeat_interleave needs n >= 1, got {n}")
        index = np.repeat(np.arange(len(self)), n)
        return self.index(index)

    def pad_to_multiple(self, k: int) -> tuple["Batch", int]:
        """Append copies of the first rows until len is a multiple of k; return (batch, pad count)."""
        if k < 1:
            raise BatchError(f"pad_to_multiple needs k >= 1, got {k}")
        pad = (-len(self)) % k
        if pad == 0:
            return self, 0
        if len(self) == 0:
            raise BatchError("cannot pad an empty batch (no row to copy)")
        index = np.concatenate([np.arange(len(self)), np.arange(pad) % len(self)])
        return self.index(index), pad

    def unpad(self, pad: int) -> "Batch":
        """Drop the `pad` rows that pad_to_multiple appended."""
        if pad < 0 or pad > len(self):
            raise BatchError(f"unpad({pad}) on a batch of {len(self)} rows")
        return self if pad == 0 else self.index(slice(0, len(self) - pad))

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.tensors.to(device), self.non_tensors, self.meta)

    # ---- transport ----------------------------------------------------------------------------
    def __reduce__(self):
        wire = {key: _tensor_to_wire(value) for key, value in self.tensors.items()}
        return _batch_from_wire, (wire, len(self), self.non_tensors, self.meta)

    def equals(self, other: "Batch") -> bool:
        """Same fields, same rows, same values (meta included)."""
        if not isinstance(other, Batch) or len(other) != len(self) or sorted(self.keys()) != sorted(other.keys()):
            return False
        for key, value in self.tensors.items():
            theirs = other.tensors[key]
            if value.dtype != theirs.dtype or not torch.equal(value.cpu(), theirs.cpu()):
                return False
        return (all(np.array_equal(v, other.non_tensors[k]) for k, v in self.non_tensors.items())
                and _meta_equal(self.meta, other.meta))


def _batch_from_wire(wire: dict, size: int, non_tensors: dict, meta: dict) -> Batch:
    tensors = _tensordict()({key: _tensor_from_wire(*value) for key, value in wire.items()}, batch_size=[size])
    return Batch(tensors, non_tensors, meta)


def _meta_equal(a: Any, b: Any) -> bool:
    try:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return bool(np.array_equal(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(_meta_equal(a[k], b[k]) for k in a)
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return a is b
