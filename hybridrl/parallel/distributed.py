"""Process-group and Megatron parallel-state setup; the one place that picks device and backend."""
from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch

import megatron_patches
from hybridrl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)


# Set in every GPU worker before CUDA starts (a user's own value wins). Megatron's TP linears overlap their
# all-reduce with the weight-gradient GEMM and rely on CUDA running kernels in launch order, which one hardware
# queue guarantees (it warns "recommended to set CUDA_DEVICE_MAX_CONNECTIONS" otherwise).
GPU_ENVIRONMENT = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def use_cuda() -> bool:
    return torch.cuda.is_available()


def backend() -> str:
    return "nccl" if use_cuda() else "gloo"


def device() -> torch.device:
    """This process's compute device: its local GPU, else the CPU."""
    if use_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_device_index(local_rank: int, visible_devices: str | None, assigned: list[str] | None = None) -> int:
    """The index of this worker's own GPU among the GPUs the process sees (what torch.cuda.set_device and vLLM's
    LOCAL_RANK want; vLLM asserts LOCAL_RANK < device_count()).

    local_rank: the worker's slot on its node (0..7); visible_devices: CUDA_VISIBLE_DEVICES (None: every GPU of
    the node is visible); assigned: the GPU ids Ray gave this worker (ray.get_gpu_ids(); Ray then shows each
    worker its own GPU only, so the slot is NOT the index: slot 5 sees one GPU, index 0)."""
    visible = None if visible_devices is None else [d.strip() for d in visible_devices.split(",") if d.strip()]
    if assigned:
        own = str(assigned[0]).strip()
        if visible is None:
            return int(own)
        if own not in visible:
            raise RuntimeError(f"this worker was given GPU {own} but CUDA_VISIBLE_DEVICES={visible_devices}; unset "
                               f"CUDA_VISIBLE_DEVICES in the job's environment (Ray sets it per worker)")
        return visible.index(own)
    if visible is not None and len(visible) == 1:
        return 0
    return local_rank


def release_cached_memory() -> None:
    """Hand the memory torch's caching allocator keeps free back to the device (a no-op on CPU): another allocator
    in this process (vLLM's, waking from sleep) cannot use torch's cached blocks."""
    if use_cuda():
        torch.cuda.empty_cache()


def prepare_process() -> None:
    """Make Megatron-Core usable in this process: pick the GPU, then the shims it needs (CPU/gloo ones without
    CUDA, the no-TE ones without Transformer Engine: megatron_patches.apply decides)."""
    if use_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    megatron_patches.apply()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     timeout_s: float = 600.0) -> None:
    """Join the default process group (gloo on CPU, nccl on GPU) after preparing the process."""
    prepare_process()
    if torch.distributed.is_initialized():
        return
    torch.distributed.init_process_group(
        backend=backend(), init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    logger.debug("rank %d/%d joined %s group at %s:%d", rank, world_size, backend(), master_addr, master_port)


def initialize_model_parallel(layout: ParallelLayout, seed: int = 1234) -> None:
    """(Re)build Megatron's parallel state for `layout` over the existing default group."""
    from megatron.core import parallel_state, tensor_parallel

    layout.check_world_size(torch.distributed.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
