"""ResourcePool: a set of devices, one Ray placement-group bundle per device, packed per node.

Roles created on the same pool live in the same worker processes (one per device) and so share
its devices and process group; roles on different pools get disjoint devices and processes. The pool holds
those processes (`_hosts`, private to the controller: worker_group.py starts them with the pool's first role);
outside the controller `pool.layout` says which layout they hold.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridrl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

_DEVICE_PATTERN = re.compile(r"^(cuda|gpu):(\d+)$")


class ResourcePoolError(ValueError):
    """A resource pool that cannot be built (bad sizes, not enough devices in Ray)."""


class PoolProcesses(Protocol):
    """What the pool knows of its worker processes (worker_group.py's _PoolHosts, started with its first role)."""

    layout: ParallelLayout | None  # the layout their Megatron state was initialised with; None: none yet

    def kill(self) -> None: ...


@dataclass(eq=False)
class ResourcePool:
    """Devices for one or more roles.

    ResourcePool(devices=4)                       4 devices on one node
    ResourcePool(nodes=2, devices_per_node=8)     16 devices, 8 per node
    ResourcePool(devices=["cuda:0", "cuda:1"])    an explicit device list (one node)
    """

    devices: int | list[str] | None = None
    nodes: int = 1
    devices_per_node: int | None = None
    name: str = "pool"
    placement_timeout_s: float = 120.0
    start_timeout_s: float = 300.0  # how long each role's workers may take to start on this pool
    device_labels: list[str] = field(init=False)
    _placement_groups: list[Any] = field(default_factory=list, init=False, repr=False)
    _hosts: PoolProcesses | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ResourcePoolError(f"ResourcePool: nodes must be a positive integer, got {self.nodes!r}")
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
                                            f"nodes={self.nodes}; give devices_per_node")
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

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def layout(self) -> ParallelLayout | None:
        """The layout the pool's processes hold Megatron state for (colocated roles share it); None while no
        role is on the pool (or its roles hold no Megatron state)."""
        return self._hosts.layout if self._hosts is not None else None

    def placement_groups(self) -> list[Any]:
        """One STRICT_PACK placement group per node, each with one {"GPU": 1} bundle per device (created once)."""
        if self._placement_groups:
            return self._placement_groups
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        available = ray.cluster_resources().get("GPU", 0)
        if available < self.world_size:
            raise ResourcePoolError(f"ResourcePool {self.name!r} needs {self.world_size} devices but Ray has "
                                    f"{available:g} GPUs in total; start Ray with more devices or shrink the pool")
        groups = [placement_group([{"GPU": 1}] * self.devices_per_node, strategy="STRICT_PACK",
                                  name=f"hybridrl-{self.name}-{id(self):x}-node{node}")
                  for node in range(self.nodes)]
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=self.placement_timeout_s)
        if len(ready) != len(groups):
            for group in groups:
                remove_placement_group(group)
            raise ResourcePoolError(f"ResourcePool {self.name!r}: {self.nodes} node(s) x {self.devices_per_node} "
                                    f"free devices not found within {self.placement_timeout_s:.0f}s (other pools "
                                    "hold them?); free devices or shrink the pool")
        self._placement_groups = groups
        logger.info("pool %r placed: %d node(s) x %d device(s)", self.name, self.nodes, self.devices_per_node)
        return groups

    def bundles(self) -> list[tuple[Any, int, int]]:
        """(placement group, bundle index, local rank) for each global rank, node-major."""
        return [(group, index, index) for group in self.placement_groups() for index in range(self.devices_per_node)]

    def shutdown(self) -> None:
        """Kill the pool's worker processes and release its devices."""
        from ray.util.placement_group import remove_placement_group

        if self._hosts is not None:
            self._hosts.kill()
            self._hosts = None
        for group in self._placement_groups:
            remove_placement_group(group)
        self._placement_groups = []
