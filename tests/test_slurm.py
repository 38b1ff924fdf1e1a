"""`hybridrl submit` against a real Slurm: Debian's munge + slurmctld + two slurmd "nodes" on loopback
(scripts/slurm_local.sh, started here when it is not running yet), Ray head + worker per node,
a gloo all-reduce across both nodes, clean teardown, and requests that must fail fast."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")


@pytest.fixture(scope="module")
def slurm() -> None:
    """The local two-node Slurm: started by scripts/slurm_local.sh (idempotent; CI runs it first)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_local.sh")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"scripts/slurm_local.sh failed:\n{proc.stdout}\n{proc.stderr}"
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True).stdout.split("\n")
    assert sum(1 for line in nodes if line.strip()) >= 2, nodes


def submit(*args: str, timeout: float = 700) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", "submit", *args], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=timeout)


def submit_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """`hybridrl submit` without a new interpreter (which would import every subcommand)."""
    from hybridrl import launch_cli

    parser = argparse.ArgumentParser()
    launch_cli.add_arguments(parser)
    rc = launch_cli.run(parser.parse_args(list(args)))  # parse_args: what the `hybridrl` parser does
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def job_processes(job_id: str) -> list[str]:
    """Processes this job left behind: started by it (SLURM_JOB_ID in their environment, which Ray
    workers inherit from their raylet) or naming its Ray temp dirs."""
    left = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (pid_dir / "environ").read_bytes().split(b"\0")
            state = (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"hr-ray-{job_id}/" in cmdline or f"SLURM_JOB_ID={job_id}".encode() in environ:
            left.append(f"{pid_dir.name} [{state}] {cmdline[:120]}")
    return left


def wait_no_processes(job_id: str, timeout_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def cancel(run_dir: Path) -> None:
    job_file = run_dir / "job_id"
    if job_file.is_file():
        subprocess.run(["scancel", job_file.read_text().strip()], capture_output=True)


def free_port_block(size: int) -> int:
    """A base port with `size` free ports above it, below Linux's ephemeral range (32768+) where
    other processes' outgoing connections would collide."""
    for base in range(24000, 32000 - size, 1000):
        socks = []
        try:
            for port in range(base, base + size):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port block")


@pytest.mark.slow
def test_cluster_check_across_two_slurm_nodes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    command = f"{sys.executable} -m hybridrl.launch.cluster_check --nodes 2 --steps 3"
    try:
        proc = submit("--command", command, "--nodes", "2", "--gpus-per-node", "0", "--ip-mode", "loopback",
                      "--time", "5", "--job-name", "hr-test-check", "--run-dir", str(run_dir),
                      "--ray-object-store-mb", "100", "--ray-join-timeout", "300", "--wait", "--wait-timeout", "600")
    finally:
        cancel(run_dir)
    job_id = (run_dir / "job_id").read_text().strip()
    job_log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{job_log}"
    assert f"job {job_id} COMPLETED" in proc.stdout

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cluster = next(r for r in records if r["event"] == "cluster")
    assert cluster["distinct_nodes"] == 2 and cluster["backend"] == "gloo"
    # one actor on each Slurm node, each on its own loopback address (no routable address used)
    assert sorted(r["node_name"] for r in cluster["ranks"]) == ["n1", "n2"]
    assert sorted(r["ip"] for r in cluster["ranks"]) == ["127.0.0.2", "127.0.0.3"]
    assert cluster["master"].startswith("127.0.0.")
    steps = [r for r in records if r["event"] == "step"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:  # rank r contributes (r+1)*(step+1): the sum over 2 ranks is 3*(step+1)
        assert s["allreduce_value"] == 3.0 * (s["step"] + 1) and s["ok"]
    assert records[-1] == {**records[-1], "event": "done", "ok": True}

    assert "command exited with 0" in job_log and "Ray stopped" in job_log
    for node in ("n1", "n2"):
        node_log = (run_dir / "logs" / f"ray-{node}.log").read_text()
        assert f"node {node}: Ray stopped" in node_log and ", 0 left" in node_log, node_log[-2000:]
    assert wait_no_processes(job_id) == []
    assert not Path(f"/tmp/hr-ray-{job_id}").exists()


def test_impossible_requests_fail_before_submission(slurm, tmp_path, capsys):
    queued_before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    base = ["--command", "true", "--run-dir", str(tmp_path / "never")]
    # through the real CLI once
    proc = submit(*base, "--nodes", "3", "--gpus-per-node", "0", timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "hybridrl submit: error: --nodes 3: partition debug has only 2 node(s) (n[1-2])" in proc.stderr
    cases = {
        ("--nodes", "2", "--gpus-per-node", "0", "--partition", "nosuch"):
            "--partition nosuch: no such partition (available: debug (default): 2 nodes)",
        ("--nodes", "2", "--gpus-per-node", "1"): "--gpus-per-node 1: only 0 node(s) of partition debug have 1 GPU",
        ("--nodes", "2", "--gpus-per-node", "0", "--time", "5 hours"): "--time '5 hours' is not a Slurm time",
        ("--nodes", "0", "--gpus-per-node", "0"): "--nodes must be >= 1",
    }
    for args, message in cases.items():
        rc, _, err = submit_in_process(capsys, *base, *args)
        assert rc == 2 and message in err, (args, err)
    rc, _, err = submit_in_process(capsys, "configs/does-not-exist.yaml", "--nodes", "1", "--gpus-per-node", "0")
    assert rc == 2 and "config configs/does-not-exist.yaml does not exist" in err
    rc, _, err = submit_in_process(capsys, "--command", "true", "x=1", "--nodes", "1", "--gpus-per-node", "0")
    assert rc == 2 and "--command replaces `hybridrl train CONFIG ...`" in err
    assert not (tmp_path / "never").exists()
    queued_after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    assert set(queued_after) <= set(queued_before), "an impossible request reached the queue"


@pytest.mark.slow
@pytest.mark.parametrize("blocked_node", ["n1", "n2"])
def test_ray_node_that_cannot_start_fails_the_job_fast(slurm, tmp_path, blocked_node):
    """A port of the head's GCS (n1) or of n2's raylet is taken: the job must fail saying which node,
    long before its join timeout, and leave nothing behind."""
    run_dir = tmp_path / "run"
    port_base = free_port_block(800)
    blocked_port = port_base if blocked_node == "n1" else port_base + 400 + 1  # GCS / n2's node manager
    blocker = socket.socket()
    blocker.bind(("0.0.0.0", blocked_port))  # bound, not listening: connections are refused
    try:
        proc = submit("--command", "true", "--nodes", "2", "--gpus-per-node", "0", "--ip-mode", "loopback",
                      "--time", "5", "--job-name", "hr-test-fail", "--run-dir", str(run_dir),
                      "--ray-port-base", str(port_base), "--ray-object-store-mb", "100",
                      "--ray-join-timeout", "300", "--wait", "--wait-timeout", "400")
    finally:
        blocker.close()
        cancel(run_dir)
    job_id = (run_dir / "job_id").read_text().strip()
    job_log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert proc.returncode == 3, f"{proc.stdout}\n{proc.stderr}\n{job_log}"
    expected = ("the Ray head on node n1 did not come up" if blocked_node == "n1"
                else "node n2 never joined the Ray cluster")
    assert expected in job_log, job_log
    # detected through the node's exited start step, not by running into the join timeout
    assert "its Ray start step" in job_log and f"port(s) [{blocked_port}] already in use" in job_log, job_log
    assert "command exited" not in job_log  # the command never ran
    assert wait_no_processes(job_id) == []


def test_dry_run_renders_the_train_job(tmp_path, capsys):
    """No Slurm needed: the rendered script carries the request, the trainer command with
    trainer.resume=auto (requeue), and no unfilled placeholder."""
    config = tmp_path / "remax.yaml"
    config.write_text("algorithm: remax\n")
    rc, script, err = submit_in_process(
        capsys, str(config), "actor.lr=1e-6", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
        "--time", "1-00:00:00", "--run-dir", str(tmp_path / "run dir"), "--env", "NCCL_DEBUG=WARN",
        "--sbatch-arg=--account=rl", "--dry-run", "data.max_prompt_len=512")  # overrides also after options
    assert rc == 0, err
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --time=1-00:00:00", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@180",
                 "#SBATCH --account=rl", "#SBATCH --ntasks-per-node=1", "export NCCL_DEBUG=WARN",
                 f"RUN_DIR='{tmp_path / 'run dir'}'", "GPUS_PER_NODE=8", "IP_MODE=auto"):
        assert line in script, line
    assert (f"COMMAND=({sys.executable} -m hybridrl.cli train {config} actor.lr=1e-6 data.max_prompt_len=512 "
            "trainer.resume=auto)") in script
    assert "{{" not in script and "}}" not in script
    assert not (tmp_path / "run dir").exists()
    # the rendered script is valid bash
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr

    rc, script, err = submit_in_process(capsys, "--command", "echo 'a b'", "--nodes", "1", "--gpus-per-node", "0",
                                        "--no-requeue", "--dry-run")
    assert rc == 0, err
    assert "COMMAND=(echo 'a b')" in script and "#SBATCH --no-requeue" in script
    assert "trainer.resume=auto" not in script and "#SBATCH --gpus-per-node" not in script


def test_port_ip_and_slurm_string_helpers():
    from hybridrl.launch.ray_node import default_port_base, node_ip, node_ports, slurm_cpus_per_node
    from hybridrl.launch.slurm_query import gpus_in_gres

    head, worker = node_ports(20000, 0, loopback=True), node_ports(20000, 1, loopback=True)
    head_ports = {v for v in vars(head).values()}
    assert head.gcs == 20000 and worker.gcs == 20400 and worker.max_worker == 20799
    assert not head_ports & {v for v in vars(worker).values()}  # fake nodes on one host never share a port
    assert node_ports(20000, 5, loopback=False) == head  # real nodes are separate hosts: same block
    assert node_ip("loopback", 0) == "127.0.0.2" and node_ip("loopback", 1) == "127.0.0.3"
    assert node_ip("10.1.2.3", 7) == "10.1.2.3"
    with pytest.raises(ValueError, match="--ip-mode"):
        node_ip("eth0", 0)
    bases = {default_port_base(job, 2, loopback=True) for job in range(100)}
    assert min(bases) >= 20000 and max(bases) + 800 <= 32000 and len(bases) > 1
    assert slurm_cpus_per_node("4(x2),2") == [4, 4, 2]
    assert gpus_in_gres("gpu:8") == 8 and gpus_in_gres("gpu:a100:4(S:0-1),gpu:v100:2") == 6
    assert gpus_in_gres("(null)") == 0
