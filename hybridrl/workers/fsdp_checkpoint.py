"""Checkpoints of a fully sharded model (`parallel.fsdp`) in the layout-free format every layout reads.

A no_shard run writes the model as Megatron's distributed checkpoint of its TP shards and the distributed
optimizer's state in model space ("fully_reshardable": `optimizer.state.{param,exp_avg,...}.<model key>` shaped
like the parameter, plus `optimizer.param_groups` with the step). A fully sharded run writes exactly that too, so
a run saved at fsdp resumes at any TP layout (no_shard) and the other way round:
  - save: each parameter and optimizer-state piece is all-gathered over the DP group into its whole TP shard
    (transiently, as the distributed optimizer's own fully_reshardable save gathers its shards), and written under
    the same keys with the same metadata (replica ids: DP rank 0 writes);
  - load: the whole TP shards are read by key (Megatron reshards from any saved layout), and each rank keeps its
    rows of them (FSDP2's dim-0 split) in its parameters and its optimizer's state.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hybridrl.models.builder import unwrap
from hybridrl.models.config import CheckpointError
from hybridrl.models.dist_ckpt import read_dist_checkpoint_info, save_dist_checkpoint
from hybridrl.parallel.distributed import fsdp_row_slice
from hybridrl.workers.sharding import local_tensor, whole_parameters

FORMAT = "fully_reshardable"  # the distributed optimizer's sharding type this module writes and reads
PREFIX = "optimizer.state"


def _rows(param: Any) -> slice:
    first, rows = fsdp_row_slice(param)
    return slice(first, first + rows)


def _optimizers(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(optimizer: Any) -> dict[int, Any]:
    """id(model parameter) -> the fp32 parameter the optimizer steps (itself in fp32; its fp32 copy in bf16)."""
    out = {}
    for opt in _optimizers(optimizer):
        if hasattr(opt, "float16_groups"):
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                out.update({id(p): m for p, m in zip(model_group, main_group)})
            for group in getattr(opt, "fp32_from_fp32_groups", []):
                out.update({id(p): p for p in group})
        else:
            out.update({id(p): p for group in opt.optimizer.param_groups for p in group["params"]})
    return out


def _inner(optimizer: Any, main: Any) -> torch.optim.Optimizer:
    for opt in _optimizers(optimizer):
        if any(p is main for group in opt.optimizer.param_groups for p in group["params"]):
            return opt.optimizer
    raise KeyError("parameter not stepped by the optimizer")


def _model_keys(model: Any) -> dict[str, Any]:
    """Parameter name -> its ShardedTensor (or factory) in the model's sharded state dict; call with the
    parameters gathered (whole TP shards)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    inner = unwrap(model)
    by_tensor = {id(sh.data): sh for sh in nested_values(extract_sharded_tensors_and_factories(
        inner.sharded_state_dict())[0])}
    return {name: by_tensor[id(param)] for name, param in inner.named_parameters() if id(param) in by_tensor}


def _param_groups(optimizer: Any, step: float) -> list[dict]:
    """The optimizer's param_groups as the distributed optimizer saves them (no params; the common step)."""
    groups = []
    for opt in _optimizers(optimizer):
        for group in opt.optimizer.state_dict()["param_groups"]:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "step": step})
    return groups


def _step(optimizer: Any) -> float:
    steps = {float(state["step"]) for opt in _optimizers(optimizer) for state in opt.optimizer.state.values()
             if "step" in state}
    if len(steps) > 1:
        raise CheckpointError(f"optimizer steps differ between parameters: {sorted(steps)}")
    return steps.pop() if steps else 0.0


def _state_keys(inner: torch.optim.Optimizer, main: Any) -> list[str]:
    """The per-parameter state tensors the optimizer keeps (Adam's before its first step too)."""
    keys = [k for k, v in inner.state.get(main, {}).items() if k != "step" and isinstance(v, torch.Tensor)]
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        keys = list(dict.fromkeys(["exp_avg", "exp_avg_sq"] + keys))
    return keys


def _whole(tensor: Any) -> torch.Tensor:
    """A sharded tensor's whole TP shard (DTensor.full_tensor(): an all-gather over the DP group)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


def optimizer_state(model: Any, optimizer: Any, is_loading: bool) -> tuple[dict, list[str]]:
    """(the sharded state dict in the distributed optimizer's fully_reshardable layout, the parameter names in
    its param_state order). Saving: whole TP-shard tensors of the gathered values (collective over the DP group);
    loading: empty ones for the load."""
    sharded = dict(unwrap(model).named_parameters())
    main = _main_params(optimizer)
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in sharded.items():
        fp32 = main[id(param)]
        inner = _inner(optimizer, fp32)
        state = inner.state.get(fp32, {})
        keys = ["param"] + _state_keys(inner, fp32)
        if is_loading:
            whole[name] = {k: torch.empty(param.shape, dtype=fp32.dtype, device=local_tensor(fp32).device)
                           for k in keys}
        else:  # never stepped: Adam's zeros, as the distributed optimizer saves them
            whole[name] = {k: _whole(fp32 if k == "param" else state[k]) if k == "param" or k in state
                           else torch.zeros(param.shape, dtype=fp32.dtype, device=local_tensor(fp32).device)
                           for k in keys}
    with whole_parameters(model, gather=False):
        keys = _model_keys(model)
    param_state = {i: {k: replace(keys[name], key=f"{PREFIX}.{k}.{keys[name].key}", data=t,
                                  **({} if hasattr(keys[name], "build_fn") else {"dtype": t.dtype}))
                       for k, t in tensors.items()}
                   for i, (name, tensors) in enumerate(whole.items())}
    state_dict = {"optimizer": {"param_groups": _param_groups(optimizer, _step(optimizer))},
                  "param_state": param_state, "param_state_sharding_type": FORMAT}
    return state_dict, list(whole)


def save_model(model: Any, hf_config: Any, out_dir: Path) -> None:
    """The weights as whole TP shards (the format of save_dist_checkpoint at any layout)."""
    with whole_parameters(model, gather=True):
        save_dist_checkpoint(model, hf_config, out_dir)


@torch.no_grad()
def load_model(model: Any, ckpt_dir: Path) -> None:
    """Read whole TP shards from a checkpoint of any layout; keep this rank's rows of each."""
    from megatron.core import dist_checkpointing

    read_dist_checkpoint_info(ckpt_dir)
    sharded = dict(unwrap(model).named_parameters())
    with whole_parameters(model, gather=False):
        try:
            state = dist_checkpointing.load(unwrap(model).sharded_state_dict(), str(ckpt_dir))
        except Exception as exc:  # dist_checkpointing raises several types for missing/mismatched shards
            raise CheckpointError(f"{ckpt_dir}: loading the Megatron checkpoint failed: {exc}") from exc
    for name, param in sharded.items():
        local_tensor(param).copy_(state[name][_rows(param)])


@torch.no_grad()
def set_optimizer_state(model: Any, optimizer: Any, loaded: dict, names: list[str]) -> None:
    """Keep this rank's rows of the loaded whole tensors (`loaded`: optimizer_state's dict as the load returned
    it) in the optimizer's state and fp32 parameters, and the step of its param_groups."""
    steps = {g.get("step") for g in loaded["optimizer"]["param_groups"]} - {None}
    if len(steps) > 1:
        raise CheckpointError(f"the checkpoint's optimizer param_groups have different steps {sorted(steps)}")
    step = float(steps.pop()) if steps else 0.0
    sharded = dict(unwrap(model).named_parameters())
    main = _main_params(optimizer)
    for i, name in enumerate(names):
        fp32 = main[id(sharded[name])]
        inner = _inner(optimizer, fp32)
        state = inner.state[fp32]
        rows = _rows(sharded[name])
        for key, value in loaded["param_state"][i].items():
            if key != "param" and key not in state:
                state[key] = torch.zeros_like(fp32)
            local_tensor(fp32 if key == "param" else state[key]).copy_(value[rows])
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            state["step"] = torch.tensor(step)
