"""Make `tiny:opd_teacher` (the teacher of configs/opd_tiny.yaml): a 30-step GRPO run on the bundled task
(configs/grpo_tiny.yaml), exported into hybridrl's cache ($HYBRIDRL_CACHE, default ~/.cache/hybridrl).

    python scripts/make_opd_teacher.py [--steps 30] [--out DIR]
    hybridrl train opd_tiny
"""
from __future__ import annotations

import argparse

from hybridrl.controller import shutdown_ray
from hybridrl.trainer.made_teacher import TEACHER_STEPS, make_opd_teacher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=TEACHER_STEPS)
    parser.add_argument("--out", default=None, help="folder to write (default: where tiny:opd_teacher resolves)")
    args = parser.parse_args()
    try:
        folder, history = make_opd_teacher(args.out, args.steps)
    finally:
        shutdown_ray()
    print(f"teacher written to {folder}: mean reward {history[0]['reward_mean']:.2f} at step 1, "
          f"{history[-1]['reward_mean']:.2f} at step {len(history)}")


if __name__ == "__main__":
    main()
