"""The main job as README states it: `hybridrl train` with no config runs ReMax on the embedded tiny Llama
(actor TP=2 -> generation TP=1 on a local Ray cluster) and the mean reward visibly rises."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_default_remax_run_learns(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "HYBRIDRL_CACHE": str(tmp_path / "cache")}  # the tiny model is created from scratch
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", f"trainer.run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=1500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"run folder: {run_dir}" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    for record in records:
        assert {"step", "reward_mean", "kl_mean", "tokens_per_s", "time/generation", "time/transition",
                "time/actor_update"} <= set(record)
    rewards = [r["reward_mean"] for r in records]
    assert rewards[0] < 0.2, rewards
    assert max(rewards[-5:]) > 0.8 and sum(rewards[-5:]) / 5 > 0.8, rewards
    assert any(r["kl_mean"] > 0 for r in records)  # the policy left the reference
    assert list(run_dir.glob("tensorboard/events.out.tfevents.*")) and (run_dir / "curves.png").stat().st_size > 0
    assert (run_dir / "config.yaml").read_text().count("remax") >= 1
