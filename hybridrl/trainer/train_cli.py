"""`hybridrl train [CONFIG.yaml] [key=value ...]`: run an RL algorithm from an OmegaConf config.

Without CONFIG it runs the embedded default (configs/remax_tiny.yaml): ReMax on a tiny Llama on CPU, actor
training at TP=2 and generating at TP=1 on a local Ray cluster. The whole config is checked before Ray or
any worker starts; the run folder (printed first) gets config.yaml, metrics.jsonl, TensorBoard events and
curves.png.

Checkpoints and recovery (trainer.*): save_every=K writes RUN/ckpt/step_N every K steps (keep_last kept;
see trainer/checkpoint.py); resume=auto continues RUN (trainer.run_dir) from its latest complete checkpoint,
resume=PATH from a given one (a step_N folder, a ckpt folder or a run folder); max_restarts=R recovers from R
dead workers (roles torn down, restarted, latest checkpoint reloaded). Exit codes: 2 config / checkpoint
error, 3 non-finite step with on_nan=stop, 4 workers died more than max_restarts times.
"""
from __future__ import annotations

import argparse
import json
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


def _check_checkpointing(cfg) -> None:
    """trainer.save_every / keep_last / max_restarts / resume, checked before any worker starts."""
    tr = cfg.trainer
    if tr.save_every < 0:
        raise ConfigError(f"trainer.save_every={tr.save_every} must be >= 0 (0: no checkpoints)")
    if tr.keep_last < 1:
        raise ConfigError(f"trainer.keep_last={tr.keep_last} must be >= 1 (checkpoints kept)")
    if tr.max_restarts < 0:
        raise ConfigError(f"trainer.max_restarts={tr.max_restarts} must be >= 0")
    if tr.max_restarts > 0 and not tr.save_every:
        logger.warning("trainer.max_restarts=%d without trainer.save_every: a recovered run starts over from "
                       "step 0", tr.max_restarts)
    if tr.resume == "auto" and tr.run_dir is None:
        raise ConfigError("trainer.resume=auto looks for checkpoints in trainer.run_dir; set trainer.run_dir=RUN "
                          "(the folder of the run to continue)")


def _resume_target(cfg) -> tuple[object, object]:
    """(run folder, checkpoint to resume from or None). Resuming from a PATH without trainer.run_dir
    continues in that checkpoint's run folder."""
    from pathlib import Path

    from hybridrl.trainer.checkpoint import CKPT_DIR, CheckpointNotFoundError, resolve_resume
    from hybridrl.trainer.loop import run_dir_for

    tr = cfg.trainer
    if tr.resume not in ("never", "auto") and tr.run_dir is None:
        try:
            checkpoint = resolve_resume(tr.resume, ".")
        except CheckpointNotFoundError as exc:
            raise ConfigError(str(exc)) from None
        run_dir = checkpoint.parent.parent if checkpoint.parent.name == CKPT_DIR else Path(tr.resume)
        return run_dir.resolve(), checkpoint
    run_dir = run_dir_for(cfg)
    try:
        return run_dir, resolve_resume(tr.resume, run_dir)
    except CheckpointNotFoundError as exc:
        raise ConfigError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from hybridrl.models.config import CheckpointError
    from hybridrl.trainer.loop import NonFiniteError, RestartsExhaustedError, RLTrainer
    from hybridrl.trainer.plan import plan_run
    from hybridrl.trainer.tracking import MetricsTracker

    config, overrides = _split(args)
    auto_map = None
    try:
        cfg = load_config(config or DEFAULT_CONFIG, overrides)
        if cfg.resources.auto_map:  # choose pools and layouts for this machine (hybridrl/automap/apply.py)
            from hybridrl.automap.apply import apply_auto_map

            auto_map = apply_auto_map(cfg)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        plan = plan_run(cfg)
        _check_checkpointing(cfg)
        trainer = RLTrainer(cfg, plan)
        run_dir, resume_from = _resume_target(cfg)
    except ConfigError as exc:
        print(f"hybridrl train: config error: {exc}", file=sys.stderr)
        return 2
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    print(f"run folder: {run_dir}", flush=True)
    if auto_map is not None:
        (run_dir / "auto_map.json").write_text(json.dumps(auto_map, indent=1))
        best = auto_map["best"]
        print(f"auto_map: {best['label']} ({best['kind']}), modelled {best['estimate']['step_s']:.3f} s/step on "
              f"{auto_map['machine']}", flush=True)
    roles = ", ".join(f"{r.name}@{r.pool}({r.layout.describe()})" for r in plan.roles.values())
    print(f"{cfg.algorithm.name}: {roles}; rollout {cfg.rollout.engine} tp={cfg.rollout.tp}", flush=True)
    tracker = MetricsTracker(run_dir, backends=list(cfg.trainer.trackers), project=cfg.trainer.project,
                             config=cfg, total_steps=cfg.trainer.steps)
    if resume_from is not None:
        print(f"resuming from {resume_from}", flush=True)
    try:
        trainer.run(tracker, run_dir, resume_from)
    except NonFiniteError as exc:
        print(f"hybridrl train: stopped: {exc}", file=sys.stderr)
        return 3
    except RestartsExhaustedError as exc:
        print(f"hybridrl train: stopped: {exc}", file=sys.stderr)
        return 4
    except CheckpointError as exc:
        print(f"hybridrl train: checkpoint error: {exc}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
        tracker.plot()
        tracker.close()
    print(f"done: {trainer.step} steps; metrics in {run_dir / 'metrics.jsonl'}", flush=True)
    return 0
