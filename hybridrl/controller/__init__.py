"""Single controller on Ray: resource pools, the worker base class, worker groups and dispatch modes.

    pool = ResourcePool(devices=4)
    groups = create_colocated_worker_group(pool, {"actor": ActorWorker, "ref": RefWorker},
                                           layout=ParallelLayout(tp=2, dp=2))
    out = groups["actor"].generate(batch)        # a @register(dispatch=Dispatch.DP_COMPUTE) method

A new dispatch mode is registered by name (@register_dispatch_mode, controller/dispatch.py), like the built-ins.
"""
# ruff: noqa: E402
from hybridrl.controller.ray_cluster import _ray_environment

_ray_environment()  # before anything imports ray: loopback, no usage stats, consistent auth

from hybridrl.controller.dispatch import (CallPlan, Dispatch, MethodSpec, get_dispatch_mode, register,
                                          register_dispatch_mode)
from hybridrl.controller.ray_cluster import ensure_ray, init_local_ray, shutdown_ray
from hybridrl.controller.resource_pool import ResourcePool, ResourcePoolError
from hybridrl.controller.worker import Worker, WorkerContext
from hybridrl.controller.worker_group import (GroupFuture, WorkerDiedError, WorkerError, WorkerGroup, WorkerHungError,
                                              WorkerTimeoutError, create_colocated_worker_group, wait_all)

__all__ = [
    "CallPlan", "Dispatch", "MethodSpec", "get_dispatch_mode", "register", "register_dispatch_mode", "ensure_ray",
    "init_local_ray", "shutdown_ray", "ResourcePool",
    "ResourcePoolError", "Worker", "WorkerContext", "GroupFuture", "WorkerDiedError", "WorkerError", "WorkerHungError",
    "WorkerGroup", "WorkerTimeoutError", "create_colocated_worker_group", "wait_all",
]
