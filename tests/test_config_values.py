"""Every option of config.py with a bad value: `hybridrl train --check` refuses it in one line naming the
option, exit code 2, without starting Ray. The table must cover every option (a new option needs a row)."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from hybridrl.cli import main
from hybridrl.config import HybridRLConfig

ROLE_BAD = {  # per model section (actor, ref, critic)
    "model.path": "/nonexistent/model", "model.dtype": "int8", "parallel.tp": 0, "parallel.pp": 0,
    "parallel.dp": 0, "parallel.sequence_parallel": "maybe", "optim.optimizer": "lion", "optim.lr": -1,
    "optim.weight_decay": -0.1, "optim.betas": "[0.9]", "optim.clip_grad": -1, "optim.warmup_steps": -1,
    "optim.use_distributed_optimizer": "maybe", "micro_batch_size": 0, "max_tokens_per_micro_batch": 0,
    "pool": "''", "parallel.ep": 0, "parallel.expert_tp": 0, "moe.aux_loss_coef": -1, "moe.z_loss_coef": -1,
    "parallel.fsdp": "zero3",
    "lora.rank": -1, "lora.alpha": 0, "lora.dropout": 1.0, "lora.target_modules": "[attn]", "lora.init": "/nonexistent",
    "lora.generation": "weird", "offload.grads": "maybe", "offload.optimizer": "maybe", "offload.params": "maybe",
}
SCORER_BAD = {  # per score-model section (reward_model, cost_model)
    "model": "/nonexistent/rm", "dtype": "int8", "pool": "''", "parallel.tp": 0, "parallel.pp": 0,
    "parallel.dp": 0, "parallel.sequence_parallel": "maybe", "micro_batch_size": 0,
    "max_tokens_per_micro_batch": 0, "tokenizer": "/nonexistent/tok", "chat_template": "maybe", "parallel.ep": 0,
    "parallel.expert_tp": 0, "format": "'Human: {prompt}'", "parallel.fsdp": "zero3",
    # generative judges (kind=generative)
    "kind": "weird", "template": "''", "parser.name": "nope", "parser.pattern": "'(unclosed'",
    "parser.score_range": "[5, 1]", "parser.choices": "[a]", "parser.choice_values": "[.nan, 1]",
    "parser.module": "no_such_module_xyz", "on_parse_error": "weird", "generation.engine": "sglang",
    "generation.tp": 0, "generation.max_new_tokens": 0, "generation.temperature": -1, "generation.max_model_len": 0,
    "generation.max_batch_size": 0, "generation.vllm.dtype": "int8", "generation.vllm.kv_cache_memory_bytes": 0,
    "generation.vllm.gpu_memory_utilization": 1.5, "generation.vllm.enable_prefix_caching": "maybe",
    "generation.vllm.enable_sleep_mode": "maybe",
}
DISTILL_BAD = {  # algorithm.distill: the teacher and where it runs
    "teacher": "/nonexistent/teacher", "coef": -1, "mode": "weird", "pool": "''", "dtype": "int8",
    "parallel.tp": 0, "parallel.pp": 0, "parallel.dp": 0, "parallel.sequence_parallel": "maybe", "parallel.ep": 0,
    "parallel.expert_tp": 0, "micro_batch_size": 0, "max_tokens_per_micro_batch": 0, "parallel.fsdp": "zero3",
}
BAD = {
    "algorithm.name": "nope", "algorithm.module": "no_such_module_xyz", "algorithm.gamma": 1.5,
    "algorithm.lam": -0.1, "algorithm.clip_ratio": 0, "algorithm.clip_ratio_high": -1, "algorithm.value_clip": 0,
    "algorithm.entropy_coef": -1, "algorithm.ppo_epochs": 0, "algorithm.mini_batch_size": 0,
    "algorithm.kl.type": "weird", "algorithm.kl.coef": -1, "algorithm.kl.mode": "weird",
    "algorithm.kl.estimator": "k9", "algorithm.kl.target": 0, "algorithm.kl.horizon": 0,
    "algorithm.kl.final_coef": -1, "algorithm.rollout_correction": "weird", "algorithm.max_refill_rounds": -1,
    "algorithm.overlong_buffer": -1, "algorithm.overlong_penalty": -1, "algorithm.loss_agg": "weird",
    "algorithm.rollout_correction_cap": 0.5, "algorithm.rollout_correction_level": "weird",
    "algorithm.cost_limit": "inf", "algorithm.lagrangian_lr": 0, "algorithm.lagrangian_init": -1, "algorithm.max_staleness": -1,
    **{f"algorithm.distill.{key}": value for key, value in DISTILL_BAD.items()},
    **{f"{role}.{key}": value for role in ("actor", "ref", "critic") for key, value in ROLE_BAD.items()},
    "rollout.engine": "sglang", "rollout.tp": 0, "rollout.ep": 0, "rollout.pp": 2, "rollout.n": 0, "rollout.temperature": -1,
    "rollout.top_p": 1.5, "rollout.top_k": -2, "rollout.max_new_tokens": 0, "rollout.ignore_eos": "maybe",
    "rollout.reshard": "weird", "rollout.bucket_mb": 0, "rollout.max_model_len": 0, "rollout.max_batch_size": 0, "rollout.pool": "''",
    "rollout.partial": "maybe", "rollout.routing_replay": "maybe", "rollout.record_routing": "maybe",
    "rollout.env": "no_such_env", "rollout.env_kwargs": "{turns: 2}", "rollout.max_turns": 0,
    "rollout.max_episode_tokens": 0, "rollout.turn_discount": 1.5,
    "rollout.vllm.dtype": "int8", "rollout.vllm.kv_cache_memory_bytes": 0, "rollout.vllm.gpu_memory_utilization": 1.5,
    "rollout.vllm.enable_prefix_caching": "maybe", "rollout.vllm.enable_sleep_mode": "maybe",
    "rollout.agent": "no_such_module_xyz:agent", "rollout.agent_concurrency": 0, "rollout.agent_timeout_s": 0,
    "rollout.agent_failure_reward": "nan", "rollout.endpoint.host": "''", "rollout.endpoint.port": 70000,
    "rollout.endpoint.max_request_bytes": 10, "rollout.endpoint.max_n": 0, "rollout.endpoint.batch_window_ms": -1,
    "rollout.endpoint.sampling": "weird",
    "rollout.tool_sandbox": "docker", "rollout.tool_sandbox_url": "ftp://sandbox:8080",
    "reward.fn": "no_such_module_xyz:score", "reward.cost_fn": "no_such_module_xyz:cost",
    "reward.num_workers": -1, "reward.sources": "[{name: ''}]",
    **{f"{section}.{key}": value for section in ("reward_model", "cost_model") for key, value in SCORER_BAD.items()},
    "data.train_files": "[/nonexistent.jsonl]", "data.prompt_key": "''", "data.chat_template": "maybe",
    "data.batch_size": 0, "data.max_prompt_length": 0, "data.overlong_prompts": "weird", "data.shuffle": "maybe",
    "data.seed": -1,
    "resources.devices": 0, "resources.nodes": 0, "resources.ray_address": "not an address",
    "resources.auto_map": "maybe", "resources.pools": "{p: 0}", "resources.node_devices": "{default: [1, 1]}",
    "trainer.steps": 0, "trainer.seed": -1, "trainer.log_every": -1, "trainer.save_every": -1,
    "trainer.keep_last": 0, "trainer.resume": "/nonexistent/ckpt", "trainer.max_restarts": -1,
    "trainer.on_nan": "weird", "trainer.mode": "weird", "trainer.max_skipped_steps": 0, "trainer.trackers": "[nope]",
    "trainer.project": "''", "trainer.progress_bar": "maybe", "trainer.call_timeout_s": 0,
    "trainer.hang_timeout_s": -1, "trainer.save_on_signal": "maybe", "trainer.signal_grace_s": 0,
    "trainer.start_timeout_s": 0,
}
# refused elsewhere, with another exit code: an unwritable run folder is the machine's refusal (exit 5,
# tests/test_train_config.py)
ELSEWHERE = {"trainer.run_dir"}


def _options(node, prefix: str = "") -> list[str]:
    out = []
    for key in node:
        value = node[key]
        if OmegaConf.is_dict(value) and key not in ("pools", "env_kwargs", "node_devices"):
            out += _options(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def test_every_option_has_a_bad_value():
    options = set(_options(OmegaConf.structured(HybridRLConfig)))
    assert options - set(BAD) - ELSEWHERE == set(), "options without a row in BAD"
    assert set(BAD) - options == set(), "rows for options that do not exist"


@pytest.mark.parametrize("option", sorted(BAD))
def test_bad_value_is_refused_in_one_line_before_ray(option, capsys):
    import ray

    leaf = option.rsplit(".", 1)[-1]
    assert main(["train", "--check", f"{option}={BAD[option]}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridrl train: config error: "), err
    assert leaf in err[0], err  # the option is named
    assert not ray.is_initialized()


def test_check_passes_a_good_config(capsys):
    assert main(["train", "--check"]) == 0
    assert capsys.readouterr().out.startswith("config ok: remax")
