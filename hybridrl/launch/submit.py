"""A Slurm job for a multi-node run, as `hybridrl submit` (the command: hybridrl/cli/submit.py) submits it: the
request checked without the cluster (`validate`), launch/slurm/hybridrl.sbatch rendered for it (`render_script`)
and the wait for the job's end (`wait_for_job`). The checks against the cluster itself are in slurm_query.py."""
from __future__ import annotations

import argparse
import logging
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from hybridrl.bundled import IMPORT_ROOT, bundled_dir
from hybridrl.config import ConfigError, find_config, load_config
from hybridrl.launch.model_files import ModelFiles, ModelFilesError, prepare_model_files
from hybridrl.launch.slurm_query import SlurmRequestError, job_state
from hybridrl.parallel.placement import PlacementError, fit_pools

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = bundled_dir("launch") / "slurm" / "hybridrl.sbatch"
TIME_FORMAT = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}"
                         r"|UNLIMITED|INFINITE)$")
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "UNKNOWN",
                   "BOOT_FAIL", "DEADLINE"}


@dataclass
class JobCommand:
    """What the job runs on its first node once the Ray cluster is up."""

    argv: list[str]
    run_dir: Path
    trainer: bool = False  # `hybridrl train`: the job appends resources.ray_address=<its Ray head>
    resume_on_requeue: bool = False  # after a requeue (SLURM_RESTART_COUNT > 0) add trainer.resume=auto
    env: dict[str, str] = field(default_factory=dict)  # exported in the job before --env (the models' cache)
    notes: list[str] = field(default_factory=list)  # what the submitting machine could not check (a dry run)


# set by the job itself from the request and its Ray cluster; a user value would contradict them
JOB_OWNED_OVERRIDES = {"resources.ray_address": "the job's own Ray cluster",
                       "resources.nodes": "--nodes"}


def _override_value(overrides: list[str], key: str) -> str | None:
    """The last `key=value` among the overrides (OmegaConf applies them in order), else None."""
    values = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key]
    return values[-1] if values else None


def _default_run_dir(args: argparse.Namespace) -> Path:
    return Path(args.run_dir or f"runs/{args.job_name}-{datetime.now():%Y%m%d-%H%M%S}").resolve()


def _train_command(args: argparse.Namespace) -> JobCommand:
    """`hybridrl train CONFIG overrides...` for the job, with the config checked against the request: the pools
    (one Ray "GPU" per device) fit into --nodes x --gpus-per-node, each on the nodes its resources.node_devices
    names, spread evenly, or packed where it fits (_node_placement)."""
    try:
        args.config = str(find_config(args.config))  # a path, or a bundled config by name
    except ConfigError as exc:
        raise SlurmRequestError(str(exc)) from None
    overrides = list(args.overrides)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise SlurmRequestError(f"overrides must be key=value, got {bad}")
    for key, owner in JOB_OWNED_OVERRIDES.items():
        if _override_value(overrides, key) is not None:
            raise SlurmRequestError(f"override {key}=... is set by the job from {owner}; drop it")
    if args.gpus_per_node < 1:
        raise SlurmRequestError("--gpus-per-node 0: `hybridrl train` places one worker per device (a Ray GPU); "
                                "ask for at least 1 GPU per node")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        raise SlurmRequestError(f"config {args.config}: {exc}") from None
    overrides += _node_placement(cfg, args)

    models = _model_files(args, cfg)
    overrides += models.overrides  # hub ids pinned to the commit resolved here

    # one run dir for the job's logs and the trainer's metrics/checkpoints, so a requeued job finds them
    trainer_run_dir = _override_value(overrides, "trainer.run_dir")
    if trainer_run_dir is not None:
        trainer_run_dir = str(Path(trainer_run_dir).resolve())  # the job may start elsewhere
        overrides = [o for o in overrides if o.split("=", 1)[0] != "trainer.run_dir"]
    run_dir = _default_run_dir(args) if args.run_dir or trainer_run_dir is None else Path(trainer_run_dir)
    overrides.append(f"trainer.run_dir={trainer_run_dir or run_dir}")
    overrides.append(f"resources.nodes={args.nodes}")
    if _override_value(overrides, "trainer.progress_bar") is None:
        overrides.append("trainer.progress_bar=false")  # a line per step reads better in a log file
    # a requeued run continues from its latest checkpoint, unless the submission chose trainer.resume
    resume_on_requeue = args.requeue and cfg.trainer.resume == "never" \
        and _override_value(args.overrides, "trainer.resume") is None
    argv = [args.python, "-m", "hybridrl.cli", "train", str(Path(args.config).resolve()), *overrides]
    return JobCommand(argv, run_dir, trainer=True, resume_on_requeue=resume_on_requeue, env=models.env,
                      notes=models.notes)


def _model_files(args: argparse.Namespace, cfg) -> ModelFiles:
    """Every model of the config resolved on this machine (launch/model_files.py): a dry run downloads nothing;
    all nodes on one host (--ip-mode loopback) share its files."""
    mode = "staged" if args.ip_mode == "loopback" else getattr(args, "model_files", "shared")
    try:
        return prepare_model_files(cfg, mode, download=not args.dry_run)
    except ModelFilesError as exc:
        raise SlurmRequestError(str(exc)) from None


def _node_placement(cfg, args: argparse.Namespace) -> list[str]:
    """The pools placed on --nodes x --gpus-per-node (parallel/placement.py): resources.node_devices as given, even
    spreads, and a devices-per-node list for each pool that does not split evenly (packed where it fits, whole
    nodes first), passed to the trainer as overrides. Refused when the pools do not fit."""
    pools = {"default": int(cfg.resources.devices), **{str(k): int(v) for k, v in cfg.resources.pools.items()}}
    listed = {str(k): list(v) for k, v in cfg.resources.node_devices.items()}
    total, offered = sum(pools.values()), args.nodes * args.gpus_per_node
    if total > offered:
        listing = ", ".join(f"{'resources.devices' if k == 'default' else f'resources.pools.{k}'}={v}"
                            for k, v in pools.items())
        raise SlurmRequestError(f"the config's pools need {total} devices ({listing}) "
                                f"but --nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} = {offered}; "
                                "ask for more or shrink the pools")
    try:
        placed = fit_pools(pools, args.nodes, args.gpus_per_node, listed)
    except PlacementError as exc:
        raise SlurmRequestError(f"{exc} (--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node})") from None
    return [f"resources.node_devices.{pool}=[{','.join(map(str, split))}]" for pool, split in placed.items()
            if pool not in listed and pools[pool] % args.nodes]


def validate(args: argparse.Namespace) -> JobCommand:
    """Checks that need no cluster; returns the command to run and the run dir."""
    if args.nodes < 1:
        raise SlurmRequestError(f"--nodes must be >= 1, got {args.nodes}")
    if args.gpus_per_node < 0:
        raise SlurmRequestError(f"--gpus-per-node must be >= 0, got {args.gpus_per_node}")
    if args.time and not TIME_FORMAT.match(args.time):
        raise SlurmRequestError(f"--time {args.time!r} is not a Slurm time (use MINUTES, HH:MM:SS or D-HH:MM:SS)")
    for item in args.env:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", item):
            raise SlurmRequestError(f"--env {item!r} must look like KEY=VALUE")
    if args.ip_mode not in ("auto", "loopback") and not args.ip_mode.startswith("iface:") \
            and not re.match(r"^\d+\.\d+\.\d+\.\d+$", args.ip_mode):
        raise SlurmRequestError(f"--ip-mode must be auto, loopback or iface:NAME, got {args.ip_mode!r}")
    if args.ip_mode == "loopback" and args.ray_port_base is None and args.nodes > 30:
        raise SlurmRequestError("--ip-mode loopback supports at most 30 nodes")
    if args.ray_port_base is not None and not 1024 <= args.ray_port_base <= 65535 - 400 * args.nodes:
        raise SlurmRequestError(f"--ray-port-base {args.ray_port_base} leaves no room for 400 ports per node")
    if args.ray_object_store_mb is not None and args.ray_object_store_mb < 80:
        raise SlurmRequestError("--ray-object-store-mb must be >= 80 (Ray's minimum)")
    if not Path(args.template).is_file():
        raise SlurmRequestError(f"--template {args.template} does not exist")
    if args.command:
        if args.config or args.overrides:
            raise SlurmRequestError("--command replaces `hybridrl train CONFIG ...`: drop CONFIG and overrides "
                                    "or put them into --command")
        command = shlex.split(args.command)
        if not command:
            raise SlurmRequestError("--command is empty")
        return JobCommand(command, _default_run_dir(args))
    if not args.config:
        raise SlurmRequestError("give a training CONFIG (YAML) or --command")
    return _train_command(args)


def exclusive_nodes(args: argparse.Namespace) -> bool:
    """--exclusive as given; unset: a GPU job that names no --cpus-per-task takes whole nodes (Slurm's default of one
    CPU per task would put the node's GPU workers, Ray and the trainer on one core)."""
    if args.exclusive is not None:
        return bool(args.exclusive)
    return bool(args.gpus_per_node) and not args.cpus_per_task


def sbatch_directives(args: argparse.Namespace, run_dir: Path) -> list[str]:
    lines = [f"--job-name={args.job_name}", f"--nodes={args.nodes}", "--ntasks-per-node=1",
             f"--output={run_dir}/slurm-%j.out", "--open-mode=append"]
    if args.gpus_per_node:
        lines.append(f"--gpus-per-node={args.gpus_per_node}")
    if args.cpus_per_task:
        lines.append(f"--cpus-per-task={args.cpus_per_task}")
    if args.mem:
        lines.append(f"--mem={args.mem}")
    if args.partition:
        lines.append(f"--partition={args.partition}")
    if args.time:
        lines.append(f"--time={args.time}")
    if exclusive_nodes(args):
        lines.append("--exclusive")
    if args.requeue:
        lines.append("--requeue")
        if args.time:
            lines.append(f"--signal=B:USR1@{args.signal_lead}")
    else:
        lines.append("--no-requeue")
    lines += args.sbatch_arg
    return [f"#SBATCH {line}" for line in lines]


def render(template: str, values: dict[str, str]) -> str:
    """Fill every {{name}}; a placeholder without a value is an error, not an empty string."""
    missing = sorted({m.group(1) for m in PLACEHOLDER.finditer(template)} - set(values))
    if missing:
        raise SlurmRequestError(f"template placeholders without a value: {missing}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def render_script(args: argparse.Namespace, job: JobCommand) -> str:
    template = Path(args.template).read_text()
    given = [(k, v) for k, _, v in (e.partition("=") for e in args.env)]
    env_exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in [*job.env.items(), *given])
    values = {
        "sbatch_directives": "\n".join(sbatch_directives(args, job.run_dir)),
        "python": shlex.quote(args.python),
        "run_dir": shlex.quote(str(job.run_dir)),
        # the job imports the hybridrl this command runs (a checkout or an install): put its root first
        "import_root": shlex.quote(str(IMPORT_ROOT)),
        "ip_mode": shlex.quote(args.ip_mode),
        "gpus_per_node": str(args.gpus_per_node),
        "join_timeout": str(args.ray_join_timeout),
        "port_base": "" if args.ray_port_base is None else str(args.ray_port_base),
        "object_store_bytes": "" if args.ray_object_store_mb is None else str(args.ray_object_store_mb << 20),
        "ray_tmp_root": shlex.quote(args.ray_tmp_root),
        "requeue": "1" if args.requeue else "0",
        "command": " ".join(shlex.quote(c) for c in job.argv),
        "trainer": "1" if job.trainer else "0",
        "resume_on_requeue": "1" if job.resume_on_requeue else "0",
        "env_exports": env_exports,
    }
    return render(template, values)


def wait_for_job(job_id: str, run_dir: Path, timeout_s: float | None) -> int:
    """Poll the controller (faster than `sbatch --wait`'s 10 s) until the job ends; its exit code."""
    start = time.monotonic()
    state, exit_code = "PENDING", "0:0"
    while timeout_s is None or time.monotonic() - start < timeout_s:
        state, exit_code = job_state(job_id)
        if state in TERMINAL_STATES:
            break
        time.sleep(1.0)
    else:
        print(f"job {job_id} still {state} after {timeout_s:.0f} s; not cancelled", file=sys.stderr)
        return 124
    code, _, sig = exit_code.partition(":")
    rc = int(code) if code.isdigit() else 1
    if state != "COMPLETED":
        rc = rc or 1
        log = run_dir / f"slurm-{job_id}.out"
        tail = log.read_text(errors="replace").splitlines()[-25:] if log.is_file() else ["(no job log)"]
        print(f"job {job_id} {state} (exit {exit_code}); end of {log}:\n" + "\n".join(tail), file=sys.stderr)
    else:
        print(f"job {job_id} COMPLETED")
    return rc
