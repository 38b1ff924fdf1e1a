"""Overhead of the single controller against plain Ray, measured in the same run.

Cases (4 workers on 4 devices of one local Ray; fake GPUs on CPU):
  * empty call:  WorkerGroup ONE_TO_ALL no-op          vs  ray.get of 4 plain actor no-op calls
  * batch N MB:  driver -> 4 workers -> driver with a DP_COMPUTE echo (split in 4, each rank returns its
                 shard, concatenated)                  vs  ray.get of 4 plain actor echo calls of the same
                 Batch shards (and, for reference, of the same shards as a plain dict of torch tensors).
Prints the ratios and writes benchmarks/results/controller.{json,md}.

    python benchmarks/controller.py [--sizes-mb 1 16 128] [--repeats 20]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from benchmarks._results import default_meta, write_results  # noqa: E402
from hybridrl.controller import (Dispatch, ResourcePool, Worker, WorkerGroup, init_local_ray,  # noqa: E402
                                 register, shutdown_ray)
from hybridrl.parallel.layout import ParallelLayout  # noqa: E402
from hybridrl.protocol import Batch  # noqa: E402

logger = logging.getLogger("benchmarks.controller")
NUM_WORKERS = 4


class EchoWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(Dispatch.DP_COMPUTE)
    def echo(self, batch: Batch) -> Batch:
        return batch


class PlainEcho:
    """The baseline: a bare Ray actor doing the same work."""

    def noop(self) -> None:
        return None

    def echo(self, value):
        return value


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats (after one warm-up call)."""
    return timed_pair(fn, None, repeats)[0]


def timed_pair(fn_a, fn_b, repeats: int) -> tuple[float, float]:
    """Medians of fn_a() and fn_b(), alternated call by call so that load from other processes on a
    shared machine hits both sides alike (after one warm-up call each)."""
    fns = [f for f in (fn_a, fn_b) if f is not None]
    samples: list[list[float]] = [[] for _ in fns]
    for f in fns:
        f()
    for _ in range(repeats):
        for f, out in zip(fns, samples):
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
    medians = [statistics.median(s) for s in samples]
    return medians[0], (medians[1] if len(medians) > 1 else float("nan"))


def make_batch(megabytes: int) -> Batch:
    rows = 64 * NUM_WORKERS
    cols = megabytes * (1 << 20) // (4 * rows)
    return Batch({"data": torch.randn(rows, cols)}, {"uid": [f"row{i}" for i in range(rows)]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case (fewer for big batches)")
    parser.add_argument("--name", default="controller", help="results file stem under benchmarks/results/")
    args = parser.parse_args(argv)
    if any(s < 1 or s > 256 for s in args.sizes_mb):
        parser.error("--sizes-mb must be between 1 and 256 (the local object store holds 512 MiB)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import ray

    init_local_ray(NUM_WORKERS, log_to_driver=False)
    pool = ResourcePool(devices=NUM_WORKERS, name="bench")
    group = WorkerGroup(pool, EchoWorker, layout=ParallelLayout(dp=NUM_WORKERS), init_megatron=False)
    plain = [ray.remote(PlainEcho).options(num_cpus=0).remote() for _ in range(NUM_WORKERS)]
    ray.get([a.noop.remote() for a in plain])

    rows = []
    group_s, plain_s = timed_pair(group.noop, lambda: ray.get([a.noop.remote() for a in plain]), args.repeats * 5)
    rows.append({"case": "empty call", "mb": 0, "hybridrl_ms": group_s * 1e3, "plain_ray_ms": plain_s * 1e3,
                 "ratio": group_s / plain_s, "plain_tensors_ms": None})
    for megabytes in args.sizes_mb:
        batch = make_batch(megabytes)
        shards = batch.chunk(NUM_WORKERS)
        tensor_shards = [dict(s.tensors.items()) for s in shards]
        repeats = max(3, args.repeats // max(1, megabytes // 8))
        check = group.echo(batch)
        assert check.equals(batch), "echo through the group changed the batch"
        group_s, plain_s = timed_pair(
            lambda: group.echo(batch),
            lambda: Batch.concat(ray.get([a.echo.remote(s) for a, s in zip(plain, shards)])), repeats)
        # Ray's default tensor pickling is ~100x slower at 128 MB: a single sample is enough there
        tensors_s = timed(lambda: ray.get([a.echo.remote(s) for a, s in zip(plain, tensor_shards)]),
                          repeats if megabytes <= 16 else 1)
        rows.append({"case": f"Batch {megabytes} MB", "mb": megabytes, "hybridrl_ms": group_s * 1e3,
                     "plain_ray_ms": plain_s * 1e3, "ratio": group_s / plain_s, "plain_tensors_ms": tensors_s * 1e3})
        del batch, shards, tensor_shards, check

    for row in rows:
        print(f"{row['case']:>14}: hybridrl {row['hybridrl_ms']:8.2f} ms   plain ray.get {row['plain_ray_ms']:8.2f} ms"
              f"   ratio {row['ratio']:.2f}x"
              + (f"   (plain ray, dict of tensors: {row['plain_tensors_ms']:.2f} ms)" if row["plain_tensors_ms"] else ""))
    meta = default_meta() | {
        "workers": NUM_WORKERS, "device": "CPU (Ray fake GPUs, gloo)", "ray": ray.__version__,
        "torch": torch.__version__, "statistic": "median of timed calls after one warm-up; hybridrl and plain_ray calls alternated",
        "hybridrl": "WorkerGroup call (ONE_TO_ALL no-op; DP_COMPUTE echo: split in 4, collect, concat)",
        "plain_ray": "ray.get of the same calls on bare Ray actors with the same Batch shards (+ Batch.concat)",
        "plain_tensors": "the same shards as dicts of torch tensors (Ray's default tensor pickling), no concat",
    }
    paths = write_results(args.name, rows, meta,
                          ["case", "hybridrl_ms", "plain_ray_ms", "ratio", "plain_tensors_ms"])
    print("wrote", *paths)
    pool.shutdown()
    shutdown_ray()
    return 0


if __name__ == "__main__":
    sys.exit(main())
