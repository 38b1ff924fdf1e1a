"""Worker base class (what a role sees) and the per-device host process that holds the roles.

A WorkerHost is one Ray actor per device of a ResourcePool. It joins the pool's process group
once (gloo on CPU, nccl on GPU; rank 0 publishes the rendezvous port) and builds Megatron's
parallel state for the pool's layout. Every role created on the pool (actor, ref, critic, reward)
is a Worker object inside these hosts, so colocated roles share the process, the device and the
process group, as in HybridFlow.
"""
from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from typing import Any

from hybridrl.parallel import distributed
from hybridrl.parallel.layout import ParallelLayout, RankCoords

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerContext:
    """Where one worker sits: its pool, rank, node-local rank and parallel layout."""

    role: str
    pool: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    layout: ParallelLayout
    master_addr: str
    master_port: int


class Worker:
    """Base class of role workers. Subclass it and decorate methods with @register.

    The host binds the context before the subclass's __init__ runs, so __init__ may already use
    self.rank, self.layout, self.device and the Megatron parallel state.
    """

    _context: WorkerContext

    def _bind(self, context: WorkerContext) -> None:
        self._context = context

    @property
    def context(self) -> WorkerContext:
        return self._context

    @property
    def role(self) -> str:
        return self._context.role

    @property
    def rank(self) -> int:
        return self._context.rank

    @property
    def world_size(self) -> int:
        return self._context.world_size

    @property
    def local_rank(self) -> int:
        return self._context.local_rank

    @property
    def layout(self) -> ParallelLayout:
        return self._context.layout

    @property
    def coords(self) -> RankCoords:
        return self._context.layout.coords(self._context.rank)

    @property
    def is_collect_rank(self) -> bool:
        """True on the rank whose output the driver collects for this DP shard."""
        return self._context.layout.is_collect_rank(self._context.rank)

    @property
    def device(self):
        return distributed.device()


def rendezvous_host(loopback: bool) -> str:
    """Where this worker's rendezvous and collectives listen: loopback when the whole cluster is one node, else the
    node's cluster address (the one Ray runs on: --node-ip-address, HYBRIDRL_NODE_IP in a Slurm job)."""
    import ray

    return "127.0.0.1" if loopback else ray.util.get_node_ip_address()


@dataclass
class RemoteFailure:
    """An exception raised inside a worker, carried back as data (so it never hides behind Ray's wrapping)."""

    role: str
    rank: int
    method: str
    exc_type: str
    message: str
    traceback: str


def cpu_threads_per_worker(local_world_size: int) -> int:
    """Intra-op threads for one CPU worker: this node's cores shared by its workers (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def reuse_freed_heap_memory() -> bool:
    """glibc serves any allocation above 32 MiB (its largest mmap threshold) with a fresh mmap and unmaps it on
    free, so every large activation (a [s, b, 2f] fc1 output, its gradient) is page-faulted in again on each
    use: on the peer job's 25M model that was 1-2 of 8 layers per update costing ~50 ms in one elementwise op
    instead of 1 ms. CPU workers take every allocation from the heap and keep what is freed for reuse
    (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD 2 GiB); ~5% of that update. Returns whether glibc took it."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))
    except (OSError, AttributeError):  # not glibc (musl, macOS): its default allocator stays
        return False


def _quiet_upstream_warnings() -> None:
    """Every worker would print the same upstream deprecation notices (Megatron's optional TE/Apex, torch's
    renamed collectives) once per process; they say nothing about the run, so workers drop them."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def _exit_quietly_on_sigterm() -> None:
    """Ray's worker handler raises SystemExit wherever SIGTERM lands; inside an at-fork or finaliser callback
    that prints a traceback to the driver's stderr. The host is being torn down (Ray's shutdown, the reaper):
    it exits at once, as `ray.kill` would, with its output flushed."""
    import signal
    import sys
    import threading

    def on_sigterm(_signum, _frame):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


class WorkerHost:
    """Body of the per-device Ray actor (made remote by the WorkerGroup with placement options)."""

    def __init__(self, pool: str, rank: int, world_size: int, local_rank: int, local_world_size: int) -> None:
        self.pool, self.rank, self.world_size = pool, rank, world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                          LOCAL_WORLD_SIZE=str(local_world_size))
        _quiet_upstream_warnings()
        _exit_quietly_on_sigterm()
        import torch

        if torch.cuda.is_available():
            import ray

            # LOCAL_RANK names this worker's GPU among those it sees (torch.cuda.set_device, vLLM's launcher):
            # Ray shows each worker its own GPU only, so it is not the node slot
            os.environ["LOCAL_RANK"] = str(distributed.local_device_index(
                local_rank, os.environ.get("CUDA_VISIBLE_DEVICES"), [str(g) for g in ray.get_gpu_ids()]))
            for key, value in distributed.GPU_ENVIRONMENT.items():  # before CUDA starts; the user's own win
                os.environ.setdefault(key, value)
        else:
            # On CPU, N workers per node must not each spawn one thread per core (2 cores, 4 ranks).
            threads = cpu_threads_per_worker(local_world_size)
            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
            reuse_freed_heap_memory()
        self.roles: dict[str, Worker] = {}
        self.layout: ParallelLayout | None = None
        self.master: tuple[str, int] | None = None

    def info(self) -> dict:
        import ray
        import torch

        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "rank": self.rank,
                "local_rank": self.local_rank, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "threads": torch.get_num_threads(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def publish_master_address(self, loopback: bool = False) -> tuple[str, int]:
        """A free port for a rendezvous that spans pools (the bridge): on loopback in a one-node cluster, else on
        this node's cluster address (never every interface)."""
        address = rendezvous_host(loopback)
        return address, distributed.free_port(address)

    def open_rendezvous(self, loopback: bool = False) -> tuple[str, int]:
        """Rank 0 opens the pool's rendezvous listener, on loopback in a one-node cluster, else on its node's
        cluster address; the store serves on it (init_process_group), so no other interface ever listens."""
        address = rendezvous_host(loopback)
        self._listener = distributed.bound_listener(address)
        return address, self._listener.getsockname()[1]

    def init_process_group(self, master_addr: str, master_port: int, timeout_s: float) -> int:
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        distributed.pin_collectives_to(master_addr if master_addr.startswith("127.") else rendezvous_host(False))
        listener = getattr(self, "_listener", None)
        distributed.init_distributed(self.rank, self.world_size, master_addr, master_port, timeout_s=timeout_s,
                                     listen_fd=listener.detach() if listener is not None else None)
        self.master = (master_addr, master_port)
        return self.rank

    def init_model_parallel(self, layout: ParallelLayout, seed: int) -> None:
        """Build Megatron's parallel state for `layout` (once per process; colocated roles share it)."""
        if self.layout == layout:
            return
        if self.layout is not None and self.roles:
            raise RuntimeError(f"this process already holds Megatron parallel state for {self.layout.describe()}; "
                               f"colocated roles must share one layout (got {layout.describe()})")
        distributed.initialize_model_parallel(layout, seed=seed)
        self.layout = layout

    def add_role(self, role: str, cls_bytes: bytes, layout: ParallelLayout, args: tuple, kwargs: dict):
        """Create the role's Worker object in this process; returns None or a RemoteFailure."""
        import cloudpickle

        try:
            cls = cloudpickle.loads(cls_bytes)
            worker = cls.__new__(cls)
            worker._bind(WorkerContext(role, self.pool, self.rank, self.world_size, self.local_rank,
                                       self.local_world_size, layout, *self.master))
            worker.__init__(*args, **kwargs)
            self.roles[role] = worker
        except BaseException as exc:  # noqa: BLE001 - reported to the driver with rank and traceback
            return self._failure(role, "__init__", exc)
        return None

    def remove_role(self, role: str) -> None:
        """Drop a role's Worker object; with no roles left, a new role may bring another layout."""
        self.roles.pop(role, None)
        if not self.roles:
            self.layout = None  # Megatron state stays until the next init_model_parallel rebuilds it

    def call(self, hybridrl_role: str, hybridrl_method: str, hybridrl_keep_result: bool, *args: Any,
             **kwargs: Any) -> Any:
        """Run role.method(*args); Ray resolves top-level ObjectRef args (shared shards) before this runs.
        Without keep_result only success (None) or a RemoteFailure goes back: ranks whose output the
        driver does not collect (TP > 0, earlier PP stages) send no data."""
        try:
            result = getattr(self.roles[hybridrl_role], hybridrl_method)(*args, **kwargs)
            return result if hybridrl_keep_result else None
        except SystemExit:  # Ray ending this process (the driver killed the pool): not the method's failure
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to the driver with rank and traceback
            return self._failure(hybridrl_role, hybridrl_method, exc)

    def _failure(self, role: str, method: str, exc: BaseException) -> RemoteFailure:
        first_line = (str(exc).strip().splitlines() or [""])[0]  # the traceback goes to the driver (RUN/error.log)
        logger.error("role %s rank %d: %s raised %s: %s", role, self.rank, method, type(exc).__name__, first_line)
        return RemoteFailure(role, self.rank, method, type(exc).__name__, str(exc), traceback.format_exc())
