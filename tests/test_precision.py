"""`dtype: auto`, every model's default: bf16 where it is native and pays (a bf16 GPU; a CPU with bf16 units and a
model of hidden >= 512), float32 elsewhere, decided once in the plan and read by every role, the rollout engine and
the memory plan."""
from __future__ import annotations

import pytest

from hybridrl.cli.train import DEFAULT_CONFIG
from hybridrl.config import ConfigError, load_config
from hybridrl.models.precision import CPU_BF16_MIN_HIDDEN, auto_dtype, cpu_has_native_bf16, model_dtype
from hybridrl.models.tiny import create_tiny_model
from hybridrl.trainer.plan import plan_run


@pytest.mark.parametrize("hidden, cpu_bf16, on_gpu, expected", [
    (64, True, False, "float32"),  # a tiny model: per-op overhead, bf16's casts cost more than they save
    (CPU_BF16_MIN_HIDDEN - 1, True, False, "float32"),
    (CPU_BF16_MIN_HIDDEN, True, False, "bfloat16"),  # matmuls decide: AMX / AVX512-BF16 run them several times faster
    (4096, False, False, "float32"),  # no bf16 units: bf16 would be emulated through fp32
    (64, False, True, "bfloat16"),  # a GPU: bf16 mixed precision whatever the size
])
def test_auto_is_bf16_where_native_and_worth_it(hidden, cpu_bf16, on_gpu, expected):
    assert auto_dtype(hidden, on_gpu=on_gpu, cpu_bf16=cpu_bf16) == expected


def test_a_named_dtype_is_kept(tmp_path):
    folder = create_tiny_model(tmp_path / "m", hidden=CPU_BF16_MIN_HIDDEN, layers=1, heads=4, kv_heads=4)
    for name in ("float32", "bfloat16", "float16"):
        assert model_dtype(name, folder) == name
        assert model_dtype(name, folder, on_gpu=True) == name


def test_plan_writes_the_concrete_dtype_every_role_reads(tmp_path):
    """The bundled tiny model plans float32 for the actor, the reference and vLLM; a model of hidden 512 plans what
    this machine's CPU makes of it (bf16 with AMX / AVX512-BF16), and for a GPU machine bf16; a named dtype stays."""
    cfg = load_config("ppo_tiny")
    plan = plan_run(cfg)
    assert (cfg.actor.model.dtype, cfg.ref.model.dtype, cfg.critic.model.dtype) == ("float32",) * 3
    assert plan.rollout.vllm.dtype == "float32"

    wide = create_tiny_model(tmp_path / "wide", hidden=CPU_BF16_MIN_HIDDEN, layers=1, heads=4, kv_heads=4)
    here = "bfloat16" if cpu_has_native_bf16() else "float32"
    cfg = load_config(DEFAULT_CONFIG, [f"actor.model.path={wide}"])
    plan = plan_run(cfg)
    assert (cfg.actor.model.dtype, cfg.ref.model.dtype, plan.rollout.vllm.dtype) == (here,) * 3

    cfg = load_config(DEFAULT_CONFIG, [f"actor.model.path={wide}", "ref.model.dtype=float32"])
    plan_run(cfg, on_gpu=True)
    assert (cfg.actor.model.dtype, cfg.ref.model.dtype) == ("bfloat16", "float32")


def test_unknown_dtype_is_refused_naming_auto():
    with pytest.raises(ConfigError, match=r"actor.model.dtype.*'auto'"):
        plan_run(load_config(DEFAULT_CONFIG, ["actor.model.dtype=fp32"]))
