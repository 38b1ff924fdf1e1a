"""`hybridrl plan`: JSON schema and values for Llama-70B, text output, local config folders, refusals."""
from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import pytest

from hybridrl.cli import plan as plan_cli
from hybridrl.hybrid_engine.model_shapes import LLAMA_PRESETS

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
LLAMA2_70B_PARAMS = 68_976_648_192


def _plan(*args: str) -> int:
    """In-process run of the module `hybridrl plan` dispatches to (the entry point itself is run below
    through a subprocess)."""
    import argparse

    parser = argparse.ArgumentParser(prog="hybridrl plan")
    plan_cli.add_arguments(parser)
    return plan_cli.run(parser.parse_args(list(args)))


def _plan_json(capsys, *args: str) -> dict:
    assert _plan(*args, "--json") == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_llama70b(capsys):
    out = _plan_json(capsys, "--model", "llama-70b", "--train-tp", "8", "--train-pp", "8", "--train-dp", "2",
                     "--gen-tp", "8", "--gen-pp", "1")
    m = out["model_bytes"]
    assert m == 2 * LLAMA2_70B_PARAMS  # bf16
    # groups: rank = tp + 8*(dp + 2*pp); micro-DP group = one TP rank across the 8 stages of one replica
    assert len(out["micro_dp_groups"]) == 16 and out["micro_dp_groups"][0] == [0, 16, 32, 48, 64, 80, 96, 112]
    assert out["micro_dp_groups"][9] == [9 + 16 * s for s in range(8)]
    assert out["gen_tp_groups"][0] == list(range(8)) and len(out["gen_tp_groups"]) == 16
    assert all(len(g) == 8 for g in out["gen_tp_groups"])
    assert sorted(r for g in out["gen_pp_groups"] for r in g) == list(range(128))
    assert all(len(g) == 1 for g in out["gen_pp_groups"])
    assert set(out["strategies"]) == {"hybrid", "ds_chat", "hybridflow_v"}
    keys = {"bytes_per_gpu_mean", "bytes_per_gpu_max", "padding_bytes_per_gpu_max", "peak_extra_bytes_per_gpu"}
    for s in out["strategies"].values():
        assert keys <= set(s)
        assert s["bytes_per_gpu_max"] >= s["bytes_per_gpu_mean"] > 0
    # Table 2 for the baselines with M; the hybrid's M' adds the 80*2+1 norms once per generation TP rank
    hfv, ds, hy = (out["strategies"][k] for k in ("hybridflow_v", "ds_chat", "hybrid"))
    assert Fraction(hfv["bytes_per_gpu_mean"]) == Fraction(63, 64) * m
    assert Fraction(ds["bytes_per_gpu_mean"]) == Fraction(127, 128) * m
    assert hfv["peak_extra_bytes_per_gpu"] == ds["peak_extra_bytes_per_gpu"] == m
    norms = (2 * 80 + 1) * 8192 * 2
    m_eff = m + 7 * norms
    assert Fraction(hy["bytes_per_gpu_mean"]) == Fraction(64 - 8, 8 * 64) * m_eff
    assert hy["peak_extra_bytes_per_gpu"] == m_eff // 8  # p_g = 1: every generation shard holds both ends
    assert hy["padding_bytes_per_gpu_max"] > 0  # stage 0 (embedding) and stage 7 (output) are larger


def test_plan_text_and_subprocess_entry():
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", "--model", "llama-7b", "--train-tp", "8",
                           "--gen-tp", "2", "--dtype", "fp32"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "M = 26,953,662,464 bytes" in proc.stdout  # 6,738,415,616 params x 4 bytes
    assert "micro_dp_groups  [0, 1, 2, 3] [4, 5, 6, 7]" in proc.stdout
    assert "gen_tp_groups    [0, 4] [1, 5] [2, 6] [3, 7]" in proc.stdout
    for name in ("hybrid", "ds_chat", "hybridflow_v"):
        assert f"\n{name} " in proc.stdout


def test_plan_from_local_config_folder(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False).save_pretrained(tmp_path)
    out = _plan_json(capsys, "--model", str(tmp_path), "--train-tp", "4", "--train-pp", "2",
                     "--gen-tp", "2", "--gen-pp", "1", "--per-rank")
    params = 2 * 1000 * 64 + 4 * (64 * 64 * 2 + 2 * 32 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert out["model_bytes"] == 2 * params
    assert out["micro_dp_groups"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert out["ranks"][6]["composed_of_ranks"] == [2, 3, 6, 7] and out["ranks"][6]["gen"]["tp"] == 1
    assert len(out["per_rank_costs"]["hybrid"]) == 8


@pytest.mark.parametrize("args,needle", [
    (["--model", "llama-70b", "--train-tp", "8", "--gen-tp", "3"],
     "--train-tp 8 is not divisible by --gen-tp 3"),
    (["--model", "llama-70b", "--train-tp", "4", "--gen-tp", "8"], "--gen-tp 8 is larger than --train-tp 4"),
    (["--model", "llama-70b", "--train-pp", "3"], "num_layers=80 is not divisible by pp*vpp=3"),
    (["--model", "llama-13b", "--train-tp", "3"], "num_attention_heads=40 is not divisible by tp=3"),
    (["--model", "llama-1b"], "neither a preset"),
    (["--model", "qwen3-30b-a3b", "--train-dp", "4", "--train-ep", "4", "--gen-ep", "3"],
     "--gen-ep 3 does not divide --train-ep 4"),
    (["--model", "mixtral-8x7b", "--train-dp", "6", "--train-ep", "6"], "ep=6 needs a mixture-of-experts model "
                                                                        "whose experts it divides (the model has 8)"),
])
def test_plan_refusals(capsys, args, needle):
    assert _plan(*args) == 2
    err = capsys.readouterr().err
    assert needle in err and "hybridrl plan:" in err


def test_plan_of_an_moe_preset(capsys):
    """Qwen3-30B-A3B at the GPU recipe's layout (t=4, ep=4 on 16 GPUs) -> t_g=4, e_g=1: each GPU receives the
    other three expert blocks of its TP shard and nothing else; the text report names the expert groups."""
    assert _plan("--model", "qwen3-30b-a3b", "--train-tp", "4", "--train-dp", "4", "--train-ep", "4",
                 "--gen-tp", "4", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    expert_bytes = report["expert_bytes"]
    assert report["num_experts"] == 128 and report["train"]["ep"] == 4 and report["gen"]["ep"] == 1
    assert report["expert_gather_groups"][0] == [0, 4, 8, 12]
    hybrid = report["strategies"]["hybrid"]
    assert hybrid["bytes_per_gpu_max"] == expert_bytes // 4 * 3 // 4
    assert hybrid["redundant_bytes_per_gpu_max"] == 0
    assert hybrid["bytes_per_gpu_mean"] < report["strategies"]["hybridflow_v"]["bytes_per_gpu_mean"] / 4
    assert _plan("--model", "qwen3-30b-a3b", "--train-tp", "4", "--train-dp", "4", "--train-ep", "4",
                 "--gen-tp", "4") == 0
    assert "expert_gather_groups [0, 4, 8, 12]" in capsys.readouterr().out


def test_plan_of_an_moe_preset_with_expert_tp_below_tp(capsys):
    """Qwen3-30B-A3B at t=4 with whole experts (expert_tp=1) spread over all 16 GPUs (ep=16 > d=4) -> t_g=4:
    each GPU holds 8 whole experts per layer and receives the other 15 blocks at its TP shard (its own block's
    piece it copies), so it takes E/16 * 15/4 bytes; the regroup runs inside the 16 ranks of a stage and hybrid
    holds the training experts (E/16) beside the generation shard."""
    assert _plan("--model", "qwen3-30b-a3b", "--train-tp", "4", "--train-dp", "4", "--train-ep", "16",
                 "--train-etp", "1", "--gen-tp", "4", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    expert_bytes = report["expert_bytes"]
    assert report["train"]["expert_tp"] == 1 and report["train"]["ep"] == 16
    assert report["expert_gather_groups"] == [list(range(16))]
    hybrid = report["strategies"]["hybrid"]
    assert hybrid["bytes_per_gpu_max"] == expert_bytes // 16 * 15 // 4
    assert hybrid["redundant_bytes_per_gpu_max"] >= expert_bytes // 16
    assert _plan("--model", "qwen3-30b-a3b", "--train-tp", "4", "--train-dp", "4", "--train-ep", "16",
                 "--train-etp", "1", "--gen-tp", "4", "--gen-ep", "2") == 2
    assert "generation runs e_g = 1" in capsys.readouterr().err


def test_presets_are_real_llama_sizes():
    assert LLAMA_PRESETS["llama-34b"]["num_key_value_heads"] == 8
    assert {k: v["num_hidden_layers"] for k, v in LLAMA_PRESETS.items()} == {
        "llama-7b": 32, "llama-13b": 40, "llama-34b": 48, "llama-70b": 80, "llama3-70b": 80}
