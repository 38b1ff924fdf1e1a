"""The seed's program, verbatim: README's "seed-program" block (hub ids `meta-llama/Llama-2-7b-hf` and
`weqweasdas/hf-reward-model-llama-7b-lora`, `parallel_config={'fsdp': 'full_shard'}`, no pools, `beta = 0.1`,
`kl_divergence.mean(dim=-1)`) runs as written for two iterations.

The hub is not reachable here: an offline cache (HF_HUB_OFFLINE=1) holds TINY models created below under those
ids: a Llama causal LM with the bundled character tokenizer, and a PEFT LoRA adapter over it with a trained score
head (task SEQ_CLS: `modules_to_save` keeps the head), written by peft itself, naming its base by hub id.
What it needs: hub ids resolved on the driver and roles sharing the default pool (models/hub.py,
ResourcePool.default), fully sharded data parallel (`parallel_config={'fsdp': ...}`) and PEFT adapters merged into
their base at load.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hub_cache import offline_hub, put_in_hub_cache

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parent.parent / "README.md"
POLICY_ID, RM_ID = "meta-llama/Llama-2-7b-hf", "weqweasdas/hf-reward-model-llama-7b-lora"


def seed_block() -> str:
    match = re.search(r"<!-- seed-program-begin -->\s*```python\n(.*?)```\s*<!-- seed-program-end -->",
                      README.read_text(), re.S)
    assert match, "README.md lost its seed-program block"
    return match.group(1)


def save_base_tokenizer(folder: Path) -> None:
    """The bundled 64-character tokenizer without its chat template, like Llama-2-7b-hf's (a base model's)."""
    from hybridrl.data.tokenizer import create_char_tokenizer

    create_char_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_policy(folder: Path) -> Path:
    """The tiny stand-in for Llama-2-7b-hf: a Llama over the bundled 64-character tokenizer, with its files."""
    from hybridrl.data.tokenizer import VOCAB_SIZE
    from hybridrl.models.tiny import create_tiny_model

    create_tiny_model(folder, "llama", vocab_size=VOCAB_SIZE, hidden=64, layers=2, heads=4, kv_heads=2, seed=0)
    save_base_tokenizer(folder)
    return folder


def make_lora_reward_model(base: Path, folder: Path, base_id: str) -> Path:
    """A LoRA reward-model adapter as peft saves one: adapter_config.json + adapter_model.safetensors (LoRA A/B on
    q/v projections, non-zero B, and the trained score head under modules_to_save), base named by its hub id."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(7)
    model = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1, dtype=torch.float32)
    config = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        init_lora_weights=False)  # random A and B: the adapter changes the scores
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "score" in name:
                param.normal_(0.0, 0.5)  # the trained head
    peft_model.save_pretrained(str(folder))
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_config["modules_to_save"] and adapter_config["peft_type"] == "LORA"
    adapter_config["base_model_name_or_path"] = base_id
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    save_base_tokenizer(folder)
    return folder


def peft_scores(base: Path, adapter: Path, prompts: list[str], texts: list[str]) -> torch.Tensor:
    """transformers + peft on the merged model, each (prompt, text) read as prompt + text with BOS."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from hybridrl.data.tokenizer import load_tokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    tokenizer = load_tokenizer(adapter)
    assert tokenizer.chat_template is None  # so the reward model reads prompt + text
    with torch.no_grad():
        return torch.tensor([merged(input_ids=torch.tensor([tokenizer(p + t)["input_ids"]])).logits[0, 0].item()
                             for p, t in zip(prompts, texts)])


@pytest.fixture
def seed_hub(tmp_path, monkeypatch):
    """The offline hub cache with both ids; no pool and no Ray before the block; everything stopped after."""
    from hybridrl.controller import resource_pool, shutdown_ray

    base = make_policy(tmp_path / "llama")
    adapter = make_lora_reward_model(base, tmp_path / "rm-lora", POLICY_ID)
    cache = tmp_path / "hub"
    snapshots = {POLICY_ID: put_in_hub_cache(cache, POLICY_ID, base), RM_ID: put_in_hub_cache(cache, RM_ID, adapter)}
    offline_hub(monkeypatch, cache)
    monkeypatch.delenv("HYBRIDRL_DEVICES", raising=False)
    shutdown_ray()
    monkeypatch.setattr(resource_pool, "_default_pool", None)
    yield snapshots
    pool = resource_pool._default_pool
    if pool is not None:
        pool.shutdown()
    shutdown_ray()


def test_the_seed_program_runs_verbatim(seed_hub):
    scope: dict = {}
    exec(compile(seed_block(), "README.md:seed-program", "exec"), scope)  # noqa: S102 - our own README
    actor, ref_policy, reward_model = scope["actor"], scope["ref_policy"], scope["reward_model"]
    batch, out, rewards = scope["batch"], scope["actor_output"], scope["rewards"]
    assert len(scope["dataloader"]) == 2 and scope["beta"] == 0.1

    # the id resolved on the driver to the cache's snapshot; all three roles on the one default pool
    assert actor.model_path == str(seed_hub[POLICY_ID])
    pool = actor.pool
    assert pool.name == "default" and pool.world_size == 2
    assert ref_policy.pool is pool and reward_model.role.pool is pool
    assert actor.layout.dp == 2  # the sharded data-parallel dimension spans the pool

    # the LoRA reward model scores what transformers + peft score on the merged model
    expected = peft_scores(seed_hub[POLICY_ID], seed_hub[RM_ID], out.prompt_texts, out.texts)
    assert (rewards - expected).abs().max() <= 1e-4, (rewards, expected)

    # two updates moved the policy: the second batch was sampled away from the reference, and its log-probs
    # under the updated actor differ from those it was sampled with
    kl = scope["kl_divergence"]
    assert kl.shape == out.mask.shape and torch.isfinite(kl).all() and kl.abs().sum() > 0
    total = scope["total_rewards"]
    assert total.shape == (len(batch["prompt"]),)
    assert torch.allclose(total, rewards - 0.1 * kl.mean(dim=-1))
    moved = (actor.compute_log_probs(out) - out.log_probs) * out.mask
    assert moved.abs().max() > 1e-4
