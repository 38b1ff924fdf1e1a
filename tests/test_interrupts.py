"""`hybridrl train` stopped by SIGINT / SIGTERM as clusters send them (to the driver, to its process group, to every
process of the job as Slurm's scancel / time limit and systemd do): one line naming the last checkpoint, exit
128 + signal, no worker process and no temp-dir leftover after it, and `trainer.resume=auto` continues from that
checkpoint; trainer.save_on_signal saves the step in flight first."""
from __future__ import annotations

import json
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from hybridrl.trainer.checkpoint import CheckpointManager, is_complete


def _leftovers(tmp_dir: Path) -> list[str]:
    # torch creates its compile cache torchinductor_<user> on `import torch._dynamo`: a cache, not a leftover
    return sorted(p.name for p in tmp_dir.iterdir() if not p.name.startswith("torchinductor_"))


@pytest.fixture
def tmp_dir():
    # short: AF_UNIX socket paths (multiprocessing managers) below TMPDIR must stay under 108 bytes
    folder = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _env(tmp_dir: Path) -> dict:
    # TMPDIR catches every temp file of the driver and its workers (the hrl-* folder too); Ray's own session
    # folder stays in /tmp (its socket paths must stay short)
    return {**os.environ, "TMPDIR": str(tmp_dir), "RAY_TMPDIR": "/tmp"}


def _train(run_dir: Path, env: dict, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridrl.cli", "train", f"trainer.run_dir={run_dir}",
                             "trainer.progress_bar=false", "trainer.save_every=1", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # a process group of its own, as a job's


def _send(proc: subprocess.Popen, sig: int, to: str) -> list:
    """Send `sig` as a cluster would: to the driver, to its process group (`timeout`, `kill -- -PGID`), or to
    every process of the run (Slurm's scancel and time limit, systemd: the whole cgroup). Returns the tree."""
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert tree  # Ray daemons and the role workers
    if to == "driver":
        proc.send_signal(sig)
    elif to == "group":
        os.killpg(proc.pid, sig)
    else:
        for process in [psutil.Process(proc.pid), *tree]:
            try:
                process.send_signal(sig)
            except psutil.Error:
                pass
    return tree


def _listening(proc: subprocess.Popen) -> list[tuple[str, int, str]]:
    """Every TCP listener of the run (driver, Ray's daemons, the workers): (address, port, process name)."""
    tree = {p.pid: p for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]}
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in tree:
            try:
                found.append((conn.laddr.ip, conn.laddr.port, tree[conn.pid].name()))
            except psutil.Error:
                pass
    return found


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, deadline_s: float = 900) -> None:
    end = time.monotonic() + deadline_s
    while CheckpointManager(run_dir).latest() is None:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "no checkpoint written"
        time.sleep(0.5)


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, deadline_s: float = 900) -> None:
    end = time.monotonic() + deadline_s
    while not _steps(run_dir):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "no step logged"
        time.sleep(0.2)


def _wait_for_save_in_flight(proc: subprocess.Popen, run_dir: Path, deadline_s: float = 300) -> None:
    """Until a step_N.tmp-* folder exists: the workers are writing a checkpoint into it."""
    end = time.monotonic() + deadline_s
    while not list((run_dir / "ckpt").glob("step_*.tmp-*")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "no save seen in flight"
        time.sleep(0.02)


# SIGTERM to the process group (with trainer.save_on_signal: the step in flight is finished and saved), SIGTERM to
# every process (Ray's daemons die too: the driver must not wait on them), SIGINT to the driver while the workers
# write a checkpoint (the half-written one is removed after they are gone, never under them)
@pytest.mark.slow
@pytest.mark.parametrize("sig, to", [(signal.SIGTERM, "group"), (signal.SIGTERM, "every process"),
                                     (signal.SIGINT, "driver")])
def test_signal_stops_the_run_cleanly(tmp_path, tmp_dir, sig, to):
    run_dir = tmp_path / "run"
    env = _env(tmp_dir)
    save_on_signal = to == "group"
    extra = ["trainer.save_every=1000", "trainer.save_on_signal=true"] if save_on_signal else []
    proc = _train(run_dir, env, "trainer.steps=30", *extra)
    (_wait_for_step if save_on_signal else _wait_for_checkpoint)(proc, run_dir)
    # a one-node run listens on loopback only: the pool's rendezvous store (before: on every interface), gloo's
    # pairs, Ray's daemons and workers
    listening = _listening(proc)
    assert listening and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip, _, _ in listening), listening
    if sig == signal.SIGINT:
        _wait_for_save_in_flight(proc, run_dir)
    tree = _send(proc, sig, to)
    out, err = proc.communicate(timeout=60)  # before: a dead GCS held the driver for 60 s, then exit 1
    store = re.search(r"pool 'default': 2 workers in one (\S+):(\d+) process group", err)
    assert store and store.group(1) == "127.0.0.1" and ("127.0.0.1", int(store.group(2)), "ray::WorkerHost") in [
        (ip, port, name.split(".")[0]) for ip, port, name in listening], (store and store.group(0), listening)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    latest = CheckpointManager(run_dir).latest()
    saved = int(latest.name.split("_")[1])
    if save_on_signal:  # no regular save: the step running at the signal was finished and saved on it
        assert saved == _steps(run_dir)[-1], (saved, _steps(run_dir))
        assert f"SIGTERM: saving step {saved} before stopping" in err
    else:  # the last logged step, or the one before if its save was cut off
        assert saved in (_steps(run_dir)[-1], _steps(run_dir)[-1] - 1)
    assert is_complete(latest)
    assert last == (f"hybridrl train: interrupted ({sig.name}) at step {_steps(run_dir)[-1] + 1}; last checkpoint: "
                    f"{latest}; resume with trainer.resume=auto trainer.run_dir={run_dir}"), last
    assert not list((run_dir / "ckpt").glob("step_*.tmp-*"))
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], alive
    assert _leftovers(tmp_dir) == []  # the workers' hrl-* temp folder included

    if save_on_signal:  # the run continues where it stopped (what a requeued job does)
        resumed = _train(run_dir, env, f"trainer.steps={saved + 2}", "trainer.resume=auto")
        out, err = resumed.communicate(timeout=900)
        assert resumed.returncode == 0, err[-3000:]
        assert f"resuming from {latest}" in out
        assert _steps(run_dir) == list(range(1, saved + 3))
        assert _leftovers(tmp_dir) == []


@pytest.mark.slow
def test_sigkill_of_the_driver_leaves_no_process(tmp_path, tmp_dir):
    """Workers, Ray's daemons and its agents follow a SIGKILLed driver within seconds (controller/reaper.py), and
    the reaper removes the workers' temp folder after them."""
    run_dir = tmp_path / "run"
    proc = _train(run_dir, _env(tmp_dir), "trainer.steps=30")
    _wait_for_checkpoint(proc, run_dir)
    tree = psutil.Process(proc.pid).children(recursive=True)
    names = {p.name() for p in tree}
    assert {"raylet", "gcs_server"} <= names and any("Agent" in n for n in names), names
    proc.kill()
    proc.communicate()
    _, alive = psutil.wait_procs(tree, timeout=20)
    assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], alive
    deadline = time.monotonic() + 30
    while _leftovers(tmp_dir) and time.monotonic() < deadline:  # the reaper removes it once its writers are gone
        time.sleep(0.5)
    assert _leftovers(tmp_dir) == []


def test_temp_folders_of_killed_runs_are_reaped(tmp_path):
    """A worker temp folder whose driver is gone (its .owner lock free) is removed by the next run; one whose
    driver lives, and a folder that is not hybridrl's (no .owner), are kept."""
    from hybridrl.controller.ray_cluster import reap_stale_temp_dirs

    for name in ("hrl-dead", "hrl-alive", "hrl-foreign"):
        (tmp_path / name / "pymp-x").mkdir(parents=True)
    (tmp_path / "hrl-dead" / ".owner").touch()
    (tmp_path / "hrl-alive" / ".owner").touch()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\nf = open(sys.argv[1])\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(600)",
                               str(tmp_path / "hrl-alive" / ".owner")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert reap_stale_temp_dirs(str(tmp_path)) == [str(tmp_path / "hrl-dead")]
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hrl-alive", "hrl-foreign"]
    assert reap_stale_temp_dirs(str(tmp_path)) == [str(tmp_path / "hrl-alive")]  # its driver is gone now


_SIGNALLED = """
import os, signal, sys, time
from hybridrl.controller import interrupts
interrupts.REPEAT_WINDOW_S = 0.5
with interrupts.stop_on_signals():
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the batch script's copy of the same stop
    if sys.argv[1] == "hung":  # the shutdown hangs; the operator signals again later
        time.sleep(0.7)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    try:
        interrupts.raise_if_requested()
    except interrupts.Interrupted as stop:
        print("interrupted", stop.exit_code)
"""


_LATE_COPY = """
import os, signal, sys, time
from pathlib import Path
from types import SimpleNamespace
import ray
from hybridrl.cli import train
from hybridrl.controller import interrupts
import hybridrl.trainer.run

def stop():
    os.kill(os.getpid(), signal.SIGTERM)

class Trainer:  # the driver's side of a run: real Ray (its init installs its SIGTERM handler, sys.exit(15))
    step = 0
    def start_ray(self):
        ray.init(num_cpus=1, include_dashboard=False)
        if sys.argv[1] == "during start":  # the stop comes while Ray's handler is current
            stop()
    def close(self):  # the workers close: the batch script's copy of the same stop comes now
        if sys.argv[1] == "while closing":
            stop()
            time.sleep(0.3)
        ray.shutdown()

def run_training(*args):  # the controller's wait loop
    if sys.argv[1] == "while closing":
        stop()
    while True:
        interrupts.raise_if_requested()
        time.sleep(0.05)

hybridrl.trainer.run.run_training = run_training
tracker = SimpleNamespace(plot=lambda: None, close=lambda: None)
cfg = SimpleNamespace(trainer=SimpleNamespace(save_on_signal=False))
sys.exit(train._train(cfg, Trainer(), tracker, Path(sys.argv[2]), None))
"""


@pytest.mark.parametrize("when", ["during start", "while closing"])
def test_a_stop_while_ray_starts_or_the_workers_close_is_the_runs_one_line(tmp_path, when):
    """Ray's init installs its own SIGTERM handler (sys.exit(15)): the stop handler is put back over it at once and
    stays until the last line, so a copy of the stop that comes as the workers close (before: exit 15 and no line,
    CI's Slurm time-limit test) or a stop while Ray starts ends the run with its one line and 143."""
    proc = subprocess.run([sys.executable, "-c", _LATE_COPY, when, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-3000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("hybridrl train: interrupted (SIGTERM) at step 1; no checkpoint was saved (set "
                    "trainer.save_every=K to be able to resume)"), proc.stderr[-3000:]


@pytest.mark.parametrize("case", ["twice", "hung"])
def test_a_stop_delivered_twice_is_one_stop_and_a_later_one_forces(case):
    """Slurm's time limit and scancel signal every process of the job, and the batch script forwards its own
    SIGTERM to the trainer: the two arrive together and are one stop (before: the second killed the driver
    before its one line). A signal after REPEAT_WINDOW_S still forces a hung shutdown."""
    proc = subprocess.run([sys.executable, "-c", _SIGNALLED, case], capture_output=True, text=True, timeout=120)
    if case == "twice":
        assert proc.returncode == 0 and proc.stdout == "interrupted 143\n", (proc.returncode, proc.stderr[-2000:])
    else:
        assert proc.returncode == -signal.SIGTERM and proc.stdout == "", (proc.returncode, proc.stderr[-2000:])
