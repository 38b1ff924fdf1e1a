"""Glue between Megatron GPT models (hybridrl.models) and the model-agnostic reshard.

- training_params: a training-layout model's parameters as ShardedParams (global names, Megatron's own
  partition attributes, the gated-fc1 regroup rule);
- generation_pg_collection: the process groups a generation-layout GPTModel is built with (strided
  generation TP groups, generation PP groups; context parallel of size 1);
- attach_generation_weights / detach_generation_weights: point a generation-layout model's parameters at the
  reshard's tensors (views of the generation buffer: no copy) and drop them again, so the model holds no
  parameter memory outside the transition;
- load_generation_weights: copy the reshard's tensors into a generation-layout model (for models that keep
  their own storage).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridrl.hybrid_engine.model_shapes import CONCAT, GATED_HALVES
from hybridrl.hybrid_engine.reshard import ShardedParam, new_group_of
from hybridrl.models.builder import build_gpt_model, named_global_parameters, unwrap
from hybridrl.models.families import is_gated_fc1, tp_partition_dim
from hybridrl.parallel.generation import GenerationGroups
from hybridrl.parallel.distributed import fsdp_row_slice

logger = logging.getLogger(__name__)


def training_params(model: Any, stage: int) -> list[ShardedParam]:
    """This rank's training shards of a (possibly wrapped) Megatron GPT model on pipeline stage `stage`. Under
    fully sharded data parallel each is this rank's rows of the TP shard (its `dp_slice` says which)."""
    out = []
    for name, param in named_global_parameters(model):
        dim = tp_partition_dim(param)
        regroup = GATED_HALVES if dim is not None and is_gated_fc1(name) else CONCAT
        if isinstance(param, DTensor):
            out.append(ShardedParam(name, param.to_local(), dim, stage, regroup, _dp_slice(name, param)))
            continue
        # the Parameter itself, not .data: a wrapper (Megatron DDP) that later moves its storage is followed
        out.append(ShardedParam(name, param, dim, stage, regroup))
    return out


def _dp_slice(name: str, param: DTensor) -> tuple[int, tuple[int, ...]]:
    """(first row, TP-shard shape) of this rank's piece of an FSDP2 parameter."""
    try:
        return fsdp_row_slice(param)[0], tuple(param.shape)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _this_ranks_group(member_lists: list[list[int]], rank: int):
    return new_group_of(rank, member_lists)[1]


def generation_pg_collection(groups: GenerationGroups):
    """ProcessGroupCollection for this rank's generation-layout model (collective over all ranks): strided
    generation TP groups, generation PP groups (p_g stages; the rollout engines use p_g = 1), no context
    parallelism. No embedding group: tied embeddings are filled by the reshard on every stage that holds them.
    Mixture-of-experts layers: the experts are TP-split like the dense MLPs; with e_g > 1 each rank holds one
    generation expert block and the generation expert-parallel group dispatches tokens between them."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank = dist.get_rank()
    tp = _this_ranks_group(groups.gen_tp_groups(), rank)
    single = _this_ranks_group([[r] for r in range(groups.train.world_size)], rank)
    if groups.gen.pp == 1:
        pp, mp = single, tp
    else:
        pp = _this_ranks_group(groups.gen_pp_groups(), rank)
        # model-parallel group: the generation TP groups of one replica's stages together
        pp_of = {r: g for g in groups.gen_pp_groups() for r in g}
        mp_lists = sorted({tuple(sorted(r2 for r in g for r2 in pp_of[r])) for g in groups.gen_tp_groups()})
        mp = _this_ranks_group([list(m) for m in mp_lists], rank)
    dp = _this_ranks_group(groups.gen_dp_groups(), rank)
    pgs = ProcessGroupCollection()
    pgs.tp, pgs.pp, pgs.cp, pgs.mp, pgs.tp_cp = tp, pp, single, mp, tp
    pgs.dp, pgs.dp_cp = dp, dp
    pgs.ep, pgs.expt_tp, pgs.tp_ep, pgs.tp_ep_pp, pgs.expt_dp = single, tp, tp, mp, dp
    if groups.gen.ep > 1:  # p_g = 1 here (checked by the engine): the model-parallel group is the TP group
        pgs.ep = _this_ranks_group(groups.gen_ep_groups(), rank)
        pgs.tp_ep = pgs.tp_ep_pp = _this_ranks_group(groups.gen_tp_ep_groups(), rank)
        pgs.expt_dp = single  # generation computes no gradients
    pgs.tp_dp_cp = dist.group.WORLD  # only the load-balancing loss reduces over it: never at generation
    pgs.embd, pgs.pos_embd = None, None  # weights come from the reshard: no embedding sync across stages
    return pgs


@torch.no_grad()
def load_generation_weights(gen_model: Any, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Copy resharded tensors into a generation-layout model; returns the names it did not use (e.g. the
    last stage's copy of tied embeddings). A model parameter without a tensor is an error."""
    used = set()
    for name, param in named_global_parameters(gen_model):
        if name not in tensors:
            raise KeyError(f"the reshard produced no tensor for generation parameter {name}")
        src = tensors[name]
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"{name}: resharded shape {list(src.shape)} != generation model {list(param.shape)}")
        param.copy_(src)
        used.add(name)
    unused = sorted(set(tensors) - used)
    if unused:
        logger.debug("generation model did not use %s", unused)
    return unused


def generation_parameter_shapes(gen_model: Any) -> dict[str, tuple[int, ...]]:
    """Global name -> shape of every parameter of a generation-layout model (read before detaching)."""
    return {name: tuple(param.shape) for name, param in named_global_parameters(gen_model)}


@torch.no_grad()
def attach_generation_weights(gen_model: Any, tensors: dict[str, torch.Tensor],
                              shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Make each parameter of `gen_model` view its resharded tensor (`shapes`: the model's parameter shapes,
    from generation_parameter_shapes). Non-contiguous tensors (baselines' slices) are made contiguous.
    Returns the names the model did not use; a model parameter without a tensor is an error."""
    used = set()
    for name, param in named_global_parameters(gen_model):
        if name not in tensors:
            raise KeyError(f"the reshard produced no tensor for generation parameter {name}")
        src = tensors[name]
        if tuple(src.shape) != shapes[name]:
            raise ValueError(f"{name}: resharded shape {list(src.shape)} != generation model {list(shapes[name])}")
        param.data = src if src.is_contiguous() else src.contiguous()
        used.add(name)
    return sorted(set(tensors) - used)


@torch.no_grad()
def detach_generation_weights(gen_model: Any, device: torch.device | None = None) -> None:
    """Drop every parameter's storage (shapes become [0]) so the model holds no parameter memory. A model built on
    the meta device (build_generation_model) gets real, empty parameters on `device` here (Megatron's partition
    attributes kept), and its meta buffers real zeros there."""
    fresh: dict[int, torch.nn.Parameter] = {}  # a parameter registered twice stays one object
    for module in unwrap(gen_model).modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if param.device.type != "meta":  # (TE layers allocate on the host when built for CPU initialisation)
                param.data = torch.empty(0, dtype=param.dtype, device=device or param.device)
                continue
            if id(param) not in fresh:
                real = torch.nn.Parameter(torch.empty(0, dtype=param.dtype, device=device),
                                          requires_grad=param.requires_grad)
                real.__dict__.update(param.__dict__)
                fresh[id(param)] = real
            module._parameters[name] = fresh[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)


def build_generation_model(hf_config: Any, pg_collection: Any, dtype: torch.dtype, padded_vocab_size: int,
                           device: torch.device, local_spec: bool = False) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """The generation-layout model WITHOUT allocating its weights: built on the meta device (no initialisation),
    then given empty parameters on `device` (the reshard fills them on every transition). Returns the model and
    its parameter shapes. Built with real random weights it would take the whole generation shard of memory (and
    the time to initialise it) once, and leave that much in torch's allocator cache on a GPU. local_spec: the
    training model's layers are Megatron's local ones (LoRA beside Transformer Engine): the same here, so every
    parameter name matches."""
    with torch.device("meta"):
        gen_model = build_gpt_model(hf_config, pg_collection=pg_collection, dtype=dtype,
                                    padded_vocab_size=padded_vocab_size, use_cpu_initialization=True,
                                    perform_initialization=False, local_spec=local_spec)
    gen_model.eval()
    shapes = generation_parameter_shapes(gen_model)
    detach_generation_weights(gen_model, device)
    return gen_model, shapes
