"""Trained roles' state off the GPU while it is not needed (actor.offload, critic.offload).

On a colocated GPU the actor generates next to everything the roles keep resident: fp32 gradient buffers
(4 bytes a parameter of the shard), the distributed optimizer's fp32 main weights and Adam moments (12 bytes a
parameter / dp), the reference, vLLM's copy of the weights and its KV cache. None of the gradients or the
optimizer state is read between two updates, so with `offload.grads` / `offload.optimizer` they live in host
memory from the end of an update to the start of the next (and around checkpoint save / load), leaving the room
to the KV cache; `offload.params` (the actor with vLLM) moves the actor's own weights to the host once they are
pushed into vLLM, until the generation ends.

A move keeps every tensor object and every view of it (Megatron DDP's buckets, the optimizer's shards, a
parameter's main_grad): only the storage under them is emptied and refilled (FSDP-style `resize_`), so nothing
re-wires. Optimizer state and weights go to host memory and back bit-exactly; gradient buffers are only freed
and come back zeroed (each update zeroes them first: copying them would be time spent for nothing).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from hybridrl.parallel.distributed import release_cached_memory

logger = logging.getLogger(__name__)


def _byte_view(storage: torch.UntypedStorage, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,))


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    host: torch.Tensor | None  # None: freed only (restored as zeros)


class HostCopy:
    """The storages under a set of tensors, moved to host memory (copy=True) or freed (copy=False) and restored:
    one storage at a time, each once however many tensors view it."""

    def __init__(self) -> None:
        self._moved: list[_Moved] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self._moved)

    def offload(self, tensors: Iterable[torch.Tensor], copy: bool = True, skip: set[int] = frozenset()) -> int:
        """Move (or free) the storages of `tensors`, except those whose data_ptr is in `skip`; returns the bytes
        given back. Storages already moved by this object are left as they are."""
        seen = {id(m.storage) for m in self._moved} | set(skip)
        pin = torch.cuda.is_available()
        freed = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            nbytes = storage.nbytes()
            host = None
            if copy:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                host.copy_(_byte_view(storage, nbytes, tensor.device))
            storage.resize_(0)
            self._moved.append(_Moved(storage, nbytes, tensor.device, host))
            freed += nbytes
        return freed

    def restore(self) -> int:
        """Give every moved storage its memory and contents back (zeros where it was only freed)."""
        restored = 0
        for moved in self._moved:
            moved.storage.resize_(moved.nbytes)
            raw = _byte_view(moved.storage, moved.nbytes, moved.device)
            if moved.host is None:
                raw.zero_()
            else:
                raw.copy_(moved.host)
            restored += moved.nbytes
        self._moved = []
        return restored


def grad_buffers(ddp: Any) -> list[torch.Tensor]:
    """Megatron DDP's contiguous gradient buffers (every parameter's main_grad views one of them); none for other
    wrappers (the fully sharded one's `buffers` is nn.Module's method, not Megatron's list)."""
    groups = [getattr(ddp, name, None) for name in ("buffers", "expert_parallel_buffers")]
    buffers = [b for group in groups if isinstance(group, (list, tuple)) for b in group]
    return [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's own tensors: its per-parameter state (Adam moments) and its main parameters (the fp32
    copies of a bf16 model; with an fp32 model they view the model's weights, which the caller skips)."""
    out: list[torch.Tensor] = []
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        out += [p for group in inner.param_groups for p in group["params"]]
    return out


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}


class TrainingStateOffload:
    """A trained role's gradients and optimizer state in host memory between its updates.

    `offload()` after an update (and after building / loading); `restore()` before the next update or a
    checkpoint. No-ops for what the settings leave on the device."""

    def __init__(self, ddp: Any, optimizer: Any, grads: bool, optimizer_state: bool) -> None:
        self.ddp, self.optimizer = ddp, optimizer
        self.grads, self.optimizer_state = grads, optimizer_state
        self._copy = HostCopy()

    @property
    def enabled(self) -> bool:
        return self.grads or self.optimizer_state

    @property
    def offloaded(self) -> bool:
        return self._copy.offloaded

    def offload(self) -> int:
        if not self.enabled or self._copy.offloaded:
            return 0
        weights = storage_keys(self.ddp.parameters())  # never the model's own weights (fp32 main params view them)
        freed = 0
        if self.grads:
            freed += self._copy.offload(grad_buffers(self.ddp), copy=False, skip=weights)
        if self.optimizer_state:
            freed += self._copy.offload(optimizer_tensors(self.optimizer), copy=True, skip=weights)
        release_cached_memory()
        logger.debug("offloaded %.1f MiB of gradients / optimizer state to the host", freed / 2**20)
        return freed

    def restore(self) -> int:
        return self._copy.restore()


def check_offload(offload: Any, role: str, engine: str | None = None) -> None:
    """Refuse offload settings a role cannot honour (`offload`: config.OffloadConfig; `engine`: the actor's resolved
    rollout engine). ValueError names the option and the fix; the trainer's plan and the short API both call it."""
    if not (offload.grads or offload.optimizer or offload.params):
        return
    if role not in ("actor", "critic", "cost_critic"):
        raise ValueError(f"{role}.offload: a frozen role has no gradients or optimizer state to offload; unset it")
    if offload.params and role != "actor":
        raise ValueError(f"{role}.offload.params: only the actor's weights wait in host memory (while vLLM "
                         f"generates); unset it")
    if offload.params and engine != "vllm":
        raise ValueError(f"actor.offload.params=true keeps the actor's weights in host memory while vLLM generates "
                         f"from its own copy; with rollout.engine={engine} those weights are what generates: set "
                         f"rollout.engine=vllm or actor.offload.params=false")
