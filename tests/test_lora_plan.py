"""The run plan's LoRA decisions and refusals, the plan / plan --auto accounting and the GPU recipe (no Ray, no
workers: every check here runs before anything starts)."""
from __future__ import annotations

import json

import pytest

from hybridrl.config import CONFIG_DIR, ConfigError, load_config
from hybridrl.trainer.plan import plan_run

RECIPE = CONFIG_DIR / "gpu" / "lora" / "grpo_llama3_70b_lora_8gpu.yaml"
AUTO = ["plan", "--auto", "--model", "llama3-70b", "--algorithm", "grpo", "--gpus", "8", "--gpu", "h100",
        "--execution", "trainer", "--reward-model", "none", "--batch", "128", "--n", "8", "--prompt-len", "512",
        "--response-len", "1024", "--mini-batches", "1", "--json"]


def test_a_lora_actor_is_its_own_reference():
    plan = plan_run(load_config("grpo_lora_tiny"))
    assert plan.step.reference and plan.step.reference_from_actor and "ref" not in plan.roles
    assert plan.lora["actor"].rank == 16 and plan.lora["actor"].alpha == 32.0
    full = plan_run(load_config("grpo_tiny"))
    assert "ref" in full.roles and not full.step.reference_from_actor


def test_every_algorithm_and_run_kind_plans_with_lora():
    """Every registered algorithm, and the async / multi-turn / agent runs, take a LoRA actor (and critics): planned
    before anything starts, the reference (where the step needs one) from the actor's base, no reference model.
    (tests/test_lora_train.py trains GRPO, ReMax multi-turn, GSPO asynchronously and PPO with a LoRA critic.)"""
    from hybridrl.algorithms.registry import ALGORITHMS

    for name in sorted(ALGORITHMS.keys()):
        config = f"{name}_tiny" if (CONFIG_DIR / f"{name}_tiny.yaml").is_file() else None
        plan = plan_run(load_config(config, [f"algorithm.name={name}", "actor.lora.rank=4", "critic.lora.rank=4"]))
        assert plan.lora["actor"].rank == 4 and "ref" not in plan.roles, name
        assert plan.step.reference_from_actor == plan.step.reference, name
        critics = {"critic", "cost_critic"} & set(plan.roles)
        assert not critics or "critic" in plan.lora, name  # the cost critic is built from critic.* too
    for config in ("remax_async_tiny", "grpo_multiturn_tiny", "grpo_agent_tiny"):
        plan = plan_run(load_config(config, ["actor.lora.rank=4"]))
        assert plan.step.reference_from_actor and "ref" not in plan.roles, config


def test_a_reference_of_another_model_is_still_built(tmp_path):
    from hybridrl.models.tiny import create_tiny_model

    other = create_tiny_model(tmp_path / "other", vocab_size=64, hidden=64, layers=2, heads=4, kv_heads=2, seed=9)
    plan = plan_run(load_config("grpo_lora_tiny", [f"ref.model.path={other}"]))
    assert "ref" in plan.roles and not plan.step.reference_from_actor


@pytest.mark.parametrize("override, message", [
    ("ref.lora.rank=4", "ref.lora: the reference policy is frozen"),
    ("actor.lora.init=/nowhere", "actor.lora.init='/nowhere': is not kaiming, gaussian, a PEFT adapter folder"),
    ("actor.lora.target_modules=[qkv,attn]", "actor.lora.target_modules=['qkv', 'attn']: names a module LoRA"),
    ("actor.lora.dropout=1.0", "actor.lora.dropout=1.0: must be in [0, 1)"),
    ("actor.lora.generation=forward", "actor.lora.generation=forward generates with the training model's own"),
    ("critic.lora.alpha=-1", "critic.lora.alpha=-1.0: must be > 0"),
])
def test_lora_refusals_are_one_line_before_anything_starts(override, message):
    with pytest.raises(ConfigError) as exc:
        plan_run(load_config("grpo_lora_tiny", [override]))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_peft_folder_as_lora_init_must_agree_with_the_settings(tmp_path):
    from lora_helpers import make_peft_adapter

    from hybridrl.models.tiny import default_model_dir

    folder = make_peft_adapter(str(default_model_dir()), tmp_path / "a", rank=4, alpha=8, targets=["q_proj", "v_proj"])
    plan = plan_run(load_config("grpo_lora_tiny", [f"actor.lora.init={folder}", "actor.lora.rank=0",
                                                   "actor.lora.alpha=null", "actor.lora.target_modules=null"]))
    assert (plan.lora["actor"].rank, plan.lora["actor"].alpha) == (4, 8.0)
    assert plan.lora["actor"].target_modules == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="actor.lora.rank=16 but the adapter in lora.init has rank 4"):
        plan_run(load_config("grpo_lora_tiny", [f"actor.lora.init={folder}"]))


def test_plan_reports_the_adapters_and_their_sync_bytes(capsys):
    from hybridrl.cli import main

    assert main(["plan", "--model", "llama3-70b", "--train-tp", "4", "--train-dp", "2", "--gen-tp", "4",
                 "--lora-rank", "16", "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["lora"]
    # Llama-3-70B: per layer r x (q 16384 + k 9216 + v 9216 + o 16384 + gate, up, down 3 x 36864) x 80 layers
    assert lora["adapter_params"] == 16 * 80 * (16384 + 2 * 9216 + 16384 + 3 * 36864)
    assert lora["sync_bytes_per_rollout_rank"] == 2 * lora["adapter_params"]
    assert lora["sync_bytes_per_rollout_rank"] / lora["full_sync_bytes_per_rollout_rank"] < 0.02


def test_the_gpu_recipe_is_what_plan_auto_derives_with_lora(capsys):
    from hybridrl.cli import main

    assert main(AUTO + ["--lora-rank", "16"]) == 0
    report = json.loads(capsys.readouterr().out)
    actor = report["best"]["roles"]["actor"]
    assert report["roles"] == ["actor"] and report["lora"]["reference"]  # no reference model: the actor's base
    cfg = load_config(RECIPE)
    assert (actor["parallel"]["tp"], actor["parallel"]["pp"], actor["parallel"]["dp"]) == \
        (cfg.actor.parallel.tp, cfg.actor.parallel.pp, cfg.actor.parallel.dp)
    assert (actor["generation"]["tp"], actor["micro_batch_size"]) == (cfg.rollout.tp, cfg.actor.micro_batch_size)
    assert main(AUTO + ["--lora-rank", "0"]) == 2  # full fine-tuning (+ a reference) does not fit 8 GPUs
    assert "do not fit" in capsys.readouterr().err


def test_the_gpu_recipe_plans_once_its_placeholders_are_set(tmp_path):
    from hybridrl.models.tiny import create_tiny_model

    with pytest.raises(ConfigError, match="actor.model.path='/path/to/"):
        plan_run(load_config(RECIPE))
    policy = create_tiny_model(tmp_path / "policy", vocab_size=64, hidden=256, layers=8, heads=8, kv_heads=8)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(8)))
    plan = plan_run(load_config(RECIPE, [f"actor.model.path={policy}", f"data.train_files=[{data}]"]))
    assert plan.step.reference_from_actor and set(plan.roles) == {"actor"}


def test_vllm_serves_adapters_itself_only_where_it_can(tmp_path):
    """rollout.engine=vllm: the engine takes the adapters as its own LoRA adapter unless the output layer or experts
    are adapted, the rank is above vLLM's largest, or the base is itself a PEFT folder; then W + BA is pushed in place
    as for full fine-tuning."""
    from hybridrl.config import LoraConfig
    from hybridrl.models.peft import model_config
    from hybridrl.models.tiny import default_model_dir, resolve_model_path
    from hybridrl.rollout.vllm_lora import vllm_adapter_support, vllm_lora_rank

    dense, moe = str(default_model_dir()), resolve_model_path("tiny:qwen3_moe")
    dense_hf, moe_hf = model_config(dense), model_config(moe)
    assert vllm_adapter_support(LoraConfig(rank=16, target_modules=["all"]), dense, dense_hf) is None
    assert "lm_head" in vllm_adapter_support(LoraConfig(rank=16, target_modules=["all", "lm_head"]), dense, dense_hf)
    assert "above vLLM's 512" in vllm_adapter_support(LoraConfig(rank=1024), dense, dense_hf)
    assert vllm_adapter_support(LoraConfig(rank=8, target_modules=["qkv", "proj"]), moe, moe_hf) is None
    assert "experts" in vllm_adapter_support(LoraConfig(rank=8, target_modules=["fc1"]), moe, moe_hf)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": dense}))
    assert "PEFT adapter folder" in vllm_adapter_support(LoraConfig(rank=8), str(tmp_path), dense_hf)
    assert [vllm_lora_rank(r) for r in (1, 4, 16, 17, 300)] == [1, 8, 16, 32, 320]
