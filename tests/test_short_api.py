"""The short API (hybridrl.Actor / ReferencePolicy / Critic / RewardModel) on a real local Ray cluster.

- the README's ReMax loop runs as written (the block is executed from README.md);
- one actor update at TP=2 equals the same update done in plain PyTorch on the Hugging Face model (SGD, so
  the weight change IS the gradient: the token-mean policy-gradient loss is exact across TP and DP ranks);
- an explicit device list and separate pools with different layouts (actor TP=2 vs reference TP=1 x DP=2)
  see the same model: reference log-probs equal the actor's before any update.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import hybridrl

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parent.parent / "README.md"
PROMPTS = ["vowels: qzkt", "vowels: bcdf", "vowels: rkjm", "vowels: lfkp"] * 2


def test_readme_short_api_loop_runs(ray_four_devices):
    match = re.search(r"<!-- short-api-begin -->\s*```python\n(.*?)```\s*<!-- short-api-end -->", README.read_text(),
                      re.S)
    assert match, "README.md lost its short-API block"
    scope: dict = {}
    exec(compile(match.group(1), "README.md:short-api", "exec"), scope)  # noqa: S102 - our own README
    out, rewards, baseline, kl = scope["out"], scope["rewards"], scope["baseline"], scope["kl"]
    assert rewards.shape == baseline.shape == kl.shape == (8,)
    assert out.mask.shape == out.log_probs.shape and len(out.texts) == 8
    assert torch.isfinite(kl).all() and kl.abs().sum() > 0  # the policy moved away from the reference
    assert ((rewards >= 0) & (rewards <= 1)).all()
    scope["pool"].shutdown()


def _hf_policy_gradient(model_path: str, sequences, advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradient of the token-mean policy-gradient loss -A * exp(logp - sg(logp)) in transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    prompt_width = sequences["prompts"].shape[1]
    ids, mask = sequences["input_ids"], sequences["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    log_probs = torch.log_softmax(logits[:, prompt_width - 1:-1], -1).gather(
        -1, sequences["responses"].unsqueeze(-1)).squeeze(-1)
    response_mask = sequences["response_mask"].float()
    loss = (-(advantages[:, None] * torch.exp(log_probs - log_probs.detach())) * response_mask).sum() / response_mask.sum()
    loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}


def test_actor_update_equals_pytorch_reference(ray_four_devices, tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridrl.models.tiny import default_model_dir

    path = str(default_model_dir())
    pool = hybridrl.ResourcePool(devices=4)
    try:
        # TP=2 x DP=2, token-budget micro-batches of two rows (two micro-batches per DP rank), plain SGD with
        # lr 1: delta = -gradient
        actor = hybridrl.Actor(parallel={"tp": 2, "pp": 1}, rollout={"tp": 1, "max_new_tokens": 8}, resource_pool=pool,
                               optim={"optimizer": "sgd", "lr": 1.0, "clip_grad": 1e9,
                                      "use_distributed_optimizer": False}, max_tokens_per_micro_batch=48)
        out = actor.generate_sequences(PROMPTS, seed=3)
        advantages = torch.randn(len(out), generator=torch.Generator().manual_seed(0))
        metrics = actor.update(actions=out, advantages=advantages)
        actor.save_hf(str(tmp_path / "trained"))
    finally:
        pool.shutdown()
    assert metrics["update_ok"] == 1.0
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    reference = _hf_policy_gradient(path, out.sequences, advantages)
    for name, grad in reference.items():
        step = initial[name] - trained[name]
        assert (step - grad).abs().max() <= 1e-4 * max(1.0, grad.abs().max().item()), name
    total_norm = torch.sqrt(sum(g.square().sum() for g in reference.values())).item()
    assert metrics["grad_norm"] == pytest.approx(total_norm, rel=1e-4)


def test_device_list_and_separate_pools_with_different_layouts(ray_four_devices):
    actor_pool = hybridrl.ResourcePool(devices=["cuda:0", "cuda:1"], name="actor")
    ref_pool = hybridrl.ResourcePool(devices=2, name="ref")
    try:
        actor = hybridrl.Actor(parallel={"tp": 2}, rollout={"tp": 2, "max_new_tokens": 8}, resource_pool=actor_pool)
        ref = hybridrl.ReferencePolicy(resource_pool=ref_pool, parallel={"tp": 1})  # DP=2 on its own pool
        assert (actor.layout.tp, actor.layout.dp) == (2, 1) and (ref.layout.tp, ref.layout.dp) == (1, 2)
        out = actor.generate_sequences(PROMPTS, seed=1)
        mask = out.mask
        ref_log_probs = ref.get_log_probs(PROMPTS, out.sequences)
        actor_log_probs = actor.compute_log_probs(out.sequences)
        assert ((ref_log_probs - actor_log_probs) * mask).abs().max() <= 1e-5
        assert ((out.log_probs - actor_log_probs) * mask).abs().max() <= 1e-4  # rollout vs training recompute
        assert {info["pid"] for info in actor.group.worker_info}.isdisjoint(
            {info["pid"] for info in ref.group.worker_info})
    finally:
        actor_pool.shutdown()
        ref_pool.shutdown()


def test_reward_model_scores_equal_transformers(ray_four_devices, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from hybridrl.data.tokenizer import VOCAB_SIZE
    from hybridrl.models.tiny import create_tiny_model

    rm_path = str(create_tiny_model(tmp_path / "rm", "llama", vocab_size=VOCAB_SIZE, hidden=32, layers=2, heads=4,
                                    kv_heads=2, head="seq_cls", seed=7))
    pool = hybridrl.ResourcePool(devices=2, name="rm")
    try:
        actor = hybridrl.Actor(parallel={"tp": 2}, rollout={"tp": 1, "max_new_tokens": 8}, resource_pool=pool)
        reward_model = hybridrl.RewardModel(model=rm_path, resource_pool=pool)  # colocated: TP=2 like the actor
        out = actor.generate_sequences(PROMPTS[:4], seed=2)
        scores = reward_model.score(PROMPTS[:4], out)
    finally:
        pool.shutdown()
    reference = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32)
    seq = out.sequences
    with torch.no_grad():
        for row in range(len(out)):
            ids = seq["input_ids"][row][seq["attention_mask"][row].bool()].unsqueeze(0)  # unpadded sequence
            expected = reference(input_ids=ids).logits[0, 0]
            assert abs(scores[row].item() - expected.item()) <= 1e-4, row
