"""Starting or joining Ray: a loopback-only local cluster for laptops/CI, or an existing cluster.

On a machine without GPUs the devices of a ResourcePool are Ray GPU resources declared here
(`num_gpus=N` fake GPUs), so placement and CUDA_VISIBLE_DEVICES follow the same code as on a GPU
cluster. The local cluster binds to 127.0.0.1 only and sends nothing off the machine.

Signals: the local cluster's daemons (and so its workers, their children) run in sessions of their own, so a
SIGTERM / SIGINT to the driver's process group (`timeout`, Ctrl-C, `kill -- -PGID`) reaches the driver alone,
which then stops them in order. Where a signal reaches every process anyway (Slurm's scancel and time limit,
`systemctl stop`: the whole cgroup), Ray's daemons die with it; `ray_alive()` tells the driver so, and
`abandon_local_cluster()` ends what is left of it without a call into the dead cluster (each would wait a
minute for the GCS).
"""
from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from hybridrl.config import MachineError
from hybridrl.controller.reaper import reaper_pids, start_reaper, stop_reaper

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_OBJECT_STORE_BYTES = 512 << 20  # <= 1 GiB on small machines


def _ray_environment() -> None:
    # Set before ray is imported/started; each avoids a pitfall seen with Ray 2.60 on one machine.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # head and clients must agree on auth, else clients retry for minutes; loopback needs no token
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # single node: keep 127.0.0.1 instead of the routable address
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray starts workers at nice 15; the workers ARE the compute here, and at nice 15 a multi-threaded
    # (OpenMP) step stalls whenever a Ray daemon or the driver wakes: 2x slower steps measured on 2 cores.
    os.environ.setdefault("RAY_worker_niceness", "0")


def worker_python_path() -> str:
    """The driver's import path for workers, so classes defined next to the driver import there."""
    entries = [p for p in [os.getcwd(), *sys.path] if p and os.path.isdir(p) and "site-packages" not in p
               and not p.startswith(sys.base_prefix)]
    existing = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(dict.fromkeys(entries + ([existing] if existing else [])))


TEMP_PREFIX = "hrl-"
_OWNER = ".owner"  # inside a worker temp folder: flock-ed by its driver while it lives


def _worker_temp_dir() -> str:
    """A temp folder for this cluster's workers, removed when the driver exits. Workers leave files in the
    temp dir that no finaliser removes when Ray ends them (wandb's media/artifact folders, imported by
    megatron.core.inference; the pymp-* folder of Megatron's checkpoint-writer Manager). The name is short:
    the Manager's AF_UNIX socket lives two levels below it and such paths must stay under 108 bytes. The driver
    holds a lock on its `.owner` file: a folder whose lock is free belongs to a driver that is gone (SIGKILLed),
    and the next run removes it (`reap_stale_temp_dirs`); the reaper removes it at once."""
    reap_stale_temp_dirs()
    folder = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    owner = open(os.path.join(folder, _OWNER), "w")
    fcntl.flock(owner, fcntl.LOCK_EX)
    _held_owner_files.append(owner)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    _temp_dirs.append(folder)
    return folder


_held_owner_files: list = []  # open: closing one would release its lock
_temp_dirs: list[str] = []


def reap_stale_temp_dirs(root: str | None = None) -> list[str]:
    """Remove the worker temp folders of drivers that are gone (their `.owner` lock is free). Folders without an
    owner file are not ours to judge (another program, an older hybridrl still running) and are left."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*"):
        owner = folder / _OWNER
        try:
            with open(owner) as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, FileNotFoundError, NotADirectoryError, PermissionError):
            continue  # alive, or not one of ours
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    if removed:
        logger.info("removed %d worker temp folder(s) of runs that were killed: %s", len(removed), removed)
    return removed


def _daemons_in_own_sessions() -> None:
    """Start the local cluster's daemons in sessions of their own (Ray's launcher keeps them in the driver's
    process group, where a group SIGTERM kills the GCS under the driver's feet). Ray's own fate sharing (the
    daemons die with the driver) and the reaper are unchanged."""
    from ray._private import services  # Ray's process launcher; checked below, left alone if it changed

    popen = getattr(services, "ConsolePopen", None)
    if popen is None or getattr(popen, "hybridrl_own_session", False):
        return

    class OwnSessionPopen(popen):
        hybridrl_own_session = True

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSessionPopen


def ray_alive(timeout_s: float = 1.0) -> bool:
    """Whether this driver's Ray cluster still answers: its GCS accepts a connection (a dead one makes every Ray
    call wait a minute and then abort the driver)."""
    import ray

    if not ray.is_initialized():
        return False
    try:
        host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError, AttributeError):
        return False


def abandon_local_cluster() -> None:
    """The cluster is dead or cannot be closed in time: kill this driver's Ray processes on this machine (its
    daemons and workers: every descendant but the reaper) and remove the workers' temp folder, without one call
    into Ray. The caller then ends the process with os._exit (Ray's exit hooks would wait for the GCS)."""
    import psutil  # already a dependency (the reaper); only on this rare path

    keep = set(reaper_pids())
    children = [p for p in psutil.Process().children(recursive=True) if p.pid not in keep]
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=5)
    stop_reaper()
    for folder in _temp_dirs:
        shutil.rmtree(folder, ignore_errors=True)


def init_local_ray(num_devices: int, num_cpus: int | None = None,
                   object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES, log_to_driver: bool = True) -> dict:
    """Start a private single-node Ray on loopback with `num_devices` GPU resources.

    Returns ray.cluster_resources(). Refuses to start a second one in the same driver.
    """
    if num_devices < 1:
        raise ValueError(f"init_local_ray: num_devices must be >= 1, got {num_devices}")
    if object_store_bytes > 1 << 30:
        raise ValueError("init_local_ray: object_store_bytes above 1 GiB does not fit a small machine; lower it")
    _ray_environment()
    import ray

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this driver; use ensure_ray() to reuse it")
    from ray._private import ray_constants

    # Ray reads this switch when it is first imported; a driver that imported ray before us would
    # advertise the routable address instead of loopback. The local cluster must stay on 127.0.0.1.
    ray_constants.ENABLE_RAY_CLUSTER = False
    _daemons_in_own_sessions()
    temp_dir = _worker_temp_dir()
    _start_or_join(address="local", num_gpus=num_devices, num_cpus=num_cpus or os.cpu_count() or 1,
             include_dashboard=False, object_store_memory=object_store_bytes, _node_ip_address=LOOPBACK,
             log_to_driver=log_to_driver, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": worker_python_path(), "RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"],
                                       "TMPDIR": temp_dir}})
    start_reaper(os.getpid(), temp_dir)  # Ray's processes die with this driver, even a SIGKILLed one
    resources = ray.cluster_resources()
    if f"node:{LOOPBACK}" not in resources:
        ray.shutdown()
        raise RuntimeError(f"local Ray did not bind to {LOOPBACK} (resources {sorted(resources)}); "
                           "set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray")
    logger.info("local Ray up on %s: %s", LOOPBACK, resources)
    return resources


def _start_or_join(**init_kwargs) -> None:
    """ray.init, with Ray's own start-up timeout (a raylet that did not register within its fixed 30 s, on a
    machine under load) turned into one line instead of a traceback."""
    import ray

    try:
        ray.init(**init_kwargs)
    except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for it; others pass on unchanged
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        raise MachineError(f"Ray's node did not start in time ({str(exc).split('. ')[0].strip()}; load average "
                           f"{load}): the machine is busy; retry when it is quieter, or lower resources.devices") \
            from None


def ensure_ray(num_devices: int | None = None, address: str | None = None, **local_kwargs) -> dict:
    """Reuse a running Ray in this driver, join `address`, or start a local one with num_devices.

    With an existing Ray, checks that it declares at least `num_devices` GPUs (real or fake).
    """
    _ray_environment()
    import ray

    if not ray.is_initialized():
        if address is not None:
            _start_or_join(address=address, runtime_env={"env_vars": {"PYTHONPATH": worker_python_path()}})
        else:
            if num_devices is None:
                raise ValueError("ensure_ray: give num_devices (local cluster) or address (existing cluster)")
            return init_local_ray(num_devices, **local_kwargs)
    resources = ray.cluster_resources()
    if num_devices is not None and resources.get("GPU", 0) < num_devices:
        raise RuntimeError(f"Ray has {resources.get('GPU', 0):g} GPUs but {num_devices} devices were asked for; "
                           "start Ray with more (init_local_ray(num_devices)) or use fewer devices")
    return resources


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    stop_reaper()
