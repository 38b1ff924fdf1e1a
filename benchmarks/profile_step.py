"""Where one RL step's time goes: py-spy samples of the driver and of every Ray worker during measured steps.

Runs a config in this process (hybridrl.trainer RLTrainer, like `hybridrl train`), takes `--warmup` steps,
then records py-spy (sampling, from outside the processes: nothing changes in the code path being
measured) on the driver and on each worker process while `--steps` steps run. The on-CPU samples are folded
into one table per process: the share of samples spent inside each function (inclusive), restricted to the
hybridrl / Megatron / torch frames that say what the step is doing, plus the trainer's own stage times.

    python benchmarks/profile_step.py                                   # the default job (ReMax tiny)
    python benchmarks/profile_step.py configs/grpo_tiny.yaml --steps 5 -- rollout.max_new_tokens=32
    hybridrl bench profile_step --top 40

Writes benchmarks/results/profile_step.{json,md} and the raw folded stacks (profile_step_<proc>.txt, open
them with speedscope or flamegraph.pl). py-spy comes with the bench extra (`pip install py-spy`); recording
another process needs ptrace rights (root, or `--cap-add SYS_PTRACE` in containers).
"""
from __future__ import annotations

import argparse
import collections
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from benchmarks._results import RESULTS_DIR, default_meta, write_results  # noqa: E402

logger = logging.getLogger("benchmarks.profile_step")
# frames worth naming in the table (the rest is Ray's and Python's plumbing)
INTERESTING = ("hybridrl/", "megatron", "core/", "torch/", "vllm/", "transformers/")


def fold(raw_file: Path, top: int) -> tuple[int, list[tuple[str, float]]]:
    """py-spy's raw (folded) stacks -> (samples, [(function location, inclusive share)])."""
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in raw_file.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        seen = set()
        for frame in stack.split(";"):
            name, _, where = frame.partition(" (")
            where = where.rstrip(")")
            path = where.rsplit(":", 1)[0]
            if not any(path.startswith(key) or f"/{key}" in path for key in INTERESTING):
                continue
            short = path.split("site-packages/")[-1].split("/work/")[-1]
            if short.startswith("core/"):  # py-spy shortens megatron/core/... to core/...
                short = "megatron/" + short
            key = f"{name} ({short})"
            if key not in seen:
                seen.add(key)
                inclusive[key] += n
    return total, [(key, n / max(total, 1)) for key, n in inclusive.most_common(top)]


def record(pids: dict[str, int], seconds: float, rate: int, out_dir: Path, native: bool = False
           ) -> dict[str, subprocess.Popen]:
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("profile_step: py-spy is not installed (pip install py-spy)")
    procs = {}
    for name, pid in pids.items():
        cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, int(round(seconds)))),
               "--rate", str(rate), "--format", "raw", *(["--native"] if native else ["--nonblocking"]),
               "--output", str(out_dir / f"{name}.txt")]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return procs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="remax_tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--native", action="store_true",
                        help="C/C++ frames too (which torch kernels run; py-spy then pauses the process per sample)")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = parser.parse_intermixed_args()  # options may sit between config and overrides
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from hybridrl.config import load_config
    from hybridrl.trainer.loop import RLTrainer
    from hybridrl.trainer.plan import plan_run

    overrides = ["trainer.progress_bar=false", "trainer.trackers=[]",
                 f"trainer.steps={args.warmup + 2 * args.steps + 2}"] + list(args.overrides)
    cfg = load_config(args.config, overrides)
    trainer = RLTrainer(cfg, plan_run(cfg))
    out_dir = Path(args.out_dir)
    raw_dir = Path(tempfile.mkdtemp(prefix="profile_step_"))
    try:
        trainer.start()
        for _ in range(args.warmup):
            trainer.train_step()
        # one timed step sizes the recording window
        start = time.perf_counter()
        history = [trainer.train_step()]
        per_step = time.perf_counter() - start
        pids = {"driver": os.getpid()}
        for role, obj in trainer.roles.items():
            group = getattr(obj, "group", None)
            for rank, info in enumerate(group.worker_info if group is not None else []):
                pids.setdefault(f"worker_rank{rank}", info["pid"])  # colocated roles share a process
        window = per_step * args.steps
        procs = record(pids, window, args.rate, raw_dir, args.native)
        time.sleep(0.5)  # py-spy attaches
        deadline = time.perf_counter() + window
        while time.perf_counter() < deadline:
            history.append(trainer.train_step())
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=window + 60)
            if proc.returncode != 0:
                logger.warning("py-spy on %s failed: %s", name, err.decode(errors="replace").strip()[-300:])
    finally:
        trainer.close()
    stages = sorted({k for h in history for k in h if k.startswith("time/")})
    stage_rows = [{"stage": k, "median_s": statistics.median(h.get(k, 0.0) for h in history)} for k in stages]
    rows = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in pids:
        raw = raw_dir / f"{name}.txt"
        if not raw.is_file():
            continue
        shutil.copy(raw, out_dir / f"profile_step_{name}.txt")
        samples, table = fold(raw, args.top)
        rows += [{"process": name, "samples": samples, "function": key, "share": round(share, 4)}
                 for key, share in table]
    shutil.rmtree(raw_dir, ignore_errors=True)
    meta = {**default_meta(), "config": args.config, "overrides": overrides, "steps_recorded": len(history) - 1,
            "window_s": round(window, 2), "rate_hz": args.rate, "stages": stage_rows,
            "how_to_read": "share = fraction of a process's active (on-CPU) samples spent inside the function "
                           "(inclusive); samples / (rate x window) is how busy the process was"}
    write_results("profile_step", rows, meta, columns=["process", "function", "share", "samples"],
                  out_dir=out_dir)
    for row in stage_rows:
        print(f"{row['stage']:<24} {row['median_s']:.3f} s")
    for row in rows:
        print(f"{row['process']:<14} {row['share']:6.1%}  {row['function']}")


if __name__ == "__main__":
    main()
