"""Adapter-only weight sync to a rollout pool of its own (LoRA actors; the full sync is hybrid_engine/bridge.py).

The base weights are frozen, so a rollout replica loads them once (from the actor's model folder) and keeps them;
after each update only the adapters move. The actor's training ranks gather every factor whole (models/lora_io.py:
TP pieces all-gathered, pipeline stages and expert blocks sent to training rank 0), and training rank 0 sends one
packed message of all factors, in a fixed order (`AdapterSpec`), to every rollout rank over the bridge. Each
rollout rank slices its own generation TP pieces out of it (lora_io.load_adapter_factors) and generates with the
adapters in its forward (rollout/fast_decode.py), the base untouched. Bytes per sync per rollout rank: the
adapters' (about rank x (in + out) per adapted projection, ~0.3% of a 70B model at r = 16), against the
generation shard a full sync sends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.hybrid_engine.bridge import Bridge
from hybridrl.hybrid_engine.model_shapes import model_shapes
from hybridrl.models.lora import adapter_numel


@dataclass(frozen=True)
class AdapterSpec:
    """The packed message's layout: (HF module, A shape, B shape) in order, and the dtype."""
    entries: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> "AdapterSpec":
        modules = sorted(factors)
        dtype = factors[modules[0]][0].dtype
        return cls(tuple((m, tuple(factors[m][0].shape), tuple(factors[m][1].shape)) for m in modules), dtype)

    @property
    def numel(self) -> int:
        return sum(torch.Size(a).numel() + torch.Size(b).numel() for _, a, b in self.entries)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


def pack(factors: dict[str, tuple[torch.Tensor, torch.Tensor]], spec: AdapterSpec,
         device: torch.device) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=spec.dtype)
                      for module, _, _ in spec.entries for t in factors[module]])


def unpack(flat: torch.Tensor, spec: AdapterSpec) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out, offset = {}, 0
    for module, a_shape, b_shape in spec.entries:
        a_numel, b_numel = torch.Size(a_shape).numel(), torch.Size(b_shape).numel()
        a = flat[offset:offset + a_numel].view(a_shape)
        b = flat[offset + a_numel:offset + a_numel + b_numel].view(b_shape)
        out[module] = (a, b)
        offset += a_numel + b_numel
    return out


def send_adapters(bridge: Bridge, flat: torch.Tensor, receivers: list[int]) -> list:
    """Training bridge rank 0: the packed adapters to every rollout rank (bridge ranks); the works in flight."""
    return [bridge.pg.send([flat], receiver, 0) for receiver in receivers]


class PendingAdapterReceive:
    """One sync's adapters, posted on a rollout rank; `assemble()` waits and returns ({module: (A, B)}, bytes)."""

    def __init__(self, spec: AdapterSpec, bridge: Bridge) -> None:
        self.spec = spec
        self.buffer = torch.empty(spec.numel, dtype=spec.dtype, device=bridge.device)
        self.work = bridge.pg.recv([self.buffer], 0, 0)

    def assemble(self) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int]:
        self.work.wait()
        return unpack(self.buffer, self.spec), self.spec.nbytes


class FactorSource:
    """Whole factors by HF module as lora_io.load_adapter_factors reads them (a PEFT folder's interface)."""

    def __init__(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, folder: str = "sync") -> None:
        self.factors, self.rank, self.folder = factors, rank, folder
        self.modules = set(factors)

    def factor(self, module: str, which: str, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> torch.Tensor:
        tensor = self.factors[module][0 if which == "A" else 1]
        if rows is not None:
            return tensor[rows[0]:rows[1]]
        return tensor[:, cols[0]:cols[1]] if cols is not None else tensor


def lora_plan_report(model: str, rank: int, targets: list[str] | None, train: Any, gen: Any, dtype_bytes: int) -> dict:
    """What LoRA changes in `hybridrl plan`'s accounting (a preset or HF folder; real shapes on the meta device):
    the adapters' size, the bytes a rollout rank receives per sync (adapters only, against its generation shard
    in a full sync), the frozen base shard a training rank keeps aside while generating with merged weights, and
    the reference: the actor with its adapters off (no second copy of the weights)."""
    shapes = model_shapes(model)
    named = [(s.name, s.shape) for s in shapes.params]
    adapters = adapter_numel(named, rank, targets)
    targeted = sum(torch.Size(shape).numel() for name, shape in named
                   if adapter_numel([(name, shape)], 1, targets))  # the weights W + BA is merged into
    return {"rank": rank, "targets": list(targets or ["all"]), "adapter_params": adapters,
            "adapter_bytes": adapters * dtype_bytes, "adapter_share": adapters / shapes.numel,
            "sync_bytes_per_rollout_rank": adapters * dtype_bytes,
            "full_sync_bytes_per_rollout_rank": shapes.numel * dtype_bytes // (gen.tp * gen.pp),
            "merge_kept_bytes_per_gpu": targeted * dtype_bytes // (train.tp * train.pp),
            "reference": "the actor with its adapters off (no reference model)",
            "trained_bytes_per_gpu": f"adapters only: grads + optimizer x {adapters / shapes.numel:.4f} of full"}
