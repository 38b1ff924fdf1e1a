"""A LoRA actor through the short API on a real local Ray cluster (4 devices, TP=2 x PP=2, generation TP=1).

- generation sees W + BA: the native engine's log-probs (merged weights resharded by the 3D-HybridEngine) equal
  the trainer's (<= 1e-4), and the training weights are restored bit for bit (the next forward is unchanged);
- the reference for free: the actor's adapters-off log-probs equal a separately built reference's (<= 1e-5);
- checkpoints hold the adapters (a PEFT folder naming the base, no weights copied) and the optimizer; peft +
  transformers load them with the actor's log-probs, the merged export gives the same, and a resume repeats
  the next update exactly.
"""
from __future__ import annotations

import pytest
import torch

import hybridrl
from lora_helpers import make_peft_adapter, peft_model, response_log_probs

pytestmark = pytest.mark.slow
PROMPTS = ["vowels: qzkt", "vowels: bcdf", "vowels: rkjm", "vowels: lfkp"] * 2


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from hybridrl.models.tiny import default_model_dir

    base = str(default_model_dir())
    return base, make_peft_adapter(base, tmp_path_factory.mktemp("lora_actor") / "adapter")


def test_lora_actor_generates_with_adapters_is_its_own_reference_and_resumes(ray_four_devices, adapter, tmp_path):
    from transformers import AutoModelForCausalLM

    base, adapter_dir = adapter
    pool = hybridrl.ResourcePool(devices=4)
    try:
        actor = hybridrl.Actor(parallel={"tp": 2, "pp": 2}, rollout={"tp": 1, "max_new_tokens": 8}, resource_pool=pool,
                               optim={"lr": 1e-2}, lora={"init": adapter_dir})
        ref = hybridrl.ReferencePolicy(resource_pool=pool)
        out = actor.generate_sequences(PROMPTS, seed=3)
        mask = out.mask
        trained = actor.compute_log_probs(out)
        assert ((out.log_probs - trained) * mask).abs().max() <= 1e-4  # the rollout saw W + BA
        assert torch.equal(actor.compute_log_probs(out), trained)  # the base came back bit for bit
        base_log_probs = actor.reference_log_probs(out)
        assert ((base_log_probs - ref.get_log_probs(out)) * mask).abs().max() <= 1e-5
        assert ((base_log_probs - trained) * mask).abs().max() > 1e-3  # the adapters do change the policy
        advantages = torch.randn(len(out), generator=torch.Generator().manual_seed(0))
        actor.update(actions=out, advantages=advantages)
        actor.save_checkpoint(str(tmp_path / "ckpt"))
        actor.save_hf(str(tmp_path / "merged"))
        saved = actor.compute_log_probs(out)
        actor.update(actions=out, advantages=-advantages)
        continued = actor.compute_log_probs(out)
        actor.load_checkpoint(str(tmp_path / "ckpt"))
        assert torch.equal(actor.compute_log_probs(out), saved)
        actor.update(actions=out, advantages=-advantages)
        assert torch.equal(actor.compute_log_probs(out), continued)  # adapters + optimizer state resumed exactly
    finally:
        pool.shutdown()
    ckpt = tmp_path / "ckpt"
    assert not (ckpt / "model").exists() and (ckpt / "adapter" / "adapter_config.json").is_file()
    assert sum(f.stat().st_size for f in (ckpt / "adapter").iterdir()) < 100_000  # adapters only, the base named
    from_peft = response_log_probs(peft_model(base, str(ckpt / "adapter")), out.sequences)
    assert (from_peft - saved).abs().max() <= 1e-4
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    assert (response_log_probs(merged, out.sequences) - saved).abs().max() <= 1e-4


def test_rollout_pool_receives_the_adapters_only_and_generates_with_them(ray_four_devices, adapter):
    """Generation replicas on a pool of their own (rollout TP=2: row-parallel adapters' partial sums completed
    by the decode forward's all-reduce) keep their base and take the adapters only; their log-probs equal the
    actor's before any sync (lora.init's adapters) and after an update and a sync."""
    from hybridrl.roles import RolloutReplicas

    _, adapter_dir = adapter
    train_pool = hybridrl.ResourcePool(devices=2, name="train")
    gen_pool = hybridrl.ResourcePool(devices=2, name="gen")
    try:
        actor = hybridrl.Actor(parallel={"tp": 2}, rollout={"tp": 2, "max_new_tokens": 8}, resource_pool=train_pool,
                               optim={"lr": 1e-2}, lora={"init": adapter_dir})
        replicas = RolloutReplicas(actor, gen_pool)
        out = replicas.generate_sequences(PROMPTS, seed=1)
        assert ((out.log_probs - actor.compute_log_probs(out)) * out.mask).abs().max() <= 1e-4
        actor.update(actions=out, advantages=torch.randn(len(out), generator=torch.Generator().manual_seed(1)))
        sent = replicas.sync()
        out = replicas.generate_sequences(PROMPTS, seed=2)
        assert ((out.log_probs - actor.compute_log_probs(out)) * out.mask).abs().max() <= 1e-4
        stats = replicas.sync_stats()
    finally:
        train_pool.shutdown()
        gen_pool.shutdown()
    adapter_bytes = replicas.adapter_spec.nbytes
    assert stats["received_bytes"] == [adapter_bytes, adapter_bytes] and sent["sent_bytes"] == 2 * adapter_bytes
    assert all(adapter_bytes < shard / 5 for shard in stats["shard_bytes"])  # a full sync sends the whole shard


def test_vllm_serves_the_adapters_as_its_lora_adapter(ray_four_devices, head_dim_32_model, tmp_path):
    """rollout.engine=vllm: the engine keeps the base it loaded and takes each step's adapters as a LoRA request
    (nothing of the base is resharded or pushed); its log-probs equal the trainer's before and after an update."""
    lora_dir = make_peft_adapter(head_dim_32_model, tmp_path / "adapter", rank=8, alpha=16,
                                 targets=["q_proj", "v_proj", "o_proj", "down_proj"])
    pool = hybridrl.ResourcePool(devices=2, name="vllm")
    try:
        actor = hybridrl.Actor(model=head_dim_32_model, parallel={"tp": 2}, resource_pool=pool, optim={"lr": 1e-2},
                               rollout={"tp": 1, "max_new_tokens": 8, "engine": "vllm", "max_model_len": 64},
                               lora={"init": lora_dir})
        for step in range(2):
            out = actor.generate_sequences(PROMPTS, seed=step)
            assert ((out.log_probs - actor.compute_log_probs(out)) * out.mask).abs().max() <= 1e-4, step
            assert out.sequences.meta.get("reshard_recv_bytes", 0) == 0  # the base never moved
            actor.update(actions=out, advantages=torch.randn(len(out), generator=torch.Generator().manual_seed(step)))
    finally:
        pool.shutdown()
