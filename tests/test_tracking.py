"""Stage timers (injected clock), MetricsTracker and its backends (TensorBoard, wandb offline, MLflow file
store), the console progress line, and clear errors for bad tracker configs."""
from __future__ import annotations

import io
import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest

from hybridrl.trainer.timers import StageTimer
from hybridrl.trainer.tracking import Console, MetricsTracker, check_backends


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps() -> list[dict]:
    return [{"reward_mean": 0.25 * s, "kl_mean": 0.5 ** s, "actor/pg_loss": -1.0 * s,
             "tokens_per_s": 100.0 + s, "time/step": 2.0 + s} for s in (1, 2, 3)]


# ---------------------------------------------------------------- StageTimer

def test_stage_timer_accumulates_nested_and_repeated_stages():
    clock = FakeClock()
    timer = StageTimer(clock=clock)
    clock.now = 10.0
    timer.start_step()
    with timer("generation"):
        clock.now = 10.5
        with timer("transition"):  # nested: counted in both
            clock.now = 11.25
        clock.now = 12.0
    with timer("reward"):
        clock.now = 13.0
    clock.now = 13.5  # untimed gap
    with timer("time/reward"):  # repeated (prefix optional): adds up
        clock.now = 14.0
    timer.add("transition", 0.125)  # measured elsewhere, e.g. inside a worker
    clock.now = 15.0
    assert timer.peek() == {"time/generation": 2.0, "time/transition": 0.875, "time/reward": 1.5}
    assert timer.pop() == {"time/generation": 2.0, "time/transition": 0.875, "time/reward": 1.5,
                           "time/step": 5.0}

    # reset; without start_step the step begins at the first stage entered
    assert timer.pop() == {}
    clock.now = 20.0
    with timer("actor_update"):
        clock.now = 20.75
        with timer("actor_update"):  # re-entered while open: counted once
            clock.now = 21.0
        clock.now = 21.5
    clock.now = 22.0
    assert timer.pop() == {"time/actor_update": 1.5, "time/step": 2.0}


def test_stage_timer_records_failed_stage_and_refuses_misuse():
    clock = FakeClock()
    timer = StageTimer(clock=clock)
    with pytest.raises(KeyError):
        with timer("reference"):
            clock.now = 3.0
            raise KeyError("boom")
    assert timer.pop() == {"time/reference": 3.0, "time/step": 3.0}

    with pytest.raises(ValueError, match='"step" is reserved'):
        with timer("time/step"):
            pass
    with pytest.raises(ValueError, match="non-empty string"):
        timer.add("", 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        timer.add("reward", -1.0)
    with pytest.raises(ValueError, match=">= 0"):
        timer.add("reward", math.nan)
    with timer("critic"):
        with pytest.raises(RuntimeError, match="still open"):
            timer.pop()
        with pytest.raises(RuntimeError, match="stages are open"):
            timer.start_step()


def test_stage_timer_default_clock_is_monotonic_seconds():
    timer = StageTimer()
    with timer("generation"):
        pass
    times = timer.pop()
    assert set(times) == {"time/generation", "time/step"}
    assert 0.0 <= times["time/generation"] <= times["time/step"]


# ---------------------------------------------------------------- MetricsTracker: jsonl + TensorBoard

def test_tracker_jsonl_tensorboard_truncate_and_console_line(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = MetricsTracker(tmp_path / "run", total_steps=3)
    assert tracker.backends == ("tensorboard",)
    steps = _steps()
    steps[2]["kl_mean"] = float("nan")
    for step, metrics in enumerate(steps, start=1):
        tracker.log(step, {"step": 999, **metrics})  # the positional step wins over a "step" key
    tracker.close()

    records = tracker.read()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["reward_mean"] == 0.5 and records[2]["kl_mean"] == "nan"
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.step for e in events.Scalars("actor/pg_loss")] == [1, 2, 3]
    kl = [e.value for e in events.Scalars("kl_mean")]
    assert kl[:2] == [0.5, 0.25] and math.isnan(kl[2])  # a diverging run stays visible

    line = tracker.console_line(2, {**steps[1], "time/generation": 1.0, "note": "x"})
    assert line == ("step 2/3 | reward_mean=0.5 | kl_mean=0.25 | actor/pg_loss=-2 | tokens_per_s=102 | "
                    "time/step=4")
    assert "kl_mean=nan" in tracker.console_line(3, steps[2])

    resumed = MetricsTracker(tmp_path / "run", tensorboard=False)
    assert resumed.backends == ()
    resumed.truncate_after(1)
    resumed.log(2, {"reward_mean": 7.0})
    assert [(r["step"], r["reward_mean"]) for r in resumed.read()] == [(1, 0.25), (2, 7.0)]
    resumed.close()


# ---------------------------------------------------------------- console

def test_console_plain_bar_and_tqdm(tmp_path, capsys):
    stream = io.StringIO()
    console = Console(total_steps=4, stream=stream, use_tqdm=False, width=8)
    console.update(1, "step 1/4 | reward_mean=0.1")
    console.update(2, "step 2/4 | reward_mean=0.2")
    console.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[##......]  25% ") and lines[0].endswith("| step 1/4 | reward_mean=0.1")
    assert lines[1].startswith("[####....]  50% ")

    pytest.importorskip("tqdm")
    stream = io.StringIO()
    console = Console(total_steps=3, stream=stream, use_tqdm=True)
    for step in (1, 2, 3):
        console.update(step, f"step {step}/3 | line")
    console.close()
    text = stream.getvalue()
    assert all(f"step {s}/3 | line\n" in text for s in (1, 2, 3))
    assert "3/3" in text.replace("step 3/3", "")  # the bar itself reached the end

    # the tracker's per-step method: one metrics line per step on stderr
    tracker = MetricsTracker(tmp_path / "run", tensorboard=False, total_steps=2)
    returned = [tracker.show(step, m) for step, m in enumerate(_steps()[:2], start=1)]
    tracker.close()
    err = capsys.readouterr().err
    assert returned[0].startswith("step 1/2 | reward_mean=0.25") and all(line in err for line in returned)

    stream = io.StringIO()
    console = Console(total_steps=4, stream=stream, show_bar=False)  # trainer.progress_bar=false
    console.update(1, "step 1/4 | reward_mean=0.1")
    console.close()
    assert stream.getvalue() == "step 1/4 | reward_mean=0.1\n"

    with pytest.raises(ValueError, match="total_steps"):
        Console(total_steps=-1)


# ---------------------------------------------------------------- bad configs

def test_tracker_bad_backends_fail_before_writing(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    trackers = OmegaConf.create({"trackers": ["tensorboard", "tensorboard"]}).trackers  # as in the config
    assert check_backends(trackers) == ("tensorboard",)
    with pytest.raises(ValueError, match=r"unknown tracker backend.*'console'.*trainer.trackers"):
        check_backends(["console"])
    with pytest.raises(ValueError, match=r"unknown tracker backend.*'neptune'.*choose from"):
        MetricsTracker(tmp_path / "a", backends=("tensorboard", "neptune"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as if not installed
    with pytest.raises(ImportError, match="'wandb' is configured .*pip install wandb"):
        MetricsTracker(tmp_path / "b", backends=("tensorboard", "wandb"))
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match="'mlflow' is configured .*pip install mlflow"):
        MetricsTracker(tmp_path / "c", backends="mlflow")
    assert not any((tmp_path / name).exists() for name in "abc")


# ---------------------------------------------------------------- wandb (offline) and MLflow (file store)

def _wandb_history(run_file: Path) -> list[dict]:
    """History rows of an offline run file (LevelDB-log framing of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    raw, block, pos, pending, rows = run_file.read_bytes(), 32768, 7, b"", []  # 7-byte file header
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(raw):  # still being written
            break
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_offline_backend(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "cfg",
                       "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(var, str(value))
    run_dir = tmp_path / "run"
    tracker = MetricsTracker(run_dir, backends=("wandb",), project="hybridrl-test", run_name="remax-tiny",
                             config={"algorithm": "remax", "actor": {"tp": 2}})
    run = tracker._backends["wandb"].run
    assert run.name == "remax-tiny" and run.project == "hybridrl-test" and run.config["actor"] == {"tp": 2}
    for step, metrics in enumerate(_steps(), start=1):
        tracker.log(step, metrics)
    tracker.close()
    run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    assert run_id == run.id
    (run_file,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    # wandb 0.31 offline: finish() can return before its core process has written the run file; wait.
    deadline = time.monotonic() + 60
    while len(rows := _wandb_history(run_file)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [row["_step"] for row in rows] == [1, 2, 3]
    for row, metrics in zip(rows, _steps()):
        assert {k: row[k] for k in metrics} == metrics

    resumed = MetricsTracker(run_dir, backends=("wandb",), project="hybridrl-test")
    assert resumed._backends["wandb"].run.id == run_id  # continues the same wandb run
    resumed.close()


def test_mlflow_file_store_backend(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this flag
    uri = (tmp_path / "mlruns").as_uri()
    run_dir = tmp_path / "run"
    tracker = MetricsTracker(run_dir, backends=("tensorboard", "mlflow"), project="hybridrl-test",
                             config={"algorithm": "grpo", "actor": {"tp": 2, "lr": 1e-6}},
                             mlflow_tracking_uri=uri)
    assert tracker.backends == ("tensorboard", "mlflow")
    for step, metrics in enumerate(_steps(), start=1):
        tracker.log(step, metrics)
    tracker.close()

    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params == {"algorithm": "grpo", "actor.tp": "2", "actor.lr": "1e-06"}
    assert client.get_experiment(run.info.experiment_id).name == "hybridrl-test"
    for key in _steps()[0]:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(s, m[key]) for s, m in enumerate(_steps(), start=1)]

    resumed = MetricsTracker(run_dir, backends=("mlflow",), project="hybridrl-test", mlflow_tracking_uri=uri)
    resumed.log(4, {"reward_mean": 9.0})
    resumed.close()
    assert (run_dir / "mlflow_run_id.txt").read_text().strip() == run_id
    assert [m.step for m in client.get_metric_history(run_id, "reward_mean")][-1] == 4
