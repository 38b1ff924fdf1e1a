"""LoRA adapters between Megatron shards (models/lora.py) and whole tensors by Hugging Face module (peft's layout).

- `hf_module_names(model)`: the namer attach_lora uses, from the family's conversion table (the fused QKV's parts
  are q_proj, k_proj, v_proj, fc1's gate_proj, up_proj, an expert's its own);
- `load_adapter_factors(model, adapter)`: each rank reads only its slice of every factor from a PEFT adapter
  (lora.init, a checkpoint's adapter);
- `gather_adapter_factors(model)` / `save_adapter_folder(...)`: whole factors on global rank 0 (TP pieces
  all-gathered, then the pipeline stages' and expert blocks' sent to rank 0), written as a PEFT adapter folder.
A part's factor is split over TP in plain chunks (rows of a column-parallel B, columns of a row-parallel A), so
no regrouping is needed: the same full tensors at every layout.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from hybridrl.models.builder import global_param_name, unwrap
from hybridrl.models.config import CheckpointError
from hybridrl.models.families import expert_number
from hybridrl.models.hub import ModelReferenceError, resolve_model
from hybridrl.config import LORA_INITS, LoraConfig
from hybridrl.models.lora import LoraAdapter, adapters_of, attach_lora, lora_linears, resolve_targets
from hybridrl.models.peft import PeftAdapter, read_peft_adapter, write_peft_adapter

HEAD = ("output_layer.weight", "score.weight")  # a trained value / score head: modules_to_save
ADAPTER_DIR = "adapter"  # a LoRA role's checkpoint: its adapters as a PEFT folder (the base is referenced)


def hf_module_names(model: Any) -> Callable[[str, str], list[str]]:
    """(local module name, kind) -> the HF module names of the linear's parts (global layer / expert numbers)."""
    inner = unwrap(model)
    family, head = inner.hybridrl_family, inner.hybridrl_head

    def names(module_name: str, kind: str) -> list[str]:
        rule = family.rule(global_param_name(inner, f"{module_name}.weight"), head, False)
        return [name[:-len(".weight")] for name in rule.hf_names]

    return names


@torch.no_grad()
def load_adapter_factors(model: Any, source: PeftAdapter) -> None:
    """Fill this rank's adapter shards from a PEFT adapter (rank and targets must match the model's)."""
    for adapter in adapters_of(unwrap(model)):
        if source.rank != adapter.rank:
            raise CheckpointError(f"{source.folder}: rank {source.rank}, the model's adapters have rank {adapter.rank}")
        for part, module in adapter.hf_modules.items():
            if module not in source.modules:
                raise CheckpointError(f"{source.folder}: no adapter for {module} (targeted by lora.target_modules)")
            for factor in ("A", "B"):
                local = adapter.local_factor(part, factor)
                dim = adapter.split_dim(factor)
                span = (adapter.tp_rank * local.shape[dim], (adapter.tp_rank + 1) * local.shape[dim]) \
                    if dim is not None else None
                piece = source.factor(module, factor, rows=span if dim == 0 else None,
                                      cols=span if dim == 1 else None)
                if factor == "B" and adapter.vocab_rows is not None and piece.shape[0] < local.shape[0]:
                    piece = torch.cat([piece, piece.new_zeros(local.shape[0] - piece.shape[0], piece.shape[1])])
                if tuple(piece.shape) != tuple(local.shape):
                    raise CheckpointError(f"{source.folder}: {module}.lora_{factor} piece {list(piece.shape)} does "
                                          f"not fit the model's {list(local.shape)}")
                local.copy_(piece.to(local.dtype))


def _full(adapter: LoraAdapter, part: str, factor: str) -> torch.Tensor:
    local = adapter.local_factor(part, factor).detach()
    dim = adapter.split_dim(factor)
    if dim is not None:
        pieces = [torch.empty_like(local) for _ in range(adapter.tp_size)]
        torch.distributed.all_gather(pieces, local.contiguous(), group=adapter.tp_group)
        local = torch.cat(pieces, dim=dim)
    if factor == "B" and adapter.vocab_rows is not None:  # Megatron's padded vocabulary rows dropped
        local = local[:adapter.vocab_rows]
    return local


@torch.no_grad()
def gather_adapter_factors(model: Any) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict] | None:
    """({HF module: (A, B)}, {saved head tensors}) on global rank 0, None elsewhere; collective over all ranks.
    Each factor comes from one place: data-parallel replica 0 (experts: expert-data-parallel replica 0), TP rank 0
    of the linear's group."""
    from megatron.core import parallel_state as ps

    inner = unwrap(model)
    gathers = {False: ps.get_data_parallel_rank() == 0, True: ps.get_expert_data_parallel_rank() == 0}
    local: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, linear in _named_lora_linears(inner):
        adapter = linear.lora
        if not gathers[expert_number(global_param_name(inner, name + ".weight")) is not None]:
            continue
        for part, module in adapter.hf_modules.items():
            a, b = _full(adapter, part, "A"), _full(adapter, part, "B")
            if adapter.tp_rank == 0:
                local[module] = (a.cpu().clone(), b.cpu().clone())
    saved = {}
    head = dict(inner.named_parameters()).get(HEAD[0])
    if inner.hybridrl_head == "scalar" and head is not None and head.requires_grad and gathers[False] \
            and ps.get_tensor_model_parallel_rank() == 0:
        saved[HEAD[1]] = head.detach().cpu().clone()
    rank = torch.distributed.get_rank()
    parts = [None] * torch.distributed.get_world_size() if rank == 0 else None
    torch.distributed.gather_object((local, saved), parts, dst=0)
    if rank != 0:
        return None
    factors, heads = {}, {}
    for got, head_tensors in parts:
        factors.update(got)
        heads.update(head_tensors)
    return factors, heads


def _named_lora_linears(inner: Any):
    wanted = set(map(id, lora_linears(inner)))
    return [(name, module) for name, module in inner.named_modules() if id(module) in wanted]


def save_adapter_folder(model: Any, out_dir: str | Path, *, base: str | None, dropout: float = 0.0) -> None:
    """Collective: the model's adapters (and a trained head) as a PEFT adapter folder written by rank 0."""
    inner = unwrap(model)
    adapters = adapters_of(inner)
    gathered = gather_adapter_factors(inner)
    if gathered is not None:
        factors, heads = gathered
        first = adapters[0]
        task = "SEQ_CLS" if inner.hybridrl_head == "scalar" else "CAUSAL_LM"
        write_peft_adapter(out_dir, factors, rank=first.rank, alpha=first.scaling * first.rank, base=base,
                           dropout=dropout, task_type=task, saved=heads)
    torch.distributed.barrier()


@torch.no_grad()
def load_saved_head(model: Any, source: PeftAdapter) -> None:
    """A trained value / score head from the adapter's modules_to_save (critic resume)."""
    inner = unwrap(model)
    head = dict(inner.named_parameters()).get(HEAD[0])
    if head is not None and inner.hybridrl_head == "scalar" and HEAD[1] in source.saved:
        head.copy_(source.saved_tensor(HEAD[1]).to(head.dtype))



def add_adapters(model: Any, cfg: LoraConfig, *, seed: int) -> list[LoraAdapter]:
    """A LoRA role's model: adapters on the targeted linears, the rest frozen (a scalar head stays trainable: the
    critic's value head), initialised by cfg.init: kaiming / gaussian, or a PEFT adapter folder's factors."""
    inner = unwrap(model)
    cfg = resolve_lora_config(cfg)
    trainable = (HEAD[0],) if inner.hybridrl_head == "scalar" else ()
    adapters = attach_lora(inner, cfg, hf_modules_of=hf_module_names(inner), seed=seed, trainable=trainable)
    if cfg.init not in LORA_INITS:
        load_adapter_folder(inner, cfg.init)
    return adapters


PROJECTION_OF_PART = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                      "down": "down_proj", "lm_head": "lm_head"}


def resolve_lora_config(cfg: LoraConfig) -> LoraConfig:
    """The settings a worker builds with: rank, alpha and targets filled in (from lora.init when it is a PEFT
    adapter folder or hub id, which must agree with any given; init becomes the local folder, so workers never
    touch the hub). ValueError names the option."""
    if cfg.init in LORA_INITS:
        resolve_targets(cfg.target_modules)
        if cfg.rank < 0:
            raise ValueError(f"lora.rank={cfg.rank} must be >= 0 (0: LoRA off)")
        return replace(cfg, alpha=float(cfg.alpha if cfg.alpha is not None else cfg.rank),
                       target_modules=list(cfg.target_modules or ["all"]))
    try:  # a folder or a hub id org/name[@revision] (fetched into the HF cache here, on the driver)
        folder = resolve_model(cfg.init, "lora.init")
        source = read_peft_adapter(folder)
    except ModelReferenceError as exc:
        raise ValueError(str(exc)) from None
    except CheckpointError as exc:
        raise ValueError(f"lora.init={cfg.init!r}: {exc}") from None
    if cfg.rank not in (0, source.rank):
        raise ValueError(f"lora.rank={cfg.rank} but the adapter in lora.init has rank {source.rank}: leave lora.rank "
                         f"unset (0) or match it")
    if cfg.alpha is not None and float(cfg.alpha) != source.alpha:
        raise ValueError(f"lora.alpha={cfg.alpha} but the adapter in lora.init has lora_alpha {source.alpha}: leave it "
                         f"unset or match it")
    if source.scaling != source.alpha / source.rank:
        raise ValueError(f"lora.init={cfg.init!r} uses rsLoRA scaling, which training does not support yet")
    targets = sorted(PROJECTION_OF_PART[p] for p in source.parts)
    if cfg.target_modules is not None and resolve_targets(cfg.target_modules) != source.parts:
        raise ValueError(f"lora.target_modules={list(cfg.target_modules)} but the adapter in lora.init adapts "
                         f"{targets}: leave it unset or match it")
    return replace(cfg, rank=source.rank, alpha=source.alpha, target_modules=targets, init=str(folder))


def load_adapter_folder(model: Any, folder: str | Path) -> None:
    """Collective-free: this rank's adapter shards (and a trained head) from a PEFT adapter folder."""
    source = read_peft_adapter(folder)
    load_adapter_factors(model, source)
    load_saved_head(model, source)


def adapter_factors_everywhere(model: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every whole factor on every rank (collective: gathered to rank 0, then broadcast)."""
    gathered = gather_adapter_factors(model)
    box = [None if gathered is None else gathered[0]]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
