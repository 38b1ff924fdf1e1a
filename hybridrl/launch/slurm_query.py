"""Ask Slurm (scontrol) whether a request can ever run, before submitting it; read a job's state."""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

UNUSABLE_NODE_STATES = ("DOWN", "DRAIN", "FAIL", "FUTURE", "NOT_RESPONDING", "INVALID")


class SlurmRequestError(ValueError):
    """A job request that cannot run; the message names the option and what the cluster offers."""


@dataclass
class Partition:
    name: str
    nodes: list[str]
    node_expr: str
    state: str
    is_default: bool
    max_nodes: int | None


@dataclass
class Node:
    name: str
    gpus: int
    state: str

    @property
    def usable(self) -> bool:
        return not any(s in self.state for s in UNUSABLE_NODE_STATES)


def _scontrol(*args: str) -> str:
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise SlurmRequestError(f"`scontrol {' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _fields(line: str) -> dict[str, str]:
    out = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


def expand_hostlist(expr: str) -> list[str]:
    if not expr or expr == "(null)":
        return []
    return _scontrol("show", "hostnames", expr).split()


def gpus_in_gres(gres: str) -> int:
    """GPUs in a node's Gres string: gpu:8, gpu:a100:8(S:0-1), gpu:a100:4,gpu:v100:2, (null)."""
    total = 0
    for item in re.split(r",(?![^()]*\))", gres):
        item = re.sub(r"\(.*\)$", "", item.strip())
        parts = item.split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def partitions() -> dict[str, Partition]:
    result = {}
    for line in _scontrol("show", "partition", "-o").splitlines():
        f = _fields(line)
        if "PartitionName" not in f:
            continue
        max_nodes = f.get("MaxNodes", "UNLIMITED")
        result[f["PartitionName"]] = Partition(
            name=f["PartitionName"], nodes=expand_hostlist(f.get("Nodes", "")), node_expr=f.get("Nodes", ""),
            state=f.get("State", "UNKNOWN"), is_default=f.get("Default") == "YES",
            max_nodes=int(max_nodes) if max_nodes.isdigit() else None)
    return result


def nodes() -> dict[str, Node]:
    result = {}
    for line in _scontrol("show", "node", "-o").splitlines():
        f = _fields(line)
        if "NodeName" in f:
            result[f["NodeName"]] = Node(f["NodeName"], gpus_in_gres(f.get("Gres", "(null)")), f.get("State", ""))
    return result


def check_request(partition: str | None, num_nodes: int, gpus_per_node: int) -> str:
    """Raise SlurmRequestError unless `num_nodes` usable nodes with `gpus_per_node` GPUs exist in the
    partition (the default partition when None). Returns the partition's name."""
    known = partitions()
    if not known:
        raise SlurmRequestError("this Slurm cluster has no partitions")
    listing = ", ".join(f"{p.name}{' (default)' if p.is_default else ''}: {len(p.nodes)} nodes"
                        for p in known.values())
    if partition is None:
        defaults = [p for p in known.values() if p.is_default]
        if not defaults:
            raise SlurmRequestError(f"no default partition: pass --partition (available: {listing})")
        chosen = defaults[0]
    elif partition not in known:
        raise SlurmRequestError(f"--partition {partition}: no such partition (available: {listing})")
    else:
        chosen = known[partition]
    if chosen.state != "UP":
        raise SlurmRequestError(f"--partition {chosen.name} is {chosen.state}, not UP (available: {listing})")
    if num_nodes > len(chosen.nodes):
        raise SlurmRequestError(f"--nodes {num_nodes}: partition {chosen.name} has only {len(chosen.nodes)} "
                                f"node(s) ({chosen.node_expr}); ask for at most {len(chosen.nodes)}")
    if chosen.max_nodes is not None and num_nodes > chosen.max_nodes:
        raise SlurmRequestError(f"--nodes {num_nodes}: partition {chosen.name} allows at most "
                                f"{chosen.max_nodes} nodes per job (MaxNodes)")
    all_nodes = nodes()
    members = [all_nodes[n] for n in chosen.nodes if n in all_nodes]
    fitting = [n for n in members if n.gpus >= gpus_per_node]
    if len(fitting) < num_nodes:
        have = ", ".join(f"{n.name}: {n.gpus}" for n in members[:8]) + (" ..." if len(members) > 8 else "")
        raise SlurmRequestError(f"--gpus-per-node {gpus_per_node}: only {len(fitting)} node(s) of partition "
                                f"{chosen.name} have {gpus_per_node} GPU(s), {num_nodes} needed "
                                f"(GPUs per node: {have})")
    usable = [n for n in fitting if n.usable]
    if len(usable) < num_nodes:
        down = ", ".join(f"{n.name} ({n.state})" for n in fitting if not n.usable)
        raise SlurmRequestError(f"--nodes {num_nodes}: only {len(usable)} node(s) of partition {chosen.name} "
                                f"are up; down or drained: {down}")
    return chosen.name


def job_state(job_id: str) -> tuple[str, str]:
    """(JobState, ExitCode) of a job; ("UNKNOWN", "0:0") once the controller has forgotten it."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    if proc.returncode == 0 and proc.stdout.strip():
        f = _fields(proc.stdout)
        return f.get("JobState", "UNKNOWN"), f.get("ExitCode", "0:0")
    proc = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode == 0 and proc.stdout.strip():
        state, _, exit_code = proc.stdout.strip().splitlines()[0].partition("|")
        return state.split()[0], exit_code
    return "UNKNOWN", "0:0"
