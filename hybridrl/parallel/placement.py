"""Which node holds how many of a pool's devices: a devices-per-node list per pool.

Node k is the k-th node of the run (node 0: the one the driver runs on, then the cluster's other nodes by name;
controller/resource_pool.py pins each pool's devices there). A pool's list is given (`resources.node_devices.<pool>`:
whole nodes, e.g. training [8, 0] and generation [0, 8], or any split), or the pool spreads evenly over every node
(the default), or `hybridrl submit`, which knows the GPUs per node, packs it where it fits (`fit_pools`).
Ranks are node-major: a pool's first ranks are on its first node that has any of its devices.
"""
from __future__ import annotations


class PlacementError(ValueError):
    """Pools that do not fit the nodes; the message names the option."""


def _option(pool: str) -> str:
    return "resources.devices" if pool == "default" else f"resources.pools.{pool}"


def resolve_node_devices(pools: dict[str, int], nodes: int, listed: dict[str, list[int]]) -> dict[str, list[int]]:
    """Every pool's devices per node: its listed split (checked against its size and the node count), else an even
    spread over all nodes."""
    _check_names(pools, listed)
    out = {}
    for pool, devices in pools.items():
        split = [int(d) for d in listed.get(pool, [])]
        if pool in listed:
            if len(split) != nodes or min(split, default=-1) < 0:
                raise PlacementError(f"resources.node_devices.{pool}={split}: give one count >= 0 per node "
                                     f"(resources.nodes={nodes})")
            if sum(split) != devices:
                raise PlacementError(f"resources.node_devices.{pool}={split} places {sum(split)} devices but "
                                     f"{_option(pool)}={devices}: make them agree")
        elif devices % nodes:
            raise PlacementError(f"pool {pool!r} has {devices} devices, which do not split evenly over "
                                 f"resources.nodes={nodes}; give each pool a multiple of the node count, or its devices "
                                 f"per node: resources.node_devices.{pool}=[...] (e.g. whole nodes)")
        else:
            split = [devices // nodes] * nodes
        out[pool] = split
    return out


def fit_pools(pools: dict[str, int], nodes: int, gpus_per_node: int,
              listed: dict[str, list[int]]) -> dict[str, list[int]]:
    """A placement of every pool on `nodes` nodes of `gpus_per_node` devices: listed pools as given, pools that
    split evenly spread, the others packed (largest first) onto whole free nodes where they fill them, else onto the
    nodes with the most room. PlacementError when they do not fit."""
    _check_names(pools, listed)
    fixed = {p: listed[p] for p in pools if p in listed}
    even = {p: d for p, d in pools.items() if p not in listed and d % nodes == 0}
    placed = resolve_node_devices({p: pools[p] for p in (*fixed, *even)}, nodes, fixed)
    free = [gpus_per_node - sum(split[k] for split in placed.values()) for k in range(nodes)]
    _check_room(free, placed, gpus_per_node)
    for pool in sorted((p for p in pools if p not in placed), key=lambda p: -pools[p]):
        placed[pool] = _pack(pool, pools[pool], free, gpus_per_node)
    return {pool: placed[pool] for pool in pools}


def _check_names(pools: dict[str, int], listed: dict[str, list[int]]) -> None:
    unknown = sorted(set(listed) - set(pools))
    if unknown:
        raise PlacementError(f"resources.node_devices names pool(s) {unknown} that resources.pools does not define "
                             f"(pools: {sorted(pools)})")


def _pack(pool: str, devices: int, free: list[int], gpus_per_node: int) -> list[int]:
    split, left = [0] * len(free), devices
    whole = [k for k, room in enumerate(free) if room == gpus_per_node]
    order = whole[:devices // gpus_per_node] + sorted(range(len(free)), key=lambda k: (-free[k], k))
    for k in order:
        take = min(free[k], left)
        split[k] += take
        free[k] -= take
        left -= take
        if not left:
            return split
    raise PlacementError(f"{_option(pool)}={devices} does not fit: {sum(free) + devices - left} device(s) are free "
                         f"on the nodes ({free} per node after the other pools)")


def _check_room(free: list[int], placed: dict[str, list[int]], gpus_per_node: int) -> None:
    for k, room in enumerate(free):
        if room < 0:
            uses = ", ".join(f"{pool} {split[k]}" for pool, split in placed.items() if split[k])
            raise PlacementError(f"node {k} would hold {gpus_per_node - room} devices ({uses}) but has "
                                 f"{gpus_per_node}; change resources.node_devices or the pools")
