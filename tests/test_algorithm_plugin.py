"""An algorithm added in a test module (not in the package) trains through `hybridrl train` by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _train(tmp_path, *overrides, timeout=600):
    env = {**os.environ, "HYBRIDRL_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", "grpo_tiny.yaml", *overrides],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.slow  # ~1 min: a local Ray cluster, 3 GRPO-shaped steps
def test_plugin_algorithm_trains_by_name(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(tmp_path, "algorithm.name=plugin_mean_baseline", "algorithm.module=algorithm_plugin",
                  "algorithm.rollout_correction=tis", "trainer.steps=3", f"trainer.run_dir={run_dir}",
                  "trainer.progress_bar=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["actor/pg_loss"] == r["actor/pg_loss"] for r in records)  # finite: the update ran
    # the native engine (TP=1) and the trainer (TP=2) agree in fp32: a tiny mismatch, no weight reaches the cap
    for r in records:
        assert 0.0 <= r["mismatch/log_prob_diff"] < 1e-3 and abs(r["mismatch/kl"]) < 1e-4, r
        assert r["mismatch/corrected_fraction"] == 0.0, r
    config = (run_dir / "config.yaml").read_text()
    assert "plugin_mean_baseline" in config and "module: algorithm_plugin" in config


def test_unknown_algorithm_and_unimportable_module_are_refused_before_work(tmp_path):
    proc = _train(tmp_path, "algorithm.module=no_such_plugin_module", timeout=120)
    assert proc.returncode == 2 and "algorithm.module='no_such_plugin_module' cannot be imported" in proc.stderr
    proc = _train(tmp_path, "algorithm.name=plugin_mean_baseline", timeout=120)  # registered only by the module
    assert proc.returncode == 2 and "algorithm.name='plugin_mean_baseline' is unknown; registered:" in proc.stderr
    proc = _train(tmp_path, "algorithm.rollout_correction=is", timeout=120)
    assert proc.returncode == 2 and "algorithm.rollout_correction='is' is unknown; choose one of none, tis, mis" \
        in proc.stderr
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob("**/metrics.jsonl"))
