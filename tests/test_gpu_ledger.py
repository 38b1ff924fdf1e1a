"""The memory ledger (automap/ledger.py, `hybridrl plan --memory`): what stays on one GPU of a colocated pool in each
phase, vLLM's copy, runtime and KV cache and the offload included (issue 36 Must show 3, issue 34 item 6). Checked
by hand on small cases, against `plan --auto` (the same model drives the search), and on every GPU recipe under
configs/gpu/: each fits its GPUs and its header quotes the ledger's line. Pure: no Ray, no process group, no vLLM.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.automap.cost import ModelStats
from hybridrl.automap.hardware import GiB, gpu
from hybridrl.automap.ledger import VLLM_ASLEEP_BYTES, VLLM_RUNTIME_BYTES, Generation, RoleLoad, pool_ledger
from hybridrl.decode_memory import DECODE_BYTES_PER_LOGIT, KV_SHARE_OF_FREE, decode_rows
from hybridrl.config import CONFIG_DIR, load_config

H100 = gpu("h100")
RECIPES = sorted(p.relative_to(CONFIG_DIR / "gpu").as_posix() for p in (CONFIG_DIR / "gpu").rglob("*.yaml"))


def _stats(layers=32, hidden=4096, vocab=32000, heads=32, kv_heads=32, ffn=11008) -> ModelStats:
    layer = 2 * hidden * hidden + 2 * hidden * (hidden * kv_heads // heads) + 3 * hidden * ffn + 2 * hidden
    return ModelStats("m", layers * layer + 2 * vocab * hidden + hidden, layers * layer, vocab * hidden,
                      vocab * hidden + hidden, layers, hidden, vocab, heads, kv_heads, hidden // heads)


def test_states_and_phases_by_hand():
    """7B-shaped actor at t=8, d=1, bf16 + reference, vLLM at t_g=2 with half the device: every line by hand."""
    m = _stats()
    shard = m.shard_params(8, 1)
    actor = RoleLoad("actor", m, trained=True, t=8, p=1, d=1)
    ref = RoleLoad("ref", m, t=8)
    assert actor.states() == {"weights": 2 * shard, "gradients": 4 * shard, "optimizer": 12 * shard}
    gen = Generation("actor", "vllm", tp=2, context=2048, gpu_memory_utilization=0.5)
    ledger = pool_ledger([actor, ref], H100, [gen])
    gen_shard = 2 * m.shard_params(2, 1)
    resident = 2 * shard + 4 * shard + 12 * shard + 2 * shard
    assert ledger.generation["actor"] == {"hybrid_engine_buffer": gen_shard - 2 * shard, "vllm_weights": gen_shard,
                                          "vllm_runtime": VLLM_RUNTIME_BYTES,
                                          "vllm_kv_cache": 40 * GiB - gen_shard - VLLM_RUNTIME_BYTES}
    assert ledger.phases["generation:actor"] == pytest.approx(resident + gen_shard - 2 * shard + 40 * GiB)
    assert ledger.phases["push:actor"] == pytest.approx(resident + gen_shard - 2 * shard + gen_shard)
    assert ledger.phases["experience"] == pytest.approx(resident + VLLM_ASLEEP_BYTES)  # no activations given
    per_sequence = 2048 * 2 * 32 * 16 * 128 * 2  # context x (K, V) x layers x heads / t_g x head_dim x bf16
    assert ledger.kv_sequences["actor"] == int(ledger.generation["actor"]["vllm_kv_cache"] // per_sequence)
    room = ledger.capacity - resident - (gen_shard - 2 * shard)
    assert ledger.max_vllm_utilization["actor"] == int(100 * room / H100.memory_bytes) / 100
    # the same pool generating natively: no second copy, max_batch_size rows of KV cache and of a decode step's
    # logits and sampling (32000 vocabulary entries x 40 B a row)
    per_row = per_sequence + 32000 * DECODE_BYTES_PER_LOGIT
    native = pool_ledger([actor, ref], H100, [Generation("actor", "native", 2, 2048, max_batch_size=8)])
    assert native.phases["generation:actor"] == pytest.approx(resident + gen_shard - 2 * shard + 8 * per_row)
    assert native.generation["actor"]["kv_cache"] == 8 * per_sequence
    assert native.phases["experience"] == pytest.approx(resident)  # no vLLM asleep beside it
    # 256 rows (the default) do not fit beside the states: the engine decodes as many as 90% of the room holds
    wide = pool_ledger([actor, ref], H100, [Generation("actor", "native", 2, 2048, max_batch_size=256)])
    rows = int(KV_SHARE_OF_FREE * (wide.capacity - resident - (gen_shard - 2 * shard)) // per_row)
    assert 8 < rows < 256 and wide.kv_sequences["actor"] == rows and wide.fits
    assert wide.phases["generation:actor"] == pytest.approx(resident + gen_shard - 2 * shard + rows * per_row)
    # the engine's rule on a GPU (rollout/native.py chunk_rows): the cap, or what 90% of the free memory holds
    assert decode_rows(256, None, per_sequence) == 256  # a CPU: the cap alone
    assert decode_rows(256, 10 * GiB, GiB) == 9 and decode_rows(4, 10 * GiB, GiB) == 4
    assert decode_rows(256, GiB, 2 * GiB) == 1  # at least one row (whether it fits is the ledger's verdict)
    assert set(ledger.phases) == {"experience", "update:actor", "generation:actor", "push:actor"}


def test_offload_leaves_the_room_to_the_kv_cache():
    m = _stats()
    on = dict(offload_grads=True, offload_optimizer=True)
    plain = RoleLoad("actor", m, trained=True, t=8)
    away = RoleLoad("actor", m, trained=True, t=8, **on)
    critic = RoleLoad("critic", m, trained=True, t=8, lm_head=False, **on)
    gen = [Generation("actor", "vllm", 8, 2048)]
    states = plain.states()
    before, after = pool_ledger([plain], H100, gen), pool_ledger([away], H100, gen)
    freed = states["gradients"] + states["optimizer"]
    assert before.phases["generation:actor"] - after.phases["generation:actor"] == pytest.approx(freed)
    assert after.phases["update:actor"] == before.phases["update:actor"]  # restored before the update
    both = pool_ledger([away, critic], H100, gen)  # the actor's update: the critic's states stay away
    assert both.phases["update:actor"] == pytest.approx(before.phases["update:actor"] + critic.states()["weights"])
    params = pool_ledger([RoleLoad("actor", m, trained=True, t=8, offload_params=True, **on)], H100, gen)
    assert params.generation["actor"]["hybrid_engine_buffer"] == 0.0
    assert params.phases["generation:actor"] == pytest.approx(after.phases["generation:actor"] - states["weights"])
    assert params.phases["push:actor"] > params.phases["experience"]  # both copies while the push runs


def test_experts_and_adapters_by_hand():
    """Experts split over ep x etp in training and held whole per generation TP rank; their optimizer over the
    expert-data-parallel ranks (t d / (ep etp)). A LoRA actor whose adapters vLLM serves: no reshard buffer."""
    m = _stats(layers=4, hidden=256, vocab=1000, ffn=512)
    experts = 4 * 1_000_000
    load = RoleLoad("actor", m, expert_params=experts, trained=True, t=4, p=1, d=4, ep=4)
    dense = m.shard_params(4, 1) - experts / 4
    expert_shard = experts / (4 * 4)
    assert load.shard() == pytest.approx(dense + expert_shard)
    assert load.shard(4, training=False) == pytest.approx(dense + experts / 4)
    assert load.states()["optimizer"] == pytest.approx(12 * (dense / 4 + expert_shard / 1))
    lora = RoleLoad("actor", m, trained=True, t=2, adapters=0.01)
    shard = m.shard_params(2, 1)
    assert lora.states() == pytest.approx({"weights": 2 * shard * 1.01, "gradients": 4 * 0.01 * shard,
                                           "optimizer": 12 * 0.01 * shard})
    served = pool_ledger([lora], H100, [Generation("actor", "vllm", 1, 1024, own_weights=True)])
    assert served.generation["actor"]["hybrid_engine_buffer"] == 0.0 and "push:actor" not in served.phases


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, str]:
    """config.json-only folders of the recipes' real architectures (the plan reads only the config)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    from hybridrl.hybrid_engine.model_shapes import LLAMA_PRESETS

    root = tmp_path_factory.mktemp("shapes")
    out = {}
    for name in ("llama-7b", "llama-13b", "llama-34b", "llama-70b", "llama3-70b"):
        for head in ("policy", "reward"):
            config = LlamaConfig(**LLAMA_PRESETS[name], architectures=[
                "LlamaForSequenceClassification" if head == "reward" else "LlamaForCausalLM"])
            config.num_labels = 1
            config.save_pretrained(str(root / f"{name}-{head}"))
            out[f"{name}-{head}"] = str(root / f"{name}-{head}")
    Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=False,
                architectures=["Qwen2ForCausalLM"]).save_pretrained(str(root / "qwen2.5-7b"))
    Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                   num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                   moe_intermediate_size=768, norm_topk_prob=True,
                   architectures=["Qwen3MoeForCausalLM"]).save_pretrained(str(root / "qwen3-30b-a3b"))
    out.update({"qwen2.5-7b": str(root / "qwen2.5-7b"), "qwen3-30b-a3b": str(root / "qwen3-30b-a3b")})
    data = root / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1 =", "answer": "2"}) + "\n")
    out["data"] = str(data)
    return out


def recipe_overrides(recipe: str, shapes: dict[str, str]) -> list[str]:
    """The recipe's /path/to/ placeholders as folders of the architecture it is written for."""
    if recipe.startswith("judge/"):
        scorer = "llama-70b" if "llama70b" in recipe else "llama-7b"
        key = "algorithm.distill.teacher" if "opd" in recipe else "reward_model.model"
        return [f"actor.model.path={shapes['llama-7b-policy']}", f"{key}={shapes[scorer + '-policy']}"]
    if recipe.startswith("lora/"):
        return [f"actor.model.path={shapes['llama3-70b-policy']}", "reward.fn=hybridrl.data.tasks:charset_reward"]
    if recipe.startswith("moe/"):
        return [f"actor.model.path={shapes['qwen3-30b-a3b']}", "reward.fn=hybridrl.data.tasks:charset_reward"]
    if recipe.startswith("tools/"):
        return [f"actor.model.path={shapes['qwen2.5-7b']}"]
    size = recipe.split("_")[2]  # ppo_llama2_13b_16gpu.yaml (34b: CodeLlama-34B, the same Llama architecture)
    return [f"actor.model.path={shapes[f'llama-{size}-policy']}", f"reward_model.model={shapes[f'llama-{size}-reward']}"]


def recipe_ledgers(recipe: str, shapes: dict[str, str], device: str = "h100") -> dict:
    from hybridrl.trainer.plan import plan_run
    from hybridrl.trainer.plan_memory import plan_memory

    cfg = load_config(CONFIG_DIR / "gpu" / recipe, recipe_overrides(recipe, shapes) + [f"data.train_files=[{shapes['data']}]"])
    return plan_memory(plan_run(cfg), cfg, gpu(device))


@pytest.fixture
def no_vllm_import(monkeypatch):
    from hybridrl.trainer import plan as plan_module

    monkeypatch.setattr(plan_module, "_vllm_unsupported", lambda path: None)  # vLLM's import (~20 s) is not the point


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_gpu_recipe_fits_by_the_ledger_and_its_header_says_so(recipe, shapes, no_vllm_import):
    ledgers = recipe_ledgers(recipe, shapes)
    header = (CONFIG_DIR / "gpu" / recipe).read_text()
    for pool, ledger in ledgers.items():
        assert ledger.fits, (pool, ledger.summary(pool, "h100"))
        for role, share in ledger.max_vllm_utilization.items():  # the share vLLM takes leaves room for the rest
            assert ledger.phases[f"generation:{role}"] <= ledger.capacity, (pool, role, share)
        line = f"# Memory per GPU, {ledger.summary(pool, 'h100')}"
        assert line in header, f"{recipe}: its header should quote\n{line}"


def test_plan_memory_command(shapes, no_vllm_import, capsys):
    from hybridrl.cli import main

    recipe = CONFIG_DIR / "gpu" / "ppo_llama2_13b_16gpu.yaml"
    base = ["plan", "--memory", str(recipe), "--gpu", "h100", "--set", f"data.train_files=[{shapes['data']}]"]
    base += [arg for o in recipe_overrides("ppo_llama2_13b_16gpu.yaml", shapes) for arg in ("--set", o)]
    assert main(base + ["--json"]) == 0
    default = json.loads(capsys.readouterr().out)["default"]
    assert default["fits"] and default["generation_gib"]["actor"]["vllm_kv_cache"] > 0
    # without the offload the recipe sets, vLLM's share does not fit beside PPO's four models: exit 3, one line
    assert main(base + ["--set", "actor.offload.optimizer=false", "--set", "critic.offload.optimizer=false"]) == 3
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["plan", "--memory", str(recipe), "--gpu", "h100"]) == 2
    assert "actor.model.path='/path/to/" in capsys.readouterr().err


def test_plan_auto_counts_vllms_copy_and_writes_its_share(tmp_path, capsys):
    """The search's generation memory with vLLM: its copy and runtime beside what stays, the share it may take
    written into the config; the actor's offload frees room for it."""
    from hybridrl.cli import main

    auto = ["plan", "--auto", "--model", "llama-13b", "--algorithm", "ppo", "--gpus", "16", "--gpu", "h100",
            "--execution", "trainer", "--json"]
    out = {}
    for name, extra in (("native", ["--engine", "native"]), ("vllm", []), ("offload", ["--offload",
                                                                                        "grads,optimizer"])):
        assert main(auto + extra) == 0
        out[name] = json.loads(capsys.readouterr().out)["best"]["roles"]["actor"]["generation"]
    assert "vllm_gpu_memory_utilization" not in out["native"] and out["vllm"]["engine"] == "vllm"
    assert 0 < out["vllm"]["vllm_gpu_memory_utilization"] < out["offload"]["vllm_gpu_memory_utilization"] < 1
    written = tmp_path / "ppo.yaml"
    assert main(auto[:-1] + ["--offload", "grads,optimizer", "--write-config", str(written)]) == 0
    cfg = load_config(written)
    assert cfg.rollout.vllm.gpu_memory_utilization == out["offload"]["vllm_gpu_memory_utilization"]
    assert cfg.actor.offload.grads and cfg.actor.offload.optimizer and not cfg.actor.offload.params
    assert main(auto + ["--offload", "weights"]) == 2
    assert "--offload weights" in capsys.readouterr().err
