"""Process-group and Megatron parallel-state setup; the one place that picks device and backend."""
from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch

import megatron_patches
from hybridrl.parallel.layout import ParallelLayout, shard_rows

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


def bound_listener(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on `host` only (port 0: a free one), for a rendezvous store to serve on."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def interface_of(address: str) -> str | None:
    """The network interface that carries `address` (lo for loopback), None if none does."""
    if address.startswith("127.") or address == "::1":
        return "lo"
    import psutil  # a dependency already (the reaper); only for a multi-node rendezvous

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def pin_collectives_to(address: str) -> None:
    """gloo's and NCCL's own listeners on the interface of `address` (unless the user chose one): by default gloo
    binds what the hostname resolves to, and NCCL the first interface it likes, which may face another network."""
    interface = interface_of(address)
    if interface is not None:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, interface)


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     timeout_s: float = 600.0, listen_fd: int | None = None) -> None:
    """Join the default process group (gloo on CPU, nccl on GPU) after preparing the process. Rank 0 serves the
    rendezvous store on `listen_fd` when given: a socket it bound to one address (torch's own store binds every
    interface of the machine)."""
    prepare_process()
    if torch.distributed.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if rank == 0 and listen_fd is None:
        listen_fd = bound_listener(master_addr, master_port).detach()  # the store owns it from here
    store = torch.distributed.TCPStore(master_addr, master_port, world_size, rank == 0, timeout,
                                       master_listen_fd=listen_fd if rank == 0 else None)
    torch.distributed.init_process_group(backend=backend(), store=store, rank=rank, world_size=world_size,
                                         timeout=timeout)
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


def fsdp_row_slice(param: torch.Tensor) -> tuple[int, int]:
    """(first row, row count) of this rank's piece of a fully sharded parameter (FSDP2's DTensor, Shard(0) over
    one DP mesh), checked against the piece it holds."""
    placements = getattr(param, "placements", None)
    if placements is None or len(placements) != 1 or not placements[0].is_shard(0):
        raise ValueError(f"a fully sharded parameter is a dim-0 shard over one DP mesh, got {placements}")
    mesh = param.device_mesh
    first, rows = shard_rows(param.shape[0], mesh.size(), mesh.get_local_rank())
    held = param.to_local().shape[0]
    if held != rows:
        raise ValueError(f"this rank holds {held} rows of {param.shape[0]}, FSDP2's split gives {rows}")
    return first, rows
