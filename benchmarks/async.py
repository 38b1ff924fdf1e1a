"""Asynchronous RL: step time and the share of generation hidden behind training, sync vs one-step-off vs async.

One run, one local Ray cluster, the tiny ReMax job of configs/remax_async_tiny.yaml (actor + reference on a
2-device pool, generation on a 1-device pool of its own) in four modes, each for --steps steps:

    colocated     rollout.pool = the actor's: the 3D-HybridEngine, no overlap (the default of `hybridrl train`)
    sync          generation on its own pool, weights over the bridge, no overlap (trainer.mode=sync)
    one_step_off  the next batch generates while this one trains (staleness 1)
    async         two batches ahead (algorithm.max_staleness=2)
    one_step_off_partial  one-step-off with rollout.partial: a generation still running when the weights are
                  sent takes them at once (its sequences resume with them; staleness counted per token)

Per mode (mean over steps 2..N): s/step, the trainer's wait for generation (time/generation), the actor update,
the weight sync, generation idle time on the rollout pool, staleness. "hidden" is the share of the sync mode's
generation wait that the mode no longer waits for. On this 2-core CPU both pools share the same two cores, so an
overlap cannot shorten the step much; the GPU projection uses the sync mode's stage times on separate devices:
sync = generation + training + weight sync, overlapped = max(generation, training) + weight sync (assumptions:
no contention between the pools, the same stage times on the GPU as measured here relative to each other).

    python benchmarks/async.py              # writes benchmarks/results/async.{json,md}
    python benchmarks/async.py --steps 4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _results import default_meta, write_results  # noqa: E402

MODES = {
    "colocated": ["rollout.pool=default", "trainer.mode=sync"],
    "sync": ["trainer.mode=sync"],
    "one_step_off": ["trainer.mode=one_step_off"],
    "async": ["trainer.mode=async", "algorithm.max_staleness=2"],
    "one_step_off_partial": ["trainer.mode=one_step_off", "rollout.partial=true"],
}
COLUMNS = ["mode", "steps", "s_per_step", "wait_s", "actor_update_s", "weight_sync_s", "generation_idle_s",
           "staleness_mean", "partial_resumed", "hidden", "reward_last", "projected_gpu_s_per_step", "projected_speedup"]


def run_mode(name: str, steps: int) -> list[dict]:
    from hybridrl.config import load_config
    from hybridrl.trainer.loop import RLTrainer
    from hybridrl.trainer.plan import plan_run

    cfg = load_config("remax_async_tiny.yaml", [f"trainer.steps={steps}", *MODES[name]])
    trainer = RLTrainer(cfg, plan_run(cfg))
    try:
        trainer.start()
        return [trainer.train_step() for _ in range(steps)]
    finally:
        trainer.close()


def summarise(name: str, history: list[dict]) -> dict:
    tail = history[1:] or history

    def mean(key: str) -> float:
        return sum(m.get(key, 0.0) for m in tail) / len(tail)

    return {"mode": name, "steps": len(history), "s_per_step": mean("time/step"), "wait_s": mean("time/generation"),
            "actor_update_s": mean("time/actor_update"), "weight_sync_s": mean("time/weight_sync"),
            "generation_idle_s": mean("async/generation_idle_s"), "staleness_mean": mean("async/staleness_mean"),
            "partial_resumed": mean("async/partial_resumed"), "reward_last": history[-1]["reward_mean"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    from hybridrl.controller import init_local_ray, shutdown_ray

    meta = {**default_meta(), "job": "configs/remax_async_tiny.yaml (tiny Llama, 16 prompts x 4, 16 new tokens)",
            "steps": args.steps}
    init_local_ray(3)
    rows = []
    try:
        for name in args.modes:
            rows.append(summarise(name, run_mode(name, args.steps)))
            print(rows[-1], flush=True)
    finally:
        shutdown_ray()
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    if sync is not None:
        generation = sync["wait_s"]
        training = sync["s_per_step"] - generation - sync["weight_sync_s"]
        serial = generation + training + sync["weight_sync_s"]
        for row in rows:
            row["hidden"] = 1.0 - row["wait_s"] / generation if generation > 0 else 0.0
            overlapped = row["mode"] not in ("colocated", "sync")
            row["projected_gpu_s_per_step"] = (max(generation, training) if overlapped else generation + training) \
                + (row["weight_sync_s"] if row["mode"] != "colocated" else 0.0)
            row["projected_speedup"] = serial / row["projected_gpu_s_per_step"]
        meta["projection"] = (f"from the sync row: generation {generation:.3f} s, training {training:.3f} s, weight "
                              f"sync {sync['weight_sync_s']:.3f} s per step; overlapped = max(generation, training) + "
                              "sync, on separate devices without contention")
    json_path, md_path = write_results("async", rows, meta, COLUMNS, args.out)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
