"""`hybridrl submit`: render launch/slurm/hybridrl.sbatch for a multi-node run and submit it
(hybridrl/launch/submit.py checks the request and renders the script).

    hybridrl submit CONFIG --nodes N --gpus-per-node G [--partition P --time T ...] [key=value ...]
    hybridrl submit --command "python -m hybridrl.launch.cluster_check" --nodes 2 --gpus-per-node 0
    hybridrl submit CONFIG --nodes 2 --gpus-per-node 8 --dry-run      # print the script only

The request is checked against the cluster (partition exists and is up, has enough nodes, the nodes
have the GPUs) before anything is submitted, so an impossible job fails here with a message naming
the option, not hours later in the queue.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from hybridrl.launch.slurm_query import SlurmRequestError, check_request
from hybridrl.launch.submit import DEFAULT_TEMPLATE, render_script, validate, wait_for_job


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="training YAML config (for the default `hybridrl train`)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for the trainer")
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node (0: CPU-only nodes)")
    parser.add_argument("--partition", help="Slurm partition (default: the cluster's default partition)")
    parser.add_argument("--time", help="time limit, Slurm format (e.g. 4:00:00 or 2-00:00:00)")
    parser.add_argument("--job-name", default="hybridrl")
    parser.add_argument("--run-dir", help="shared directory for the job's logs, metrics and checkpoints "
                        "(default: the trainer.run_dir override, else runs/<job-name>-<timestamp>)")
    parser.add_argument("--cpus-per-task", type=int, help="CPUs per node for the job (default: Slurm's, or the whole "
                                                          "node for a GPU job: --exclusive)")
    parser.add_argument("--mem", help="memory per node, Slurm format (e.g. 500G)")
    parser.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=None,
                        help="whole nodes (default for a GPU job without --cpus-per-task: Slurm's default of one CPU "
                             "per task would leave the node's 8 workers and Ray one core; --no-exclusive to share)")
    parser.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                        help="extra #SBATCH line, e.g. --sbatch-arg=--account=abc (repeatable)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the job (repeatable)")
    parser.add_argument("--command", help="run this shell command instead of `hybridrl train CONFIG ...` "
                        "(e.g. the cluster check: python -m hybridrl.launch.cluster_check)")
    parser.add_argument("--no-requeue", dest="requeue", action="store_false",
                        help="do not requeue on preemption or near the time limit (default: requeue; a "
                        "requeued trainer gets trainer.resume=auto and resumes from the latest checkpoint)")
    parser.add_argument("--signal-lead", type=int, default=180, metavar="SECONDS",
                        help="with --time: this long before the limit, stop, checkpoint and requeue")
    parser.add_argument("--ip-mode", default="auto",
                        help="node address: auto | iface:NAME (e.g. iface:ib0) | loopback (all nodes on "
                        "one host: the local test cluster)")
    parser.add_argument("--ray-port-base", type=int, help="first Ray port (default: derived from the job id)")
    parser.add_argument("--ray-join-timeout", type=int, default=300,
                        help="seconds for the Ray head to come up and every node to join")
    parser.add_argument("--ray-object-store-mb", type=int, help="Ray object store per node (default: Ray's)")
    parser.add_argument("--ray-tmp-root", default="/tmp", help="node-local dir for Ray's temp dirs")
    parser.add_argument("--python", default=sys.executable, help="Python on the compute nodes")
    parser.add_argument("--model-files", choices=("shared", "staged"), default="shared",
                        help="how every node sees the models: shared (default; the folders, or HF_HUB_CACHE for hub "
                        "ids, are on a filesystem every node mounts: checked) or staged (the same files at the same "
                        "path on every node). Hub ids are resolved here and pinned to their commit either way")
    parser.add_argument("--template", default=str(DEFAULT_TEMPLATE), help="sbatch template to render")
    parser.add_argument("--dry-run", action="store_true", help="print the rendered script, submit nothing")
    parser.add_argument("--wait", action="store_true",
                        help="wait for the job to finish; exit with its exit code")
    parser.add_argument("--wait-timeout", type=float, help="with --wait: give up waiting after this many seconds")
    _accept_overrides_anywhere(parser)


def _accept_overrides_anywhere(parser: argparse.ArgumentParser) -> None:
    """argparse fills the positionals at their first occurrence, so `CONFIG --nodes 2 key=value`
    would reject `key=value`: collect such leftovers into `overrides` instead."""
    parse_known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        parsed, extras = parse_known(args, namespace)
        overrides = [e for e in extras if "=" in e and not e.startswith("-")]
        parsed.overrides = list(parsed.overrides or []) + overrides
        return parsed, [e for e in extras if e not in overrides]

    parser.parse_known_args = parse_known_args  # the `hybridrl` parser calls it for this subcommand


def _fail(message: str) -> int:
    print(f"hybridrl submit: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        job = validate(args)
        run_dir = job.run_dir
        script = render_script(args, job)
        for note in job.notes:
            print(f"hybridrl submit: note: {note}", file=sys.stderr)
        if args.dry_run:
            print(script, end="")
            return 0
        if shutil.which("sbatch") is None:
            raise SlurmRequestError("sbatch not found: submit from a Slurm login node (or use --dry-run)")
        partition = check_request(args.partition, args.nodes, args.gpus_per_node)
    except SlurmRequestError as exc:
        return _fail(str(exc))
    run_dir.mkdir(parents=True, exist_ok=True)
    script_path = run_dir / "job.sbatch"
    script_path.write_text(script)
    proc = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True)
    if proc.returncode != 0:
        return _fail(f"sbatch refused the job (partition {partition}): {proc.stderr.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    print(f"submitted job {job_id} to partition {partition}: {args.nodes} node(s) x {args.gpus_per_node} GPU(s); "
          f"run dir {run_dir}; log {run_dir}/slurm-{job_id}.out")
    (run_dir / "job_id").write_text(job_id + "\n")
    if args.wait:
        return wait_for_job(job_id, run_dir, args.wait_timeout)
    return 0
