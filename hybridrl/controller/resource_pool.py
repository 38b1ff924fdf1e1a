"""ResourcePool: a set of devices, one Ray placement-group bundle per device, packed per node.

Roles created on the same pool live in the same worker processes (one per device) and so share
its devices and process group; roles on different pools get disjoint devices and processes. The pool holds
those processes (`_hosts`, private to the controller: worker_group.py starts them with the pool's first role);
outside the controller `pool.layout` says which layout they hold.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridrl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

_DEVICE_PATTERN = re.compile(r"^(cuda|gpu):(\d+)$")
DEFAULT_POOL_NAME = "default"
DEVICES_ENV = "HYBRIDRL_DEVICES"  # devices of the default pool (roles created without resource_pool=)
DEFAULT_CPU_DEVICES = 2  # the default pool on a machine without GPUs, like `hybridrl train`'s resources.devices


class ResourcePoolError(ValueError):
    """A resource pool that cannot be built (bad sizes, not enough devices in Ray)."""


class PoolProcesses(Protocol):
    """What the pool knows of its worker processes (worker_group.py's _PoolHosts, started with its first role)."""

    layout: ParallelLayout | None  # the layout their Megatron state was initialised with; None: none yet

    def kill(self) -> None: ...


@dataclass(eq=False)
class ResourcePool:
    """Devices for one or more roles.

    ResourcePool(devices=4)                         4 devices on one node
    ResourcePool(nodes=2, devices_per_node=8)       16 devices, 8 per node
    ResourcePool(nodes=2, devices_per_node=[0, 8])  8 devices, all on the run's second node (whole nodes)
    ResourcePool(devices=["cuda:0", "cuda:1"])      an explicit device list (one node)
    ResourcePool.default(devices=4)                 the pool of roles created without one (default(): all devices)

    On several nodes each node's devices are pinned to the k-th node of the cluster (`cluster_nodes`: the driver's
    node first, then the others by name), so pools given disjoint nodes get them.
    """

    devices: int | list[str] | None = None
    nodes: int = 1
    devices_per_node: int | list[int] | None = None
    name: str = "pool"
    placement_timeout_s: float = 120.0
    start_timeout_s: float = 300.0  # how long each role's workers may take to start on this pool
    device_labels: list[str] = field(init=False)
    node_split: list[int] = field(init=False)  # devices on each node of the run (zeros: nodes it leaves out)
    _placement_groups: list[Any] = field(default_factory=list, init=False, repr=False)
    _hosts: PoolProcesses | None = field(default=None, init=False, repr=False)
    _cluster: str | None = field(default=None, init=False, repr=False)  # the Ray cluster (GCS) it was placed on

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ResourcePoolError(f"ResourcePool: nodes must be a positive integer, got {self.nodes!r}")
        if isinstance(self.devices_per_node, (list, tuple)):
            self.node_split = self._checked_split(list(self.devices_per_node))
            self.devices_per_node = max(self.node_split)
            self.device_labels = [f"cuda:{i}" for n in self.node_split for i in range(n)]
            return
        if isinstance(self.devices, (list, tuple)):
            labels = list(self.devices)
            bad = [d for d in labels if not isinstance(d, str) or not _DEVICE_PATTERN.match(d)]
            if bad or not labels:
                raise ResourcePoolError(f"ResourcePool: devices {bad or labels} must be like 'cuda:0'")
            if len(set(labels)) != len(labels):
                raise ResourcePoolError(f"ResourcePool: devices {labels} list a device twice")
            if self.nodes != 1 or self.devices_per_node not in (None, len(labels)):
                raise ResourcePoolError("ResourcePool: an explicit device list describes one node; "
                                        "use nodes=/devices_per_node= for several nodes")
            self.devices_per_node = len(labels)
        elif self.devices is not None:
            if not isinstance(self.devices, int) or self.devices < 1:
                raise ResourcePoolError(f"ResourcePool: devices must be a positive integer or a list, got {self.devices!r}")
            if self.devices_per_node is None:
                if self.devices % self.nodes:
                    raise ResourcePoolError(f"ResourcePool: devices={self.devices} does not split evenly over "
                                            f"nodes={self.nodes}; give devices_per_node (a count, or one per node)")
                self.devices_per_node = self.devices // self.nodes
            if self.devices_per_node * self.nodes != self.devices:
                raise ResourcePoolError(f"ResourcePool: devices={self.devices} != nodes*devices_per_node = "
                                        f"{self.nodes}*{self.devices_per_node}")
            labels = [f"cuda:{i}" for i in range(self.devices_per_node)] * self.nodes
        else:
            if self.devices_per_node is None or self.devices_per_node < 1:
                raise ResourcePoolError("ResourcePool: give devices=N, devices=[...] or nodes= and devices_per_node=")
            labels = [f"cuda:{i}" for i in range(self.devices_per_node)] * self.nodes
        self.device_labels = labels
        self.node_split = [self.devices_per_node] * self.nodes

    def _checked_split(self, split: list[int]) -> list[int]:
        if len(split) != self.nodes or any(not isinstance(n, int) or n < 0 for n in split) or not sum(split):
            raise ResourcePoolError(f"ResourcePool: devices_per_node={split} must give one count >= 0 per node "
                                    f"(nodes={self.nodes}), at least one above 0")
        if self.devices is not None and self.devices != sum(split):
            raise ResourcePoolError(f"ResourcePool: devices={self.devices} but devices_per_node={split} places "
                                    f"{sum(split)}")
        return split

    @classmethod
    def default(cls, devices: int | list[str] | None = None, nodes: int = 1,
                devices_per_node: int | None = None) -> "ResourcePool":
        """The pool that roles created without `resource_pool=` share, colocated (one set of worker processes,
        one layout). Its size: the arguments when given (call before the first such role), else $HYBRIDRL_DEVICES,
        else every device of the running Ray cluster, else every visible GPU, else 2 devices on a machine without
        GPUs. A pool from a Ray cluster that has since stopped is replaced by a fresh one."""
        global _default_pool
        current = _default_pool if _default_pool is not None and not _default_pool.placed_elsewhere() else None
        if devices is None and devices_per_node is None:
            if current is None:
                current = cls(**_default_size(), name=DEFAULT_POOL_NAME)
            _default_pool = current
            return current
        wanted = cls(devices=devices, nodes=nodes, devices_per_node=devices_per_node, name=DEFAULT_POOL_NAME)
        if current is not None and current._hosts is not None and current.device_labels != wanted.device_labels:
            raise ResourcePoolError(f"ResourcePool.default: the default pool already runs roles on "
                                    f"{current.world_size} device(s); size it before the first role without "
                                    f"resource_pool=, or give that role a pool of its own")
        if current is not None and current.device_labels == wanted.device_labels:
            return current
        if current is not None:
            current.shutdown()  # placed but unused: give its devices back
        _default_pool = wanted
        return wanted

    def placed_elsewhere(self) -> bool:
        """True when this pool was placed on a Ray cluster that is no longer this driver's (stopped, restarted)."""
        if self._cluster is None:
            return False
        import ray

        return not ray.is_initialized() or ray.get_runtime_context().gcs_address != self._cluster

    @property
    def world_size(self) -> int:
        return sum(self.node_split)

    def local_world_size(self, rank: int) -> int:
        """Devices of this pool on the node that holds `rank` (ranks are node-major)."""
        for devices in self.node_split:
            if rank < devices:
                return devices
            rank -= devices
        raise ValueError(f"rank {rank} is outside pool {self.name!r}")

    @property
    def layout(self) -> ParallelLayout | None:
        """The layout the pool's processes hold Megatron state for (colocated roles share it); None while no
        role is on the pool (or its roles hold no Megatron state)."""
        return self._hosts.layout if self._hosts is not None else None

    def placement_groups(self) -> list[Any]:
        """One STRICT_PACK placement group per node holding devices of the pool, each with one {"GPU": 1} bundle
        per device (created once); on several nodes each pinned to its node of the cluster."""
        if self._placement_groups:
            return self._placement_groups
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        available = ray.cluster_resources().get("GPU", 0)
        if available < self.world_size:
            raise ResourcePoolError(f"ResourcePool {self.name!r} needs {self.world_size} devices but Ray has "
                                    f"{available:g} GPUs in total; start Ray with more devices or shrink the pool")
        pins = cluster_nodes() if self.nodes > 1 else [None]
        if len(pins) < self.nodes:
            raise ResourcePoolError(f"ResourcePool {self.name!r} spans {self.nodes} nodes but the Ray cluster has "
                                    f"{len(pins)} with GPUs; start Ray on every node or lower resources.nodes")
        groups = [placement_group([{"GPU": 1, **({pins[node]: 0.001} if pins[node] else {})}] * devices,
                                  strategy="STRICT_PACK", name=f"hybridrl-{self.name}-{id(self):x}-node{node}")
                  for node, devices in enumerate(self.node_split) if devices]
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=self.placement_timeout_s)
        if len(ready) != len(groups):
            for group in groups:
                remove_placement_group(group)
            raise ResourcePoolError(f"ResourcePool {self.name!r}: free devices not found within "
                                    f"{self.placement_timeout_s:.0f}s for {self.node_split} device(s) per node (other "
                                    "pools hold them?); free devices or shrink the pool")
        self._placement_groups = groups
        self._cluster = ray.get_runtime_context().gcs_address
        logger.info("pool %r placed: %s device(s) per node", self.name, self.node_split)
        return groups

    def bundles(self) -> list[tuple[Any, int, int]]:
        """(placement group, bundle index, local rank) for each global rank, node-major."""
        devices = [n for n in self.node_split if n]
        return [(group, index, index) for group, count in zip(self.placement_groups(), devices)
                for index in range(count)]

    def shutdown(self) -> None:
        """Kill the pool's worker processes and release its devices."""
        from ray.util.placement_group import remove_placement_group

        if self._hosts is not None:
            self._hosts.kill()
            self._hosts = None
        for group in self._placement_groups:
            remove_placement_group(group)
        self._placement_groups = []
        self._cluster = None


_default_pool: ResourcePool | None = None


def _default_size() -> dict[str, Any]:
    """ResourcePool arguments for the default pool (ResourcePool.default says the order)."""
    value = os.environ.get(DEVICES_ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ResourcePoolError(f"{DEVICES_ENV}={value!r}: give a positive number of devices")
        return {"devices": int(value)}
    import ray  # the running cluster, when there is one

    if ray.is_initialized():
        per_node = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
        per_node = [g for g in per_node if g > 0]
        if per_node:
            return {"nodes": len(per_node), "devices_per_node": min(per_node)}
    import torch  # start-up time: only the default pool asks torch for the visible GPUs

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return {"devices": torch.cuda.device_count()}
    return {"devices": DEFAULT_CPU_DEVICES}


def cluster_nodes() -> list[str]:
    """The Ray resource that pins a bundle to each node with GPUs, in the run's node order: the driver's node first,
    then the others by node name (Slurm's order for names like n1, n2 or gpu001, gpu002), then address."""
    import ray

    here = ray.util.get_node_ip_address()
    alive = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]
    alive.sort(key=lambda n: (n["NodeManagerAddress"] != here, n.get("NodeName", ""), n["NodeManagerAddress"]))
    return [f"node:{n['NodeManagerAddress']}" for n in alive]
