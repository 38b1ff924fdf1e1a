"""Which OpenMP settings hybridrl's CPU workers run fastest with (issue 34: "hybridrl sets its own best thread /
wait settings by default"): the peer job of benchmarks/peer_job.py (GRPO, 16 prompts x 4 samples, 32 new tokens,
fp32, tp1, native engine), hybridrl's side only, once per variant of its environment, rounds interleaved
(the order reverses every round). tokens/s over steps 2..N; each variant's ratio is to `default` in the same round.

Variants: `default` (no threading variable: libgomp's own wait policy, torch's threads = the node's cores / its
workers, which hybridrl's WorkerHost sets), `passive` (OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep at
once), `active` (OMP_WAIT_POLICY=ACTIVE: they spin). A variant that beat `default` in every round would belong
in hybridrl's worker defaults.

    python benchmarks/thread_settings.py                 # small and 25m, 2 rounds -> results/thread_settings.*
    python benchmarks/thread_settings.py --sizes small --rounds 1
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS_DIR, write_results  # noqa: E402
from peer_job import DEFAULT_SHAPE, SIZES, prepare_job, run_hybridrl, wait_for_quiet  # noqa: E402

logger = logging.getLogger("benchmarks.thread_settings")
VARIANTS: dict[str, dict[str, str]] = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
                                       "active": {"OMP_WAIT_POLICY": "ACTIVE"}}
STEPS = {"small": 10, "25m": 5}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,25m")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    if any(s not in SIZES for s in sizes) or any(v not in VARIANTS for v in variants) or "default" not in variants:
        parser.error(f"--sizes from {list(SIZES)}; --variants from {list(VARIANTS)}, default among them")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="thread-settings-") as tmp:
        for rnd in range(args.rounds):
            for size in sizes:
                job = prepare_job(size)
                by_variant = {}
                for variant in (variants if rnd % 2 == 0 else variants[::-1]):
                    busy = wait_for_quiet(15.0, 300.0)
                    row = run_hybridrl(job, size, DEFAULT_SHAPE, "tp1", STEPS[size], Path(tmp), 1800.0,
                                       f"{size}-{variant}-r{rnd}", extra_env=VARIANTS[variant])
                    if row["status"] != "ok":
                        raise RuntimeError(f"{variant} at {size}: {row['status']} {row.get('error', '')}")
                    by_variant[variant] = {"size": size, "variant": variant, "round": rnd + 1,
                                           "env": " ".join(f"{k}={v}" for k, v in VARIANTS[variant].items()) or "-",
                                           "tokens_per_s": row["tokens_per_s"], "step_s": row["step_s"],
                                           "generation_s": row["stages_s"].get("generation"),
                                           "update_s": row["stages_s"].get("actor_update"), "busy_before_pct": busy}
                    logger.info("[%s round %d] %s: %.0f tokens/s", size, rnd + 1, variant, row["tokens_per_s"])
                base = by_variant["default"]["tokens_per_s"]
                for variant in variants:
                    rows.append({**by_variant[variant], "vs_default": by_variant[variant]["tokens_per_s"] / base})
    meta = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU", "steps": STEPS,
            "job": "peer job, 16 prompts x 4 samples, 32 new tokens, fp32, tp1, native engine"}
    _, md_path = write_results("thread_settings", rows, meta=meta,
                               out_dir=args.out_dir,
                               columns=["size", "variant", "round", "env", "tokens_per_s", "vs_default", "step_s",
                                        "generation_s", "update_s", "busy_before_pct"])
    print(Path(md_path).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
