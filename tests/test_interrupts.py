"""`hybridrl train` stopped by SIGINT / SIGTERM: one line naming the last checkpoint, exit 128 + signal, no
worker process and no temp-dir leftover after it, and `trainer.resume=auto` continues from that checkpoint."""
from __future__ import annotations

import json
import os
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

pytestmark = pytest.mark.slow


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
    # TMPDIR catches every temp file of the driver and its workers; Ray's own session folder stays in /tmp
    # (its socket paths must stay short)
    return {**os.environ, "TMPDIR": str(tmp_dir), "RAY_TMPDIR": "/tmp"}


def _train(run_dir: Path, env: dict, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridrl.cli", "train", f"trainer.run_dir={run_dir}",
                             "trainer.progress_bar=false", "trainer.save_every=1", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, deadline_s: float = 900) -> None:
    end = time.monotonic() + deadline_s
    while CheckpointManager(run_dir).latest() is None:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "no checkpoint written"
        time.sleep(0.5)


def _wait_for_save_in_flight(proc: subprocess.Popen, run_dir: Path, deadline_s: float = 300) -> None:
    """Until a step_N.tmp-* folder exists: the workers are writing a checkpoint into it."""
    end = time.monotonic() + deadline_s
    while not list((run_dir / "ckpt").glob("step_*.tmp-*")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "no save seen in flight"
        time.sleep(0.02)


# SIGTERM between saves, SIGINT while the workers write a checkpoint (the half-written one is removed after
# they are gone, never under them)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_run_cleanly(tmp_path, tmp_dir, sig):
    run_dir = tmp_path / "run"
    env = _env(tmp_dir)
    proc = _train(run_dir, env, "trainer.steps=30")
    _wait_for_checkpoint(proc, run_dir)
    if sig == signal.SIGINT:
        _wait_for_save_in_flight(proc, run_dir)
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert tree  # Ray daemons and the role workers
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    latest = CheckpointManager(run_dir).latest()
    saved = int(latest.name.split("_")[1])  # the last logged step, or the one before if its save was cut off
    assert is_complete(latest) and saved in (_steps(run_dir)[-1], _steps(run_dir)[-1] - 1)
    assert last == (f"hybridrl train: interrupted ({sig.name}) at step {_steps(run_dir)[-1] + 1}; last checkpoint: "
                    f"{latest}; resume with trainer.resume=auto trainer.run_dir={run_dir}"), last
    assert not list((run_dir / "ckpt").glob("step_*.tmp-*"))
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], alive
    assert _leftovers(tmp_dir) == []

    if sig == signal.SIGTERM:  # the run continues where it stopped
        resumed = _train(run_dir, env, f"trainer.steps={saved + 2}", "trainer.resume=auto")
        out, err = resumed.communicate(timeout=900)
        assert resumed.returncode == 0, err[-3000:]
        assert f"resuming from {latest}" in out
        assert _steps(run_dir) == list(range(1, saved + 3))
        assert _leftovers(tmp_dir) == []


def test_sigkill_of_the_driver_leaves_no_process(tmp_path, tmp_dir):
    """Workers, Ray's daemons and its agents follow a SIGKILLed driver within seconds (controller/reaper.py)."""
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
