"""Fully sharded data parallel for a role's Megatron model (`parallel.fsdp`), with Megatron-Core's own wrapper.

`parallel.fsdp`:
  no_shard       Megatron DDP and its (distributed) optimizer, exactly as without this option;
  shard_grad_op  gradients and optimizer states sharded over the DP group; the parameters are gathered once per
                 forward and kept until the backward is done (Megatron-LM's --torch-fsdp2-no-reshard-after-forward,
                 "ZeRO-2"); between steps only each rank's shard is resident;
  full_shard     parameters too: each transformer layer's parameters are all-gathered just before its forward
                 and again before its backward, then freed ("ZeRO-3").
A frozen model (reference, reward / cost model) has no gradients or optimizer: full_shard shards its parameters
(gathered layer by layer in each forward, 1/dp resident), shard_grad_op leaves it unsharded like no_shard.

The wrapper is Megatron-Core's `TorchFullyShardedDataParallel` (megatron/core/distributed/
torch_fully_sharded_data_parallel.py: PyTorch FSDP2's `fully_shard` per transformer layer over Megatron's DP
group), with Megatron's own (non-distributed) optimizer over the sharded parameters, as Megatron-LM runs it
(--use-torch-fsdp2). Both Megatron-Core FSDPs run on gloo here (checked on 0.16.1): this one with one shim
(megatron_patches/fsdp_mesh.py: its mesh on the CPU); Megatron-FSDP (`use_megatron_fsdp`,
optim_grads_params) with two (its "cuda:<current_device>" check, and no NCCL pre-multiplied sum). This one is
used because (1) Megatron's distributed checkpoints understand its shards (make_tp_sharded_tensor_for_checkpoint
knows FSDP2's DTensors) and the checkpoint stays in the layout-free format every other layout reads, while
Megatron-FSDP's optimizer saves only its own `fsdp_dtensor` format (DistributedOptimizer.sharded_state_dict
raises NotImplementedError for any other), which no TP layout can resume from; (2) it cuts every TP shard into
equal dim-0 row blocks over the DP group, so the 3D-HybridEngine all-gathers them straight into the generation
buffer (hybrid_engine/fsdp_gather.py). Megatron-LM refuses this wrapper with pipeline or expert parallelism
(arguments.py), so does parallel/layout.py.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from hybridrl.models.builder import unwrap

logger = logging.getLogger(__name__)


def shards_model(fsdp: str, trainable: bool) -> bool:
    """Whether a model is wrapped in the fully sharded wrapper (a frozen one only for full_shard)."""
    return fsdp == "full_shard" or (trainable and fsdp == "shard_grad_op")


def check_sharding(role: str, fsdp: str, lora: Any = None, offload: Any = None) -> None:
    """parallel.fsdp with a trained role's other settings (`lora`: config.LoraConfig, `offload`: config.
    OffloadConfig). ValueError names the options and the fix; the trainer's plan and the short API both call it."""
    if fsdp == "no_shard":
        return
    if lora is not None and lora.enabled:
        raise ValueError(f"{role}.lora with {role}.parallel.fsdp={fsdp}: LoRA's adapters are a small share of the "
                         f"weights and its frozen base is not sharded here; set {role}.parallel.fsdp=no_shard "
                         f"(adapters train under plain data parallel) or drop {role}.lora")
    if offload is not None and (offload.grads or offload.optimizer):
        raise ValueError(f"{role}.offload (grads / optimizer) with {role}.parallel.fsdp={fsdp}: the offload moves "
                         f"Megatron DDP's gradient buffers and optimizer, which the fully sharded wrapper does not "
                         f"have (its shards are 1/dp already); set {role}.parallel.fsdp=no_shard or turn the offload "
                         f"off")


def fully_sharded(config: Any, module: torch.nn.Module, fsdp: str) -> torch.nn.Module:
    """`module` (a GPTModel, or Float16Module around one) wrapped in Megatron-Core's FSDP2 wrapper over the DP
    group: each transformer layer (and the embedding, unless it is tied to the output layer, which uses it after
    the embedding's own unit would have released it) is one unit, the rest belongs to the root unit."""
    from megatron.core.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if config.num_moe_experts:
        raise ValueError(f"parallel.fsdp={fsdp} with a mixture-of-experts model: Megatron's fully sharded wrapper runs "
                         f"without expert parallelism (Megatron-LM refuses it); use parallel.fsdp=no_shard")
    units: set[type] = {TransformerLayer, RotaryEmbedding}
    if not unwrap(module).share_embeddings_and_output_weights:
        units.add(LanguageModelEmbedding)
    ddp_config = TorchFullyShardedDataParallelConfig(reshard_after_forward=fsdp == "full_shard")

    class FullyShardedModel(TorchFullyShardedDataParallel):
        def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
            # megatron-core 0.16's finalize_model_grads passes force_all_reduce=, which the wrapper's base method
            # does not take (TypeError on GPU and CPU alike); FSDP2 has already reduce-scattered the gradients
            super().finish_grad_sync()

    return FullyShardedModel(config, ddp_config, module, sub_modules_to_wrap=units)


def is_sharded(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded parameter (the tensor itself when it is not sharded)."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def release_gathered(model: torch.nn.Module) -> None:
    """Back to the shards only: FSDP2 keeps shard_grad_op's parameters gathered after a forward until a backward
    frees them, and a forward-only pass (log-probs, values, scores) has none. A no-op for other models."""
    for module in fsdp_modules(model):
        module.reshard()


@contextlib.contextmanager
def whole_parameters(model: Any, gather: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Inside: the model's modules hold plain whole-TP-shard parameters (with Megatron's TP attributes) in place of
    their FSDP2 shards, so Megatron's sharded_state_dict describes them exactly as at no_shard (FSDP2 resharding in
    its state-dict hooks is a no-op on an already sharded model). gather: fill them (all-gather over the DP group);
    else they are empty, for a load. Yields name -> whole tensor; the shards are put back on exit."""
    inner = unwrap(model)
    release_gathered(model)  # shards only: the swap below replaces them
    swapped = []
    for prefix, module in inner.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or not hasattr(param, "full_tensor"):
                continue
            data = param.full_tensor() if gather else torch.empty(param.shape, dtype=param.dtype,
                                                                  device=local_tensor(param).device)
            whole = torch.nn.Parameter(data.detach(), requires_grad=param.requires_grad)
            for key, value in vars(param).items():
                if not key.startswith("_"):  # partition_dim, tensor_model_parallel, ...
                    setattr(whole, key, value)
            module._parameters[name] = whole
            swapped.append((module, name, param, f"{prefix}.{name}" if prefix else name))
    try:
        yield {full: module._parameters[name] for module, name, _, full in swapped}
    finally:
        for module, name, param, _ in swapped:
            module._parameters[name] = param


def gathered_parameters(model: torch.nn.Module):
    """Inside: every parameter is its whole TP shard again (all-gathered over the DP group; freed on exit), for
    readers of the weights (export). A no-op for a model that is not sharded."""
    return whole_parameters(model, gather=True)


def resident_bytes(*roots: Any) -> int:
    """Bytes of every tensor storage reachable from `roots` (a model and its optimizer: parameters, gradients,
    Megatron's buffers, optimizer states), each storage once; a sharded tensor counts its local piece. What a rank
    holds between steps, for measurements (benchmarks/fsdp_memory.py)."""
    import types

    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or isinstance(obj, (str, bytes, int, float, bool, type, types.ModuleType,
                                                      types.FunctionType, types.BuiltinFunctionType)):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = local_tensor(obj)
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
            stack += [getattr(obj, name, None) for name in ("grad", "main_grad")]
            stack.append(getattr(obj, "__dict__", {}))
        elif isinstance(obj, dict):
            stack += list(obj.values()) + [k for k in obj if isinstance(k, torch.Tensor)]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        elif hasattr(obj, "__dict__"):
            stack.append(vars(obj))
    storages.pop(0, None)  # freed (resized to 0) storages
    return sum(storages.values())
