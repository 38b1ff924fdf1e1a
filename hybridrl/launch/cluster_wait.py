"""Wait until a multi-node Ray cluster is complete, or fail fast saying what is missing."""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


class ClusterNotReady(RuntimeError):
    """The head did not come up, a node never joined, or a node lacks its GPUs."""


@dataclass
class JoinedNode:
    name: str
    ip: str
    cpus: float
    gpus: float


def tcp_reachable(address: str, timeout_s: float = 1.0) -> bool:
    """Something listens at `address` (HOST:PORT): the Ray head's GCS, before ray.init can join it."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _exited(pid: int) -> bool:
    """True when `pid` is gone or a zombie (a finished child its parent has not reaped yet)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _last_error(log_hint: str, node: str) -> str:
    """The last ERROR line of a node's start log (`log_hint` with <node> in it), if readable."""
    if "<node>" not in log_hint:
        return ""
    try:
        lines = Path(log_hint.replace("<node>", node)).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line.split(" ERROR ", 1)[-1] for line in lines if " ERROR " in line]
    return f": {errors[-1]}" if errors else ""


def _check_watched(watch: dict[str, int], head: str, address: str, log_hint: str) -> None:
    for name, pid in watch.items():
        if _exited(pid):
            what = f"the Ray head on node {name} did not come up" if name == head else \
                f"node {name} never joined the Ray cluster"
            time.sleep(0.5)  # let the step's last log lines land
            raise ClusterNotReady(f"{what}: its Ray start step (pid {pid}) exited{_last_error(log_hint, name)}"
                                  f" (head address {address}){'; logs: ' + log_hint if log_hint else ''}")


def alive_nodes() -> dict[str, JoinedNode]:
    import ray

    joined = {}
    for node in ray.nodes():
        if node.get("Alive"):
            res = node.get("Resources", {})
            joined[node["NodeName"]] = JoinedNode(node["NodeName"], node["NodeManagerAddress"],
                                                  res.get("CPU", 0.0), res.get("GPU", 0.0))
    return joined


def wait_for_cluster(address: str, node_names: list[str], gpus_per_node: int, timeout_s: float,
                     watch: dict[str, int] | None = None, log_hint: str = "",
                     poll_s: float = 0.5) -> dict[str, JoinedNode]:
    """Block until the Ray cluster at `address` has every node in `node_names` (head first) alive
    with at least `gpus_per_node` GPUs. Raises ClusterNotReady naming the head or the missing
    nodes when `timeout_s` passes or a watched node's start process exits."""
    import ray

    watch = watch or {}
    head = node_names[0]
    deadline = time.monotonic() + timeout_s
    while not tcp_reachable(address):
        _check_watched(watch, head, address, log_hint)
        if time.monotonic() > deadline:
            raise ClusterNotReady(f"the Ray head on node {head} did not come up: nothing listens at {address} "
                                  f"after {timeout_s:.0f} s{'; logs: ' + log_hint if log_hint else ''}")
        time.sleep(poll_s)

    # the GCS answers before this host's raylet has registered; on a crowded node that takes longer
    # than ray.init's own wait (60 s), so keep trying until our deadline
    while True:
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            break
        except (ConnectionError, RuntimeError) as exc:
            ray.shutdown()
            _check_watched(watch, head, address, log_hint)
            if time.monotonic() > deadline:
                raise ClusterNotReady(f"the Ray head on node {head} did not come up: its GCS at {address} answers "
                                      f"but no Ray node could be joined within {timeout_s:.0f} s ({exc})"
                                      f"{'; logs: ' + log_hint if log_hint else ''}") from None
            logger.info("Ray at %s not ready to join yet (%s); retrying", address, str(exc).splitlines()[0])
            time.sleep(poll_s)
    try:
        while True:
            joined = alive_nodes()
            missing = [name for name in node_names if name not in joined]
            short = [f"{n.name} ({n.gpus:g} GPUs)" for n in joined.values()
                     if n.name in node_names and n.gpus < gpus_per_node]
            if not missing and not short:
                logger.info("Ray cluster at %s complete: %s", address,
                            ", ".join(f"{n.name}@{n.ip} cpus={n.cpus:g} gpus={n.gpus:g}" for n in joined.values()))
                return joined
            _check_watched({n: p for n, p in watch.items() if n in missing}, head, address, log_hint)
            if time.monotonic() > deadline:
                if missing:
                    raise ClusterNotReady(
                        f"node(s) {', '.join(missing)} never joined the Ray cluster at {address} within "
                        f"{timeout_s:.0f} s (joined: {', '.join(sorted(joined)) or 'none'})"
                        f"{'; logs: ' + log_hint if log_hint else ''}")
                raise ClusterNotReady(f"node(s) joined with fewer than {gpus_per_node} GPUs: {', '.join(short)}")
            time.sleep(poll_s)
    finally:
        ray.shutdown()
