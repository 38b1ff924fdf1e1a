"""`hybridrl train [CONFIG.yaml] [key=value ...]`: run an RL algorithm from an OmegaConf config.

Without CONFIG it runs the embedded default (configs/remax_tiny.yaml): ReMax on a tiny Llama on CPU, actor
training at TP=2 and generating at TP=1 on a local Ray cluster. The whole config is checked before Ray or
any worker starts; the run folder (printed first) gets config.yaml, metrics.jsonl, TensorBoard events and
curves.png.
"""
from __future__ import annotations

import argparse
import logging
import sys

from hybridrl.config import CONFIG_DIR, ConfigError, load_config, to_yaml

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = CONFIG_DIR / "remax_tiny.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None,
                        help=f"YAML config (a path or a file under configs/); default: {DEFAULT_CONFIG.name}")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.steps=10 actor.parallel.tp=1")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def _split(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # `hybridrl train key=value` with no config file
        overrides.insert(0, config)
        config = None
    return config, overrides


def run(args: argparse.Namespace) -> int:
    from hybridrl.trainer.loop import NonFiniteError, RLTrainer, run_dir_for
    from hybridrl.trainer.plan import plan_run
    from hybridrl.trainer.tracking import MetricsTracker

    config, overrides = _split(args)
    try:
        cfg = load_config(config or DEFAULT_CONFIG, overrides)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        plan = plan_run(cfg)
        trainer = RLTrainer(cfg, plan)
    except ConfigError as exc:
        print(f"hybridrl train: config error: {exc}", file=sys.stderr)
        return 2
    run_dir = run_dir_for(cfg)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    print(f"run folder: {run_dir}", flush=True)
    roles = ", ".join(f"{r.name}@{r.pool}({r.layout.describe()})" for r in plan.roles.values())
    print(f"{cfg.algorithm.name}: {roles}; rollout {cfg.rollout.engine} tp={cfg.rollout.tp}", flush=True)
    tracker = MetricsTracker(run_dir, backends=list(cfg.trainer.trackers), project=cfg.trainer.project,
                             config=cfg, total_steps=cfg.trainer.steps)
    try:
        trainer.start()
        trainer.fit(tracker)
    except NonFiniteError as exc:
        print(f"hybridrl train: stopped: {exc}", file=sys.stderr)
        return 3
    finally:
        trainer.close()
        tracker.plot()
        tracker.close()
    print(f"done: {trainer.step} steps; metrics in {run_dir / 'metrics.jsonl'}", flush=True)
    return 0
