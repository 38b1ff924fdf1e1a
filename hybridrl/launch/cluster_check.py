"""Check a multi-node Ray cluster end to end: one actor per node, a collective group across them.

    python -m hybridrl.launch.cluster_check --nodes 2 [--gpus-per-node G] [--run-dir DIR] [--steps 3]
        [--models FOLDER ...]

Connects to the running cluster (RAY_ADDRESS, as exported by the Slurm template), places one actor
on every node (STRICT_SPREAD placement group), forms one torch.distributed group over them (gloo on
CPU, nccl on GPU, through hybridrl.parallel.distributed.backend()), all-reduces a known tensor
`--steps` times, and writes DIR/metrics.jsonl: a `cluster` record (which actor ran where) and one
record per step. With --models, every node also looks for each model folder (config.json or
adapter_config.json in it): how a job with node-local model files (`hybridrl submit --model-files staged`)
checks that each node holds them. Exits 0 only when every all-reduce equals its expected value and every node
sees every model folder.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

logger = logging.getLogger("hybridrl.launch.cluster_check")


class ClusterCheckActor:
    """One per node; holds its rank of the cross-node process group."""

    def where(self) -> dict:
        import ray

        return {"node_name": os.environ.get("HYBRIDRL_NODE_NAME") or os.environ.get("SLURMD_NODENAME")
                or socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "ray_node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def missing_models(self, folders: list[str]) -> list[str]:
        return missing_model_folders(folders)

    def free_port(self) -> int:
        import ray

        from hybridrl.parallel.distributed import free_port  # torch: for the actors only, not the check's driver

        return free_port(ray.util.get_node_ip_address())

    def join_group(self, rank: int, world_size: int, master_addr: str, master_port: int) -> str:
        from datetime import timedelta

        import torch

        from hybridrl.parallel.distributed import backend  # torch (see free_port)

        torch.distributed.init_process_group(backend=backend(), init_method=f"tcp://{master_addr}:{master_port}",
                                             rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        return backend()

    def all_reduce(self, rank: int, step: int, numel: int) -> list[float]:
        import torch

        from hybridrl.parallel.distributed import device  # torch (see free_port)

        value = torch.full((numel,), float((rank + 1) * (step + 1)), device=device())
        torch.distributed.all_reduce(value)
        return value.cpu().tolist()

    def leave_group(self) -> None:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def missing_model_folders(folders: list[str]) -> list[str]:
    """The folders among `folders` that hold no model here (no config.json / adapter_config.json)."""
    marks = ("config.json", "adapter_config.json")
    return [f for f in folders if not any((Path(f) / name).is_file() for name in marks)]


def run_check(num_nodes: int, gpus_per_node: int, run_dir: Path, steps: int = 3, numel: int = 1024,
              timeout_s: float = 120.0, address: str | None = None, models: list[str] = ()) -> bool:
    """Run the check on the cluster at `address` (default: RAY_ADDRESS / the running cluster)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    ray.init(address=address or os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING)
    start = time.monotonic()
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) < num_nodes:
            raise RuntimeError(f"--nodes {num_nodes}, but the Ray cluster has only {len(alive)} alive "
                               f"node(s): {[n['NodeName'] for n in alive]}")
        bundle = {"CPU": 1, **({"GPU": gpus_per_node} if gpus_per_node else {})}
        group = placement_group([dict(bundle) for _ in range(num_nodes)], strategy="STRICT_SPREAD")
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            raise RuntimeError(f"could not place one actor on each of {num_nodes} nodes with {bundle} "
                               f"within {timeout_s:.0f} s: {ray.cluster_resources()}")
        actor_cls = ray.remote(ClusterCheckActor)
        actors = [actor_cls.options(num_cpus=1, num_gpus=gpus_per_node,
                                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                                        placement_group=group, placement_group_bundle_index=i)).remote()
                  for i in range(num_nodes)]
        placed = ray.get([a.where.remote() for a in actors], timeout=timeout_s)
        master_addr = placed[0]["ip"]
        master_port = ray.get(actors[0].free_port.remote(), timeout=timeout_s)
        backends = ray.get([a.join_group.remote(rank, num_nodes, master_addr, master_port)
                            for rank, a in enumerate(actors)], timeout=timeout_s)
        distinct_nodes = len({p["ray_node_id"] for p in placed})
        missing = ray.get([a.missing_models.remote(list(models)) for a in actors], timeout=timeout_s)
        records = [{"event": "cluster", "nodes": num_nodes, "distinct_nodes": distinct_nodes,
                    "backend": backends[0], "master": f"{master_addr}:{master_port}",
                    "ranks": [{"rank": r, **p, "missing_models": m} for r, (p, m) in enumerate(zip(placed, missing))]}]
        for place, absent in zip(placed, missing):
            if absent:
                logger.error("node %s does not see the model folder(s) %s", place["node_name"], absent)
        all_ok = distinct_nodes == num_nodes and not any(missing)
        for step in range(steps):
            t0 = time.monotonic()
            results = ray.get([a.all_reduce.remote(rank, step, numel) for rank, a in enumerate(actors)],
                              timeout=timeout_s)
            expected = float((step + 1) * num_nodes * (num_nodes + 1) // 2)
            ok = all(all(v == expected for v in r) for r in results)
            all_ok &= ok
            records.append({"event": "step", "step": step, "allreduce_value": results[0][0],
                            "expected": expected, "ok": ok, "numel": numel,
                            "allreduce_s": round(time.monotonic() - t0, 4)})
        ray.get([a.leave_group.remote() for a in actors], timeout=timeout_s)
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
        records.append({"event": "done", "ok": all_ok, "seconds": round(time.monotonic() - start, 2)})
        with metrics_path.open("a") as out:
            for record in records:
                out.write(json.dumps(record) + "\n")
        logger.info("cluster check %s: %d ranks on nodes %s, metrics in %s", "passed" if all_ok else "FAILED",
                    num_nodes, [p["node_name"] for p in placed], metrics_path)
        return all_ok
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m hybridrl.launch.cluster_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=int(os.environ.get("SLURM_JOB_NUM_NODES", "1")),
                        help="nodes to span (default: the Slurm job's node count)")
    parser.add_argument("--gpus-per-node", type=int, default=int(os.environ.get("HYBRIDRL_GPUS_PER_NODE", "0")),
                        help="GPUs each actor takes (0: CPU/gloo; default: the Slurm job's, else 0)")
    parser.add_argument("--run-dir", default=os.environ.get("HYBRIDRL_RUN_DIR", "."),
                        help="where metrics.jsonl goes (default: $HYBRIDRL_RUN_DIR, else .)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for each cluster operation")
    parser.add_argument("--models", nargs="*", default=[], metavar="FOLDER",
                        help="model folders every node must hold (the paths the job's driver hands its workers)")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 0 or args.steps < 1:
        parser.error("--nodes and --steps must be >= 1 and --gpus-per-node >= 0")
    try:
        ok = run_check(args.nodes, args.gpus_per_node, Path(args.run_dir), args.steps, timeout_s=args.timeout,
                       models=args.models)
    except Exception as exc:  # the message is the product: say what failed, exit non-zero
        logger.error("cluster check failed: %s", exc)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
