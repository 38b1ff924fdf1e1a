"""The smaller exits of `hybridrl train` and `hybridrl plan` (issue 35, finding 5), each checked without a cluster:
Ray's start-up timeout is one line (exit 5), `--check` calls the reward function and the environment on a sample
row, reads no heavy module it does not need, and `plan --gpu` with an unknown type is one line."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _train(*argv: str, capsys) -> tuple[int, str, str]:
    from hybridrl.cli.train import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rc = run(parser.parse_args(list(argv)))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def always_raises(prompt: str, response: str, **meta) -> float:
    raise KeyError("answer")


def returns_text(prompt: str, response: str, **meta) -> str:
    return "good"


def test_check_calls_the_reward_function(capsys):
    rc, out, err = _train("--check", "rollout.engine=native", capsys=capsys)
    assert rc == 0 and out.startswith("config ok: remax, 400 prompts"), err
    for fn, why in ((always_raises, "raised KeyError: 'answer' on row 0"), (returns_text, "returned str 'good'")):
        rc, out, err = _train("--check", "rollout.engine=native", f"reward.fn=test_run_errors:{fn.__name__}",
                              capsys=capsys)
        line = err.strip()
        assert rc == 2 and "\n" not in line and not out, err
        assert line.startswith(f"hybridrl train: config error: reward.fn: reward function test_run_errors:"
                               f"{fn.__name__} {why}") and line.endswith("(--check calls it on the first prompt row)")


def test_check_imports_nothing_it_does_not_need():
    """`hybridrl train --check` reads the config, the data and the model's config.json: no Ray, no vLLM, no
    Megatron, no tensordict (which imports torch's compiler), no transformers model classes (their imports
    alone took seconds; the check's budget is under 5 s)."""
    heavy = ["ray", "vllm", "megatron.core", "tensordict", "torch._dynamo", "transformers.models.auto.modeling_auto",
             "transformers.models.llama.configuration_llama"]
    program = ("import json, sys\nfrom hybridrl.cli import main\nsys.argv = ['hybridrl', 'train', '--check']\n"
               "rc = main()\nprint(json.dumps([rc, [m for m in sys.argv[3:] if m in sys.modules]]))")
    proc = subprocess.run([sys.executable, "-c", program.replace("sys.argv[3:]", repr(heavy))], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    rc, imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rc == 0 and imported == [], (proc.stderr[-2000:], imported)


def test_a_tokenizer_transformers_saved_loads_without_the_model_classes(tmp_path):
    """transformers 5 saves a fast tokenizer's class as TokenizersBackend (a made teacher's or a user's checkpoint):
    it loads as the same tokenizer without importing every model class (before: opd_tiny's --check took ~2 s
    more than the default's)."""
    from hybridrl.data.tokenizer import load_tokenizer

    load_tokenizer(None).save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    program = ("import json, sys\nfrom hybridrl.data.tokenizer import load_tokenizer\n"
               f"t = load_tokenizer({str(tmp_path)!r})\n"
               "print(json.dumps([t('abc xyz').input_ids, 'transformers.models.auto.modeling_auto' in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    ids, imported_auto = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ids == load_tokenizer(None)("abc xyz").input_ids and not imported_auto, proc.stderr[-2000:]


def test_ray_start_timeout_is_one_line(monkeypatch):
    import ray

    from hybridrl.cli.train import _outcome
    from hybridrl.config import MachineError
    from hybridrl.controller.ray_cluster import init_local_ray

    def overloaded(**kwargs):  # what Ray 2.60 raises when its raylet does not register within 30 s
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(ray, "init", overloaded)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(MachineError) as caught:
        init_local_ray(2)
    code, line = _outcome(caught.value, 0, Path("."))
    assert code == 5 and "\n" not in line, line
    assert line.startswith("Ray's node did not start in time (The current node timed out during startup; load "
                           "average ") and line.endswith("the machine is busy; retry when it is quieter, or lower "
                                                         "resources.devices"), line


def test_plan_unknown_gpu_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", "--auto", "--model", "llama-7b", "--gpus",
                           "8", "--gpu", "b200"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.strip() == ("hybridrl plan --auto: --gpu 'b200' is not a known device type; choose one of "
                                   "a100-80g, h100, h200")
