"""Starting or joining Ray: a loopback-only local cluster for laptops/CI, or an existing cluster.

On a machine without GPUs the devices of a ResourcePool are Ray GPU resources declared here
(`num_gpus=N` fake GPUs), so placement and CUDA_VISIBLE_DEVICES follow the same code as on a GPU
cluster. The local cluster binds to 127.0.0.1 only and sends nothing off the machine.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile

from hybridrl.controller.reaper import start_reaper, stop_reaper

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


def _worker_temp_dir() -> str:
    """A temp folder for this cluster's workers, removed when the driver exits. Workers leave files in the
    temp dir that no finaliser removes when Ray ends them (wandb's media/artifact folders, imported by
    megatron.core.inference; the pymp-* folder of Megatron's checkpoint-writer Manager). The name is short:
    the Manager's AF_UNIX socket lives two levels below it and such paths must stay under 108 bytes."""
    folder = tempfile.mkdtemp(prefix="hrl-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


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
    ray.init(address="local", num_gpus=num_devices, num_cpus=num_cpus or os.cpu_count() or 1,
             include_dashboard=False, object_store_memory=object_store_bytes, _node_ip_address=LOOPBACK,
             log_to_driver=log_to_driver, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": worker_python_path(), "RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"],
                                       "TMPDIR": _worker_temp_dir()}})
    start_reaper(os.getpid())  # Ray's processes die with this driver, even a SIGKILLed one
    resources = ray.cluster_resources()
    if f"node:{LOOPBACK}" not in resources:
        ray.shutdown()
        raise RuntimeError(f"local Ray did not bind to {LOOPBACK} (resources {sorted(resources)}); "
                           "set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray")
    logger.info("local Ray up on %s: %s", LOOPBACK, resources)
    return resources


def ensure_ray(num_devices: int | None = None, address: str | None = None, **local_kwargs) -> dict:
    """Reuse a running Ray in this driver, join `address`, or start a local one with num_devices.

    With an existing Ray, checks that it declares at least `num_devices` GPUs (real or fake).
    """
    _ray_environment()
    import ray

    if not ray.is_initialized():
        if address is not None:
            ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": worker_python_path()}})
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
