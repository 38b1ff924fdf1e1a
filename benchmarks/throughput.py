"""End-to-end RL throughput: ReMax vs PPO vs GRPO on the tiny model, one run, one Ray cluster.

The paper's metric (HybridFlow §8): tokens/s = (prompt + response tokens of the step's sampled
sequences) / iteration time, with the per-stage breakdown the trainer measures every step
(time/generation, which includes time/transition; time/reward; time/old_log_probs; time/reference;
time/critic; time/actor_update; time/step). Each algorithm gets its own RLTrainer
(hybridrl/trainer/loop.py) in this one process, on its own 2-device pool of one local Ray cluster; after
a warm-up step each, the measured steps run round-robin over the algorithms (the order rotating every
round), so all of them meet the same drift in the load of a shared machine. The ratio columns are
tokens/s against ReMax measured in the same run (total tokens / total time, and median step).

All three use one workload and one layout, so only the algorithm differs: the bundled "vowels" task,
16 prompts x 4 samples a step, 16 new tokens, actor TP=2 -> rollout TP=1 on 2 CPU devices (native
engine), algorithm settings from configs/<name>_tiny.yaml (PPO: a critic, 2 epochs x 2 mini-batches;
ReMax: one extra greedy generation per prompt, whose tokens are not counted: the metric counts the
batch's sampled sequences; GRPO: KL as a loss term).

    python benchmarks/throughput.py                      # writes benchmarks/results/throughput.{json,md,png}
    python benchmarks/throughput.py --steps 3 --algorithms remax grpo --out-dir /tmp/tp
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from benchmarks._results import RESULTS_DIR, default_meta, write_results  # noqa: E402

logger = logging.getLogger("benchmarks.throughput")

ALGORITHMS = ("remax", "ppo", "grpo")
BASELINE = "remax"
# Same workload and layout for every algorithm (see the module docstring).
COMMON_OVERRIDES = ["actor.parallel.tp=2", "actor.parallel.pp=1", "rollout.tp=1", "rollout.engine=native",
                    "rollout.n=4", "rollout.max_new_tokens=16", "data.batch_size=16", "resources.devices=2",
                    "trainer.progress_bar=false", "trainer.trackers=[]"]
# Non-overlapping pieces of a step, bottom to top in the plot ("generation" here excludes the transition).
STAGES = ("transition", "generation", "reward", "old_log_probs", "reference", "critic", "actor_update", "other")


def start_trainers(algorithms: list[str], steps: int, warmup: int, extra: list[str],
                   trainers: dict[str, Any]) -> dict[str, float]:
    """Start one RLTrainer per algorithm into `trainers` (the caller closes them), each on its own pool of
    2 devices of the one Ray cluster; returns each one's start-up seconds."""
    from hybridrl.config import load_config
    from hybridrl.trainer.loop import RLTrainer
    from hybridrl.trainer.plan import plan_run

    startups: dict[str, float] = {}
    for algorithm in algorithms:
        cfg = load_config(f"{algorithm}_tiny.yaml", COMMON_OVERRIDES + [f"trainer.steps={warmup + steps}"] + extra)
        trainers[algorithm] = RLTrainer(cfg, plan_run(cfg))
        start = time.perf_counter()
        trainers[algorithm].start()
        startups[algorithm] = time.perf_counter() - start
        logger.info("%s started in %.1f s", algorithm, startups[algorithm])
    return startups


def run_interleaved(trainers: dict[str, Any], steps: int, warmup: int) -> dict[str, list[dict]]:
    """Warm-up steps, then measured steps round-robin (the order rotates every round), so that every
    algorithm meets the same drift in the machine's load."""
    names = list(trainers)
    for _ in range(warmup):
        for name in names:
            trainers[name].train_step()
    histories: dict[str, list[dict]] = {name: [] for name in names}
    for index in range(steps):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            metrics = trainers[name].train_step()
            if "skipped" in metrics:
                raise RuntimeError(f"{name}: measured step {index + 1} was skipped (non-finite rewards)")
            histories[name].append(metrics)
    return histories


def stage_seconds(metrics: dict) -> dict[str, float]:
    """One step's time split into the non-overlapping STAGES (transition is timed inside generation)."""
    transition = metrics.get("time/transition", 0.0)
    parts = {"transition": transition, "generation": metrics.get("time/generation", 0.0) - transition}
    for stage in ("reward", "old_log_probs", "reference", "critic", "actor_update"):
        parts[stage] = metrics.get(f"time/{stage}", 0.0)
    parts["other"] = max(metrics["time/step"] - sum(parts.values()), 0.0)
    return parts


def summarise(algorithm: str, history: list[dict], plan: Any, startup: float) -> dict:
    step_times = [m["time/step"] for m in history]
    tokens = [m["tokens_per_s"] * m["time/step"] for m in history]  # prompt + response tokens of the step
    row = {"algorithm": algorithm, "layout": plan.roles["actor"].layout.describe(),
           "roles": "+".join(plan.roles), "sequences_per_step": plan.rows_per_step,
           "tokens_per_step": statistics.mean(tokens),
           "tokens_per_s": sum(tokens) / sum(step_times),  # total tokens / total iteration time
           "step_s": statistics.mean(step_times), "step_s_min": min(step_times), "step_s_max": max(step_times),
           "response_length": statistics.mean(m["response_length_mean"] for m in history),
           "reward_mean": statistics.mean(m["reward_mean"] for m in history),
           "tokens_per_s_median_step": statistics.median(tokens) / statistics.median(step_times),
           "startup_s": startup, "steps": len(history), "step_s_each": step_times}
    per_step = [stage_seconds(m) for m in history]
    for stage in STAGES:
        row[f"{stage}_s"] = statistics.mean(p[stage] for p in per_step)
    row["raw_stage_means"] = {key: statistics.mean(m.get(key, 0.0) for m in history)
                              for key in sorted({k for m in history for k in m if k.startswith("time/")})}
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = [r["algorithm"] for r in rows]
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        heights = [r[f"{stage}_s"] for r in rows]
        ax.bar(names, heights, bottom=bottom, label=stage.replace("_", " "), width=0.55)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, row in enumerate(rows):
        ax.text(i, bottom[i] * 1.01, f"{row['tokens_per_s']:.0f} tok/s\n{row['vs_' + BASELINE]:.2f}x",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds per step (mean)")
    ax.set_ylim(0, max(bottom) * 1.25)
    ax.set_title("Tiny Llama, 2 CPU devices, actor TP=2 -> rollout TP=1: time per RL step")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per algorithm (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per algorithm (not measured)")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--name", default="throughput")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides for every algorithm")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if BASELINE not in args.algorithms:
        parser.error(f"--algorithms must include the baseline {BASELINE!r} (the ratios are against it)")
    bad = [item for item in args.overrides if "=" not in item]
    if bad:
        parser.error(f"overrides must be key=value, got {bad}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from hybridrl.config import load_config
    from hybridrl.controller import init_local_ray, shutdown_ray
    from hybridrl.trainer.plan import plan_run

    for algorithm in args.algorithms:  # check every config before Ray starts
        plan_run(load_config(f"{algorithm}_tiny.yaml", COMMON_OVERRIDES + args.overrides))
    load_start = os.getloadavg()[0]
    shutdown_ray()
    init_local_ray(2 * len(args.algorithms))  # one cluster for the whole run, a 2-device pool per algorithm
    trainers: dict[str, Any] = {}
    try:
        startups = start_trainers(args.algorithms, args.steps, args.warmup, list(args.overrides), trainers)
        histories = run_interleaved(trainers, args.steps, args.warmup)
        plans = {name: trainer.plan for name, trainer in trainers.items()}
    finally:
        for trainer in trainers.values():
            trainer.close()
        shutdown_ray()
    rows = [summarise(a, histories[a], plans[a], startups[a]) for a in args.algorithms]
    base = next(r for r in rows if r["algorithm"] == BASELINE)
    for row in rows:
        row[f"vs_{BASELINE}"] = row["tokens_per_s"] / base["tokens_per_s"]
        row[f"vs_{BASELINE}_median"] = row["tokens_per_s_median_step"] / base["tokens_per_s_median_step"]
    import ray
    import torch

    meta = default_meta() | {
        "load_avg_1m_at_start": round(load_start, 2),
        "metric": "tokens/s = (prompt + response tokens of the sampled sequences) / iteration time, "
                  "total over the measured steps (HybridFlow §8's metric)",
        "workload": "tiny Llama (hidden 64, 2 layers), bundled vowels task, 16 prompts x 4 samples, 16 new tokens",
        "layout": "2 CPU devices (Ray fake GPUs, gloo): actor TP=2 -> rollout TP=1 (native engine), "
                  "all roles colocated",
        "steps": f"{args.warmup} warm-up + {args.steps} measured steps per algorithm, interleaved round-robin "
                 f"(order rotating each round) so all meet the same load; one Ray cluster, a pool per algorithm",
        "stages": "mean seconds per step; generation excludes the transition (timed inside it); other = step - "
                  "the listed stages (advantages, KL controller, driver glue)",
        "overrides": " ".join(COMMON_OVERRIDES + args.overrides),
        "note": "2 shared cores, other jobs running: absolute numbers are noisy, compare within this run",
        "torch": torch.__version__, "ray": ray.__version__,
    }
    columns = ["algorithm", "layout", "roles", "steps", "tokens_per_s", f"vs_{BASELINE}",
               "tokens_per_s_median_step", f"vs_{BASELINE}_median", "step_s", "tokens_per_step",
               "response_length", *[f"{s}_s" for s in STAGES]]
    out_dir = Path(args.out_dir)
    paths = write_results(args.name, rows, meta, columns, out_dir=out_dir)
    plot(rows, out_dir / f"{args.name}.png")
    for row in rows:
        print(f"{row['algorithm']:>6}: {row['tokens_per_s']:7.0f} tok/s  {row[f'vs_{BASELINE}']:.2f}x {BASELINE}  "
              f"step {row['step_s']:.2f} s  (" + ", ".join(f"{s} {row[f'{s}_s']:.2f}" for s in STAGES) + ")")
    print("wrote", *paths, out_dir / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
