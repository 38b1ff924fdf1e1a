"""`hybridrl train [CONFIG.yaml] [key=value ...]`: run an RL algorithm from an OmegaConf config.

Without CONFIG it runs the embedded default (configs/remax_tiny.yaml): ReMax on a tiny Llama on CPU, actor
training at TP=2 and generating at TP=1 on a local Ray cluster. The whole config is checked before Ray or
any worker starts; the run folder (printed first) gets config.yaml, metrics.jsonl, TensorBoard events and
curves.png.

Checkpoints and recovery (trainer.*): save_every=K writes RUN/ckpt/step_N every K steps (keep_last kept;
see trainer/checkpoint.py); resume=auto continues RUN (trainer.run_dir) from its latest complete checkpoint,
resume=PATH from a given one (a step_N folder, a ckpt folder or a run folder); max_restarts=R recovers from R
dead workers (roles torn down, restarted, latest checkpoint reloaded). SIGINT / SIGTERM stop the run: the
workers are closed, a save in progress is discarded, and the last checkpoint is named. Exit codes: README's
"Exit codes" table (EXIT_CODES below).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from hybridrl.automap.apply import apply_auto_map
from hybridrl.config import CONFIG_DIR, ConfigError, MachineError, load_config, to_yaml
from hybridrl.trainer.run_lock import lock_run_dir
from hybridrl.trainer.tracking import MetricsTracker

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = CONFIG_DIR / "remax_tiny.yaml"

# what `hybridrl train` exits with (README "Exit codes"); interrupted runs exit 128 + the signal number
EXIT_CODES = {"done": 0, "failed": 1, "config": 2, "non_finite": 3, "restarts_exhausted": 4, "machine": 5, "sigint": 130, "sigterm": 143}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None,
                        help=f"YAML config (a path or a file under configs/); default: {DEFAULT_CONFIG.name}")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.steps=10 actor.parallel.tp=1")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--check", action="store_true",
                        help="check the config, the data and the machine as a run would, then exit (no Ray, no worker)")


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


CPU_DEVICES_PER_CORE = 4  # CPU "devices" are Megatron worker processes sharing the cores
CPU_DEVICE_GIB = 1.5  # resident memory of one worker with the Ray core and torch, before any model


def cpu_device_limit(cores: int, memory_gib: float) -> int:
    """How many CPU devices (worker processes) a machine without GPUs runs: 4 per core and 1.5 GiB each,
    after 2 GiB for the driver and Ray's daemons; never below 2 (the default job)."""
    return max(2, min(CPU_DEVICES_PER_CORE * cores, int((memory_gib - 2) / CPU_DEVICE_GIB)))


def _check_fits_machine(cfg, devices: int) -> None:
    """A local run's devices exist on this machine: GPUs counted, CPU devices within cpu_device_limit."""
    import torch

    if cfg.resources.ray_address is not None:
        return  # an existing cluster: ensure_ray compares with what it declares
    if torch.cuda.is_available():
        have = torch.cuda.device_count() * cfg.resources.nodes
        if devices > have:
            raise ConfigError(f"resources.devices={devices}: this machine has {torch.cuda.device_count()} GPU(s); "
                              f"lower resources.devices or join a cluster with resources.ray_address")
        return
    cores = len(os.sched_getaffinity(0))
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    limit = cpu_device_limit(cores, memory_gib)
    if devices > limit:
        raise ConfigError(f"resources.devices={devices}: without GPUs each device is a worker process; {cores} "
                          f"core(s) and {memory_gib:.0f} GiB run at most {limit} ({CPU_DEVICES_PER_CORE} per core, "
                          f"{CPU_DEVICE_GIB} GiB each); lower resources.devices or run on GPUs")


def _resume_target(cfg) -> tuple[object, object]:
    """(run folder, checkpoint to resume from or None). Resuming from a PATH without trainer.run_dir
    continues in that checkpoint's run folder."""
    from pathlib import Path

    # start-up time: torch; every `hybridrl` command imports this module with its parser
    from hybridrl.trainer.checkpoint import CKPT_DIR, CheckpointNotFoundError, resolve_resume
    from hybridrl.trainer.run import run_dir_for

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


def _no_space(exc: BaseException) -> bool:
    """ENOSPC anywhere in the error, including a worker's remote traceback (Megatron's checkpoint writer
    wraps it in a CheckpointException that only its traceback explains)."""
    import errno

    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    text = str(exc) + getattr(exc, "remote_traceback", "")
    return os.strerror(errno.ENOSPC) in text or (exc.__cause__ is not None and _no_space(exc.__cause__))


def _log_error(run_dir, exc: BaseException) -> str:
    """Write the full traceback (with a worker's remote one) to RUN/error.log; the error's first line."""
    import traceback

    log = run_dir / "error.log"
    try:
        log.write_text("".join(traceback.format_exception(exc)))
    except OSError:  # a full disk: the message alone
        return str(exc).splitlines()[0]
    return f"{str(exc).splitlines()[0]} (traceback in {log})"


def _interrupted(exc, steps_done: int, run_dir) -> str:
    """The one line an interrupted run ends with; a save cut off half-way is removed first."""
    from hybridrl.trainer.checkpoint import CheckpointManager  # start-up time: torch (see _resume_target)

    checkpoints = CheckpointManager(run_dir)
    checkpoints.discard_partial()
    latest = checkpoints.latest()
    where = f"last checkpoint: {latest}; resume with trainer.resume=auto trainer.run_dir={run_dir}" if latest \
        else "no checkpoint was saved (set trainer.save_every=K to be able to resume)"
    return f"interrupted ({exc.name}) at step {steps_done + 1}; {where}"


def run(args: argparse.Namespace) -> int:
    # start-up time: torch and the trainer load for a run, not for every `hybridrl` command's parser
    from hybridrl.trainer.loop import RLTrainer
    from hybridrl.trainer.plan import plan_run

    config, overrides = _split(args)
    try:
        cfg = load_config(config or DEFAULT_CONFIG, overrides)
        auto_map = apply_auto_map(cfg) if cfg.resources.auto_map else None  # pools and layouts for this machine
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        plan = plan_run(cfg)
        _check_fits_machine(cfg, sum(plan.pools.values()))
        _check_checkpointing(cfg)
        trainer = RLTrainer(cfg, plan)
        if getattr(args, "check", False):
            _check_user_code(cfg, plan, trainer.loader.dataset)
            print(f"config ok: {cfg.algorithm.name}, {len(trainer.loader.dataset)} prompts, "
                  + ", ".join(f"{r.name}@{r.pool}({r.layout.describe()})" for r in plan.roles.values()))
            return EXIT_CODES["done"]
        run_dir, resume_from = _resume_target(cfg)
        lock_run_dir(run_dir)
        tracker = _open_run_folder(run_dir, cfg, plan, auto_map)
    except ConfigError as exc:
        print(f"hybridrl train: config error: {exc}", file=sys.stderr)
        return EXIT_CODES["config"]
    except MachineError as exc:
        print(f"hybridrl train: {exc}", file=sys.stderr)
        return EXIT_CODES["machine"]
    if resume_from is not None:
        print(f"resuming from {resume_from}", flush=True)
    return _train(cfg, trainer, tracker, run_dir, resume_from)


def _check_user_code(cfg, plan, dataset) -> None:
    """--check runs the user's code once on the first prompt row: the reward (and cost) function on a sample
    response, the environment's reset. A function that raises or returns no number is a config error."""
    # start-up time: torch (see run)
    from hybridrl.envs import make_env
    from hybridrl.workers.rule_reward import RewardFunctionError, RuleReward

    row = dataset[0]
    sample = str(row.metadata.get("answer", "")) or "a sample response"
    for option, path in (("reward.fn", plan.reward_fn), ("reward.cost_fn", plan.cost_fn)):
        if path:
            try:
                RuleReward(path).score([row.text], [sample], [row.metadata])
            except RewardFunctionError as exc:
                raise ConfigError(f"{option}: {exc} (--check calls it on the first prompt row)") from None
    if cfg.rollout.env:
        try:
            make_env(cfg.rollout.env, **dict(cfg.rollout.env_kwargs)).reset({"prompt": row.text, **row.metadata})
        except Exception as exc:  # noqa: BLE001 - user code: one line naming it
            raise ConfigError(f"rollout.env={cfg.rollout.env}: reset raised {type(exc).__name__}: {exc} on the "
                              f"first prompt row (--check)") from None


def _open_run_folder(run_dir, cfg, plan, auto_map) -> MetricsTracker:
    """config.yaml, auto_map.json and the trackers' files in the run folder (a full disk: MachineError)."""
    try:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        print(f"run folder: {run_dir}", flush=True)
        if auto_map is not None:
            (run_dir / "auto_map.json").write_text(json.dumps(auto_map, indent=1))
            best = auto_map["best"]
            print(f"auto_map: {best['label']} ({best['kind']}), modelled {best['estimate']['step_s']:.3f} s/step on "
                  f"{auto_map['machine']}", flush=True)
        roles = ", ".join(f"{r.name}@{r.pool}({r.layout.describe()})" for r in plan.roles.values())
        print(f"{cfg.algorithm.name}: {roles}; rollout {cfg.rollout.engine} tp={cfg.rollout.tp}", flush=True)
        return MetricsTracker(run_dir, backends=list(cfg.trainer.trackers), project=cfg.trainer.project,
                              config=cfg, total_steps=cfg.trainer.steps)
    except OSError as exc:
        raise MachineError.writing(run_dir, exc) from None


def _train(cfg, trainer, tracker, run_dir, resume_from) -> int:
    """Train, close the workers, and end with one line (exit codes: EXIT_CODES)."""
    # start-up time: torch and Ray (see run)
    from hybridrl.controller import interrupts
    from hybridrl.trainer.run import run_training

    failure, closed = None, True
    # the stop handler stays ours until the last line, so a late copy of the stop is not Ray's sys.exit(15)
    with interrupts.stop_on_signals(_signal_deferral(cfg.trainer)):
        try:
            _start_ray(trainer)
            run_training(trainer, tracker, run_dir, resume_from)
            interrupts.raise_pending()  # a signal during the last step's bookkeeping
        except BaseException as exc:  # noqa: BLE001 - known stops become one line below, the rest is re-raised
            failure = exc
        finally:
            closed = _close(trainer, failure)
            try:
                tracker.plot()
                tracker.close()
            except OSError as exc:  # a full disk: said below, after the failure that came first
                failure = failure or MachineError.writing(run_dir, exc)
        return _last_line(trainer, failure, closed, run_dir)


def _start_ray(trainer) -> None:
    """Start or join Ray, then put the stop handler back over the one Ray's init installs (`sys.exit(15)`); a
    SIGTERM that comes while Ray's is current is this run's stop all the same."""
    # start-up time: Ray (hybridrl.controller's package imports it; see run)
    from hybridrl.controller.interrupts import Interrupted, rearm

    try:
        trainer.start_ray()
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        raise Interrupted(signal.SIGTERM) from None
    rearm()


def _last_line(trainer, failure: BaseException | None, closed: bool, run_dir) -> int:
    """The run's last line and exit code (EXIT_CODES); an unexpected error is re-raised."""
    if failure is None:
        print(f"done: {trainer.step} steps; metrics in {run_dir / 'metrics.jsonl'}", flush=True)
        return EXIT_CODES["done"]
    # the last line of the run, after the workers are gone (their shutdown logs come before it)
    outcome = _outcome(failure, trainer.step, run_dir)
    if outcome is None:
        raise failure
    code, message = outcome
    print(f"hybridrl train: {message}", file=sys.stderr, flush=True)
    if not closed:  # Ray is dead or would not close: its exit hooks would wait a minute for its GCS
        sys.stdout.flush()
        os._exit(code)
    return code


SHUTDOWN_RESERVE_S = 10.0  # of trainer.signal_grace_s: closing the workers and writing the last line
CLOSE_LIMIT_S = 10.0  # an interrupted run that cannot close its workers in this long abandons them


def _signal_deferral(tr) -> float | None:
    """With trainer.save_on_signal, how long a stop signal may wait for the step in flight and its save."""
    return max(0.0, tr.signal_grace_s - SHUTDOWN_RESERVE_S) if tr.save_on_signal else None


def _close(trainer, failure: BaseException | None) -> bool:
    """Close the workers. After a stop signal, within CLOSE_LIMIT_S and only while Ray still answers (a signal
    sent to every process of a job, as Slurm and systemd do, kills Ray's daemons too): otherwise the local
    cluster is abandoned (its processes killed, its temp folder removed) and False is returned."""
    import threading

    # start-up time: Ray (see run)
    from hybridrl.controller.interrupts import Interrupted
    from hybridrl.controller.ray_cluster import abandon_local_cluster, ray_alive

    if not isinstance(failure, Interrupted):
        trainer.close()
        return True
    if ray_alive():
        closing = threading.Thread(target=trainer.close, name="close-after-signal", daemon=True)
        closing.start()
        closing.join(CLOSE_LIMIT_S)
        if not closing.is_alive():
            return True
        logger.warning("the workers did not close within %.0f s of the stop signal; killing them", CLOSE_LIMIT_S)
    abandon_local_cluster()
    return False


def _outcome(exc: BaseException, steps_done: int, run_dir) -> tuple[int, str] | None:
    """Exit code and one line for a run that did not finish; None for an unexpected error."""
    # start-up time: torch (see run)
    from hybridrl.controller import WorkerError
    from hybridrl.controller.interrupts import Interrupted
    from hybridrl.models.config import CheckpointError
    from hybridrl.trainer.loop import NonFiniteError
    from hybridrl.trainer.run import RestartsExhaustedError
    from hybridrl.envs.base import EnvironmentStepError
    from hybridrl.workers.rule_reward import RewardFunctionError

    if isinstance(exc, Interrupted):
        return exc.exit_code, _interrupted(exc, steps_done, run_dir)
    if isinstance(exc, MachineError):  # a full disk during a save, Ray that could not start on this machine
        return EXIT_CODES["machine"], str(exc)
    if isinstance(exc, NonFiniteError):
        return EXIT_CODES["non_finite"], f"stopped: {exc}"
    if isinstance(exc, RestartsExhaustedError):
        return EXIT_CODES["restarts_exhausted"], f"stopped: {exc}"
    if isinstance(exc, CheckpointError):
        return EXIT_CODES["config"], f"checkpoint error: {exc}"
    if _no_space(exc):  # a checkpoint or log write on a full disk (a worker's error or the driver's own)
        return EXIT_CODES["machine"], (f"no space left on device while writing to {run_dir} at step "
                                       f"{steps_done + 1} ({_log_error(run_dir, exc)}); free space or point "
                                       "trainer.run_dir at a larger disk, then trainer.resume=auto")
    if isinstance(exc, WorkerError):  # the first failing rank; its peers were killed, not waited out
        return EXIT_CODES["failed"], f"{_log_error(run_dir, exc)} at step {steps_done + 1}"
    if isinstance(exc, (RewardFunctionError, EnvironmentStepError)):  # user code: named with the row; traceback logged
        return EXIT_CODES["config"], _log_error(run_dir, getattr(exc, "cause", None) or exc)
    return None
