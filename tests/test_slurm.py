"""`hybridrl submit` against a real Slurm: Debian's munge + slurmctld + two slurmd "nodes" on loopback with one
fake GPU each (scripts/slurm_local.sh, started here when it is not running yet), Ray head + worker per node,
the tiny one-step-off ReMax config trained across both nodes (a pool on each), a time limit and scancel stopping the
trainer, clean teardown, and requests that must fail fast."""
from __future__ import annotations

import argparse
import json
import os
import re
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
    from hybridrl.cli import submit as submit_cli

    parser = argparse.ArgumentParser()
    submit_cli.add_arguments(parser)
    rc = submit_cli.run(parser.parse_args(list(args)))  # parse_args: what the `hybridrl` parser does
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
def test_two_slurm_nodes_train_with_a_pool_on_each(slurm, tmp_path):
    """`hybridrl submit configs/remax_async_tiny.yaml --nodes 2 --gpus-per-node 1`: each slurmd "node" offers one
    fake GPU (Slurm GRES); the Ray cluster spans both nodes and the trainer joins it. HybridFlow's whole-node
    placement: the actor (+ reference) pool on n1, the rollout pool on n2 (`hybridrl submit` places them; before, a
    pool had to stripe over every node), 3 steps with the weights sent from node to node over a group that crosses
    them; the job's ray_actors.json shows each pool's worker on its node, each pool's rendezvous listens on its node's
    address, and nothing is left behind. (One job for what two did: a 2-device actor striped over both nodes, and
    the pools on separate nodes.)"""
    run_dir = tmp_path / "run"
    try:
        proc = submit("configs/remax_async_tiny.yaml", "--nodes", "2", "--gpus-per-node", "1", "--ip-mode",
                      "loopback", "--time", "30", "--job-name", "hr-test-pools", "--ray-object-store-mb", "100",
                      "--ray-join-timeout", "300", "--wait", "--wait-timeout", "1300", "resources.devices=1",
                      "actor.parallel.tp=1", "trainer.steps=3", f"trainer.run_dir={run_dir}", timeout=1400)
    finally:
        cancel(run_dir)
    job_id = (run_dir / "job_id").read_text().strip()  # trainer.run_dir is the job's run dir too
    job_log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{job_log}"
    assert f"job {job_id} COMPLETED" in proc.stdout

    # the Ray cluster spanned both Slurm nodes, each with its GPU, each on its own loopback address
    joined = next(line for line in job_log.splitlines() if "Ray cluster at 127.0.0.2:" in line and "complete" in line)
    for node, ip in (("n1", r"127\.0\.0\.2"), ("n2", r"127\.0\.0\.3")):
        assert re.search(rf"{node}@{ip} cpus=\S+ gpus=1\b", joined), joined
    head = re.search(r"Ray head n1 at (127\.0\.0\.2:\d+)", job_log).group(1)
    running = next(line for line in job_log.splitlines() if "] running: " in line)
    assert f"resources.ray_address={head}" in running and "resources.nodes=2" in running, running
    assert "trainer.resume=auto" not in running  # first run, not a requeue
    assert "resources.node_devices.default=[1,0]" in running and "resources.node_devices.gen=[0,1]" in running

    # the trainer joined that cluster (not a local one) and trained 3 steps, generation on its own pool
    config = (run_dir / "config.yaml").read_text()
    assert f"ray_address: {head}" in config and "nodes: 2" in config, config
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert 0.0 <= s["reward_mean"] <= 1.0 and s["actor/update_ok"] == 1.0, s
    assert any("time/weight_sync" in s for s in steps)  # fed over the bridge, from n1 to n2
    assert "done: 3 steps" in job_log

    # each pool's worker host on its node; its rendezvous on its node's address (not every interface)
    actors = json.loads((run_dir / "ray_actors.json").read_text())
    hosts = {a["name"].split(":")[1]: a for a in actors if a["actor_class"] == "WorkerHost"}
    assert sorted(hosts) == ["default", "gen"], actors
    assert (hosts["default"]["node_name"], hosts["default"]["node_ip"]) == ("n1", "127.0.0.2"), hosts
    assert (hosts["gen"]["node_name"], hosts["gen"]["node_ip"]) == ("n2", "127.0.0.3"), hosts
    assert hosts["default"]["pid"] != hosts["gen"]["pid"] and all(a["state"] == "DEAD" for a in hosts.values())
    assert "actors WorkerHost[default]: n1 x1" in job_log and "actors WorkerHost[gen]: n2 x1" in job_log
    for pool, ip in (("default", "127.0.0.2"), ("gen", "127.0.0.3")):
        assert re.search(rf"pool '{pool}': 1 workers in one {re.escape(ip)}:\d+ process group", job_log), job_log

    # clean teardown on both nodes
    assert "command exited with 0" in job_log and "Ray stopped" in job_log
    for node in ("n1", "n2"):
        node_log = (run_dir / "logs" / f"ray-{node}.log").read_text()
        assert f"node {node}: Ray stopped" in node_log and ", 0 left" in node_log, node_log[-2000:]
    assert wait_no_processes(job_id) == []
    assert not Path(f"/tmp/hr-ray-{job_id}").exists()


def _wait_job(job_id: str, timeout_s: float = 600) -> str:
    from hybridrl.launch.slurm_query import job_state
    from hybridrl.launch.submit import TERMINAL_STATES

    deadline = time.monotonic() + timeout_s
    while (state := job_state(job_id)[0]) not in TERMINAL_STATES and time.monotonic() < deadline:
        time.sleep(1)
    return state


def _finished_log(run_dir: Path, job_id: str) -> str:
    """The job's log once none of its processes is left: Slurm marks a job TIMEOUT / CANCELLED when it signals
    it, while the batch script's trap is still stopping the trainer and Ray and writing the log."""
    assert wait_no_processes(job_id, timeout_s=60) == []  # KillWait (10 s in scripts/slurm_local.sh) bounds it
    return (run_dir / f"slurm-{job_id}.out").read_text()


def _interrupted_line(job_log: str, run_dir: Path) -> int:
    """The trainer's last line in the job log; returns the step of the checkpoint it names (checked complete)."""
    line = next(text for text in reversed(job_log.splitlines()) if text.startswith("hybridrl train: "))
    match = re.fullmatch(rf"hybridrl train: interrupted \(SIGTERM\) at step \d+; last checkpoint: "
                         rf"{re.escape(str(run_dir))}/ckpt/step_(\d+); resume with trainer.resume=auto "
                         rf"trainer.run_dir={re.escape(str(run_dir))}", line)
    assert match, line
    from hybridrl.trainer.checkpoint import is_complete

    assert is_complete(run_dir / "ckpt" / f"step_{match.group(1)}")
    assert not list((run_dir / "ckpt").glob("step_*.tmp-*"))
    return int(match.group(1))


@pytest.mark.slow
def test_time_limit_and_scancel_stop_the_trainer_cleanly(slurm, tmp_path):
    """Slurm's own signals (SIGTERM to every process of the job, SIGKILL KillWait later): at the job's time limit
    and at scancel the trainer ends with its one line naming the last checkpoint (exit 143), no process, temp folder
    or half-written checkpoint is left, and the next submission resumes from that checkpoint."""
    run_dir = tmp_path / "run"
    common = ["configs/remax_tiny.yaml", "--nodes", "1", "--gpus-per-node", "1", "--ip-mode", "loopback",
              "--ray-object-store-mb", "100", "--no-requeue", "resources.devices=1", "actor.parallel.tp=1",
              "trainer.save_every=2", "trainer.steps=100000", f"trainer.run_dir={run_dir}"]
    try:
        proc = submit(*common, "--time", "1", "--job-name", "hr-test-limit", "--wait", "--wait-timeout", "400",
                      timeout=500)  # the 1-minute limit ends it
        job_id = (run_dir / "job_id").read_text().strip()
        job_log = _finished_log(run_dir, job_id)
        assert f"job {job_id} TIMEOUT" in proc.stderr, f"{proc.stdout}\n{proc.stderr}\n{job_log}"
        saved = _interrupted_line(job_log, run_dir)
        assert "command exited with 143 (stopped by SIGTERM)" in job_log
        assert not Path(f"/tmp/hr-ray-{job_id}").exists()

        proc = submit(*common, "--time", "10", "--job-name", "hr-test-cancel", "trainer.resume=auto", timeout=120)
        assert proc.returncode == 0, proc.stderr
        job_id = (run_dir / "job_id").read_text().strip()
        deadline, log = time.monotonic() + 400, run_dir / f"slurm-{job_id}.out"
        while f"step {saved + 2}/" not in (log.read_text() if log.exists() else ""):  # two steps after the resume
            assert time.monotonic() < deadline and job_state_of(job_id) in ("PENDING", "RUNNING", "CONFIGURING")
            time.sleep(1)
        subprocess.run(["scancel", job_id], check=True)
        assert _wait_job(job_id) == "CANCELLED"
    finally:
        cancel(run_dir)
    job_log = _finished_log(run_dir, job_id)
    assert f"resuming from {run_dir}/ckpt/step_{saved}" in job_log, job_log[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[:saved + 2] == list(range(1, saved + 3))  # continued where the time limit stopped it
    _interrupted_line(job_log, run_dir)
    assert "command exited with 143 (stopped by SIGTERM)" in job_log
    assert not Path(f"/tmp/hr-ray-{job_id}").exists()


def job_state_of(job_id: str) -> str:
    from hybridrl.launch.slurm_query import job_state

    return job_state(job_id)[0]


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
        ("--nodes", "2", "--gpus-per-node", "2"): "--gpus-per-node 2: only 0 node(s) of partition debug have 2 GPU",
        ("--nodes", "2", "--gpus-per-node", "0", "--time", "5 hours"): "--time '5 hours' is not a Slurm time",
        ("--nodes", "0", "--gpus-per-node", "0"): "--nodes must be >= 1",
    }
    for args, message in cases.items():
        rc, _, err = submit_in_process(capsys, *base, *args)
        assert rc == 2 and message in err, (args, err)
    rc, _, err = submit_in_process(capsys, "configs/does-not-exist.yaml", "--nodes", "1", "--gpus-per-node", "0")
    assert rc == 2 and "config file 'configs/does-not-exist.yaml' not found" in err, err
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
    """No Slurm needed: the rendered script carries the request, the trainer command (its run dir, the
    node count), the requeue-resume switch, and no unfilled placeholder."""
    config = tmp_path / "remax.yaml"
    config.write_text("algorithm: {name: remax}\nresources: {devices: 32}\n")
    run_dir = tmp_path / "run dir"
    rc, script, err = submit_in_process(
        capsys, str(config), "actor.optim.lr=1e-6", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
        "--time", "1-00:00:00", "--run-dir", str(run_dir), "--env", "NCCL_DEBUG=WARN",
        "--sbatch-arg=--account=rl", "--dry-run", "data.max_prompt_length=512")  # overrides also after options
    assert rc == 0, err
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --time=1-00:00:00", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@180",
                 "#SBATCH --account=rl", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", "export NCCL_DEBUG=WARN",
                 f"RUN_DIR='{run_dir}'", "GPUS_PER_NODE=8", "IP_MODE=auto", "TRAINER=1", "RESUME_ON_REQUEUE=1"):
        assert line in script, line
    # the trainer writes into the job's run dir (a requeued job finds its checkpoints there)
    assert (f"COMMAND=({sys.executable} -m hybridrl.cli train {config} actor.optim.lr=1e-6 data.max_prompt_length=512 "
            f"'trainer.run_dir={run_dir}' resources.nodes=4 trainer.progress_bar=false)") in script
    assert "{{" not in script and "}}" not in script
    assert not run_dir.exists()
    # the rendered script is valid bash
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr

    rc, script, err = submit_in_process(capsys, "--command", "echo 'a b'", "--nodes", "1", "--gpus-per-node", "0",
                                        "--no-requeue", "--dry-run")
    assert rc == 0, err
    assert "COMMAND=(echo 'a b')" in script and "#SBATCH --no-requeue" in script and "TRAINER=0" in script
    assert "RESUME_ON_REQUEUE=0" in script and "#SBATCH --gpus-per-node" not in script
    assert "#SBATCH --exclusive" not in script  # a CPU job keeps Slurm's default

    # a GPU job's resources: whole nodes unless it names its CPUs or shares on purpose
    for extra, wanted, unwanted in ((["--cpus-per-task", "64", "--mem", "500G"],
                                     ["#SBATCH --cpus-per-task=64", "#SBATCH --mem=500G"], ["#SBATCH --exclusive"]),
                                    (["--no-exclusive"], [], ["#SBATCH --exclusive", "--cpus-per-task"]),
                                    (["--cpus-per-task", "8", "--exclusive"], ["#SBATCH --exclusive"], [])):
        rc, script, err = submit_in_process(capsys, "--command", "true", "--nodes", "1", "--gpus-per-node", "8",
                                            "--dry-run", *extra)
        assert rc == 0, err
        assert all(line in script for line in wanted) and not any(line in script for line in unwanted), extra

    # without --run-dir the trainer's run dir is the job's; resume chosen by the user: no auto-resume
    rc, script, err = submit_in_process(capsys, "configs/remax_tiny.yaml", "--nodes", "2", "--gpus-per-node", "1",
                                        "--dry-run", f"trainer.run_dir={tmp_path}/tr", "trainer.resume=never")
    assert rc == 0, err
    assert f"#SBATCH --output={tmp_path}/tr/slurm-%j.out" in script and f"RUN_DIR={tmp_path}/tr" in script
    assert "RESUME_ON_REQUEUE=0" in script and f"trainer.run_dir={tmp_path}/tr resources.nodes=2" in script


def _trainer_arguments_block(script: str) -> str:
    return script[script.index("# >>> trainer arguments"):script.index("# <<< trainer arguments")]


@pytest.mark.parametrize("restart_count, resume_on_requeue, expected", [
    ("0", "1", ["resources.ray_address=10.0.0.1:20000"]),
    ("", "1", ["resources.ray_address=10.0.0.1:20000"]),
    ("2", "1", ["resources.ray_address=10.0.0.1:20000", "trainer.resume=auto"]),
    ("2", "0", ["resources.ray_address=10.0.0.1:20000"]),
])
def test_requeued_trainer_resumes(tmp_path, capsys, restart_count, resume_on_requeue, expected):
    """The template's own trainer-arguments block, run by bash: the Ray address always, and
    trainer.resume=auto only after a requeue (SLURM_RESTART_COUNT > 0) when resuming is on."""
    rc, script, err = submit_in_process(capsys, "configs/remax_tiny.yaml", "--nodes", "2", "--gpus-per-node", "1",
                                        "--dry-run", f"--run-dir={tmp_path}")
    assert rc == 0, err
    program = "\n".join([
        "set -u", 'log() { echo "LOG $*" >&2; }', "COMMAND=(train)", "TRAINER=1",
        f"RESUME_ON_REQUEUE={resume_on_requeue}", "RAY_ADDRESS=10.0.0.1:20000",
        *([f"SLURM_RESTART_COUNT={restart_count}"] if restart_count else []),
        _trainer_arguments_block(script), 'printf "%s\\n" "${COMMAND[@]:1}"'])
    proc = subprocess.run(["bash", "-c", program], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == expected
    assert ("resumes from the latest checkpoint" in proc.stderr) == ("trainer.resume=auto" in expected)


def test_train_requests_checked_against_the_config(capsys, tmp_path):
    """A trainer config that cannot fit the request fails before submission, naming the option."""
    base = ["configs/remax_tiny.yaml", "--dry-run", "--run-dir", str(tmp_path / "never")]
    cases = {
        ("--nodes", "1", "--gpus-per-node", "1"):
            "the config's pools need 2 devices (resources.devices=2) but --nodes 1 x --gpus-per-node 1 = 1",
        ("--nodes", "2", "--gpus-per-node", "2", "resources.devices=3", "resources.pools.rm=2"):
            "the config's pools need 5 devices (resources.devices=3, resources.pools.rm=2) but --nodes 2 x "
            "--gpus-per-node 2 = 4",
        ("--nodes", "2", "--gpus-per-node", "2", "resources.node_devices.default=[2,0]", "resources.pools.gen=2"):
            "node 0 would hold 3 devices (default 2, gen 1) but has 2; change resources.node_devices or the pools "
            "(--nodes 2 x --gpus-per-node 2)",
        ("--nodes", "2", "--gpus-per-node", "2", "resources.node_devices.default=[1,0]"):
            "resources.node_devices.default=[1, 0] places 1 devices but resources.devices=2: make them agree",
        ("--nodes", "2", "--gpus-per-node", "2", "resources.node_devices.gen=[1,1]"):
            "resources.node_devices names pool(s) ['gen'] that resources.pools does not define",
        ("--nodes", "2", "--gpus-per-node", "0"): "--gpus-per-node 0: `hybridrl train` places one worker per device",
        ("--nodes", "2", "--gpus-per-node", "1", "resources.ray_address=1.2.3.4:5"):
            "override resources.ray_address=... is set by the job",
        ("--nodes", "2", "--gpus-per-node", "1", "resources.nodes=1"): "override resources.nodes=... is set by the job",
        ("--nodes", "2", "--gpus-per-node", "1", "trainer.no_such_option=1"):
            "config configs/remax_tiny.yaml: bad config option 'trainer.no_such_option'",
    }
    for args, message in cases.items():
        rc, out, err = submit_in_process(capsys, *base, *args)
        assert rc == 2 and message in err and not out, (args, err)
    assert not (tmp_path / "never").exists()


def test_pools_on_whole_nodes_are_accepted_and_placed(capsys, tmp_path):
    """Pools that do not stripe over every node are placed where they fit (whole nodes first) and the trainer gets
    their devices per node; explicit placements pass through unchanged."""
    def command(*args: str) -> str:
        rc, script, err = submit_in_process(capsys, *args, "--dry-run", "--run-dir", str(tmp_path))
        assert rc == 0, err
        return next(line for line in script.splitlines() if line.startswith("COMMAND=("))

    # the request: actor + ref on 2 devices, generation on 1, two 4-GPU nodes (refused before)
    line = command("configs/remax_async_tiny.yaml", "--nodes", "2", "--gpus-per-node", "4")
    assert "resources.node_devices.gen=[1,0]" in line and "node_devices.default" not in line, line
    # one device per node: the actor's pool on node 0, generation on node 1
    line = command("configs/remax_async_tiny.yaml", "--nodes", "2", "--gpus-per-node", "1", "resources.devices=1",
                   "actor.parallel.tp=1")
    assert "resources.node_devices.default=[1,0]" in line and "resources.node_devices.gen=[0,1]" in line, line
    # whole nodes, given: kept as the user wrote them
    line = command("configs/remax_async_tiny.yaml", "--nodes", "2", "--gpus-per-node", "8", "resources.devices=8",
                   "resources.pools.gen=8", "resources.node_devices.default=[8,0]", "resources.node_devices.gen=[0,8]")
    assert line.count("resources.node_devices") == 2, line


def test_node_placement_rules():
    from hybridrl.parallel.placement import PlacementError, fit_pools, resolve_node_devices

    assert resolve_node_devices({"default": 4, "gen": 2}, 2, {}) == {"default": [2, 2], "gen": [1, 1]}
    assert resolve_node_devices({"default": 8, "gen": 8}, 2, {"default": [8, 0], "gen": [0, 8]}) == \
        {"default": [8, 0], "gen": [0, 8]}
    with pytest.raises(PlacementError, match=r"or its devices per node: resources.node_devices.gen=\[...\]"):
        resolve_node_devices({"default": 2, "gen": 1}, 2, {})
    with pytest.raises(PlacementError, match="give one count >= 0 per node"):
        resolve_node_devices({"default": 2}, 2, {"default": [2]})
    assert fit_pools({"default": 16, "gen": 8, "rm": 8}, 4, 8, {}) == \
        {"default": [4, 4, 4, 4], "gen": [2, 2, 2, 2], "rm": [2, 2, 2, 2]}
    assert fit_pools({"default": 8, "gen": 8, "rm": 4}, 3, 8, {}) == \
        {"default": [8, 0, 0], "gen": [0, 8, 0], "rm": [0, 0, 4]}  # whole nodes first
    assert fit_pools({"default": 6, "gen": 2}, 2, 4, {}) == {"default": [3, 3], "gen": [1, 1]}
    assert fit_pools({"default": 5, "gen": 3}, 2, 4, {}) == {"default": [4, 1], "gen": [0, 3]}
    with pytest.raises(PlacementError, match=r"resources.pools.gen=3 does not fit: 2 device\(s\) are free"):
        fit_pools({"default": 4, "gen": 3}, 2, 3, {"default": [3, 1]})


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
