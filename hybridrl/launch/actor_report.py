"""Where did a job's Ray actors run? A placement report read from the cluster's GCS after the command.

    python -m hybridrl.launch.actor_report --address IP:PORT [--out RUN_DIR/ray_actors.json]

The Slurm template runs this after the trainer exits and before Ray is stopped, so the job log says
which actor class ran on which node (name, address, pid) and how many nodes the run really used.
The GCS keeps the records of finished (dead) actors, so this works after the driver is gone. It
reads the GCS actor table directly because these clusters run without Ray's dashboard (which the
public state API needs).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger("hybridrl.launch.actor_report")


@dataclass
class ActorPlacement:
    actor_class: str
    node_name: str
    node_ip: str
    node_id: str
    pid: int
    state: str
    job_id: str
    name: str = ""  # hybridrl's worker hosts: hybridrl:<pool>:rank<r>:<id>


def actor_placements(address: str) -> list[ActorPlacement]:
    """Every actor the cluster at `address` has known (alive or dead), with its node's name."""
    import ray
    from ray._private import state as ray_state

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        node_names = {n["NodeID"]: n.get("NodeName", "") for n in ray.nodes()}
        placements = []
        for info in ray_state.actors().values():
            where = info.get("Address") or {}
            node_id = where.get("NodeID", "")
            placements.append(ActorPlacement(actor_class=info.get("ActorClassName", ""),
                                             node_name=node_names.get(node_id, "?"),
                                             node_ip=where.get("IPAddress", ""), node_id=node_id,
                                             pid=int(info.get("Pid") or 0), state=info.get("State", ""),
                                             job_id=info.get("JobID", ""), name=info.get("Name", "") or ""))
        return sorted(placements, key=lambda p: (p.actor_class, p.node_name, p.pid))
    finally:
        ray.shutdown()


def summary(placements: list[ActorPlacement]) -> str:
    """One line per actor class (hybridrl's worker hosts: per pool): how many on which node, e.g.
    `WorkerHost: n1 x1, n2 x1` or `WorkerHost[default]: n1 x1` and `WorkerHost[gen]: n2 x1`."""
    per_class: dict[str, Counter] = {}
    for p in placements:
        parts = p.name.split(":")
        label = f"{p.actor_class}[{parts[1]}]" if parts[0] == "hybridrl" and len(parts) > 2 else p.actor_class
        per_class.setdefault(label, Counter())[p.node_name] += 1
    lines = [f"{cls}: " + ", ".join(f"{node} x{n}" for node, n in sorted(counts.items()))
             for cls, counts in sorted(per_class.items())]
    nodes = sorted({p.node_name for p in placements})
    return "\n".join(lines + [f"{len(placements)} actor(s) on {len(nodes)} node(s): {', '.join(nodes) or 'none'}"])


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m hybridrl.launch.actor_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="IP:PORT of the head's GCS")
    parser.add_argument("--out", help="also write the placements as JSON here")
    args = parser.parse_args(argv)
    try:
        placements = actor_placements(args.address)
    except Exception as exc:  # a report must never fail the job: say why there is none
        logger.error("no actor report from the Ray cluster at %s: %s", args.address, exc)
        return 1
    for line in summary(placements).splitlines():
        logger.info("actors %s", line)
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(p) for p in placements], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
