"""LoRA through the real trainer (local Ray, Megatron workers over gloo, the hybrid engine, the native engine).

- configs/grpo_lora_tiny.yaml learns the bundled task (its header has the measured 30-step curve; 12 steps here),
  with no reference model started: the reference log-probs are the actor's own with the adapters off;
- every kind of run that updates an actor takes LoRA: ReMax (greedy baseline) over multi-turn episodes, PPO with a
  LoRA critic (its value head trained beside the adapters), GSPO with generation on a pool of its own two batches
  ahead (async), Safe-RLHF with both critics (reward, cost) on LoRA and its Lagrange multiplier; two steps each,
  finite and moving (tests/test_lora_plan.py plans every registered algorithm);
- a PPO run with LoRA actor and critic checkpoints adapters only (PEFT folders, the critic's with its value head),
  resumes exactly (step 3 after a resume from step 2 equals the uninterrupted run's), and its actor's adapters
  convert to a PEFT folder (`hybridrl convert --from ckpt --to peft`) and to a merged model (`--to hf --merge-lora`)
  whose logits equal peft + transformers' on that folder.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.config import load_config
from hybridrl.trainer.loop import RLTrainer
from hybridrl.trainer.plan import plan_run
from lora_helpers import peft_model

pytestmark = pytest.mark.slow

SMALL = ["trainer.steps=2", "data.batch_size=4", "rollout.max_new_tokens=8", "actor.micro_batch_size=4",
         "critic.micro_batch_size=4", "actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "actor.lora.rank=4"]
LEARNING_STEPS, FIRST_BELOW, LAST5_ABOVE = 12, 0.3, 0.7  # measured: 0.10 at step 1, last five 0.72-1.0


def _run(config: str | None, overrides: list[str], inspect=None) -> tuple[RLTrainer, list[dict]]:
    """The run's steps; inspect(trainer), if given, runs on the started roles after the last step."""
    cfg = load_config(config, overrides)
    trainer = RLTrainer(cfg, plan_run(cfg))
    try:
        trainer.start()
        history = [trainer.train_step() for _ in range(cfg.trainer.steps)]
        roles = set(trainer.roles)
        if inspect is not None:
            inspect(trainer)
    finally:
        trainer.close()
    trainer.started_roles = roles
    return trainer, history


def test_grpo_lora_tiny_learns_without_a_reference_model(ray_two_devices):
    trainer, history = _run("grpo_lora_tiny", [f"trainer.steps={LEARNING_STEPS}"])
    rewards = [h["reward_mean"] for h in history]
    assert rewards[0] < FIRST_BELOW
    assert sum(rewards[-5:]) / 5 > LAST5_ABOVE, rewards
    assert trainer.plan.step.reference_from_actor and "ref" not in trainer.started_roles
    assert all(h["time/reference"] > 0 and math.isfinite(h["kl_mean"]) for h in history)


CASES = {
    # ReMax's greedy baseline inside the same transition, over multi-turn episodes (several generate calls)
    "remax_multiturn": ["algorithm.name=remax", "rollout.env=charset_turns", "rollout.max_turns=2",
                        "actor.parallel.tp=2", "rollout.tp=1"],
    # generation on a pool of its own two batches ahead (async; one_step_off is the same queue one ahead), GSPO's
    # sequence-level ratio over 2 epochs x 2 mini-batches (an old-log-prob pass with the adapters on)
    "async_gspo": ["algorithm.name=gspo", "rollout.n=2", "resources.devices=1", "resources.pools.gen=1",
                   "rollout.pool=gen", "trainer.mode=async", "algorithm.max_staleness=2", "algorithm.ppo_epochs=2",
                   "algorithm.mini_batch_size=4"],
    # DAPO: dynamic sampling refills the batch (more generate calls per step), no reference
    "dapo": ["algorithm.name=dapo", "rollout.n=2"],
    # on-policy distillation: the teacher's log-probs against the LoRA student's (the tiny judge, another LM of
    # the same vocabulary, as the teacher: it differs from the student from the first step)
    "opd": ["algorithm.distill.teacher=tiny:charset_judge"],
    # Safe-RLHF: the reward critic and the cost critic (built from critic.*) both on LoRA beside the LoRA actor,
    # the Lagrange multiplier driven by the rule cost (digit_cost)
    "safe_rlhf": ["critic.lora.rank=4", "rollout.n=2"],
}
CONFIG_OF = {"opd": "opd_tiny", "safe_rlhf": "safe_rlhf_tiny"}  # the others: the default config


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_runs_every_kind_of_actor_update(ray_two_devices, case, tmp_path):
    saved = {}

    def save_critics(trainer):  # the critics' checkpoints show what they train (Safe-RLHF's two)
        for role in ("critic", "cost_critic"):
            trainer.roles[role].save_checkpoint(str(tmp_path / role))
            saved[role] = tmp_path / role

    trainer, history = _run(CONFIG_OF.get(case), SMALL + CASES[case], save_critics if case == "safe_rlhf" else None)
    assert trainer.plan.lora["actor"].rank == 4
    for h in history:
        assert math.isfinite(h["reward_mean"]) and h["actor/update_ok"] == 1.0
        assert h["actor/grad_norm"] > 0
    if case == "safe_rlhf":
        _check_safe_rlhf(trainer, history, saved)


def _check_safe_rlhf(trainer, history: list[dict], saved: dict) -> None:
    """Both critics trained their adapters (and value heads) only; the multiplier moved by this run's costs."""
    from megatron.core import dist_checkpointing

    from hybridrl.models.peft import read_peft_adapter

    assert trainer.plan.lora["critic"].rank == 4 and {"critic", "cost_critic"} <= trainer.started_roles
    assert "ref" not in trainer.started_roles  # the KL's reference: the actor's adapters off
    alg = trainer.cfg.algorithm
    for h in history:
        for critic in ("critic/", "cost_critic/"):  # each critic's own optimizer step, finite and taken
            assert h[f"{critic}value_loss"] > 0 and math.isfinite(h[f"{critic}value_loss"]), critic
        assert h["critic/grad_norm"] > 0 and h["critic/update_ok"] == 1.0  # the reward critic's
        assert h["cost_critic/grad_norm"] > 0 and h["cost_critic/update_ok"] == 1.0
        assert h["cost_critic/grad_norm"] != h["critic/grad_norm"]  # two critics, two updates
        assert 0.0 <= h["cost_mean"] <= 1.0 and math.isfinite(h["lagrange_multiplier"])
    # the logged multiplier is the one the step used: 1.0 (lagrangian_init), then one log-space ascent step
    assert history[0]["lagrange_multiplier"] == alg.lagrangian_init == 1.0
    expected = math.exp(alg.lagrangian_lr * 1.0 * (history[0]["cost_mean"] - alg.cost_limit))
    assert history[1]["lagrange_multiplier"] == pytest.approx(expected, rel=1e-12)
    for role, folder in saved.items():
        adapter = read_peft_adapter(folder / "adapter")
        assert adapter.rank == 4 and "score.weight" in adapter.saved and not (folder / "model").exists(), role
        # the optimizer's state: the adapters and the value head, nothing of the frozen base
        keys = list(dist_checkpointing.load_tensors_metadata(str(folder / "optimizer")))
        trained = [k for k in keys if ".lora." not in k and "output_layer" not in k]
        assert keys and not trained, (role, trained[:5])


PPO = SMALL + ["algorithm.name=ppo", "actor.parallel.tp=1", "actor.parallel.pp=2", "rollout.tp=1", "critic.lora.rank=4", "algorithm.ppo_epochs=2",
               "algorithm.mini_batch_size=2", "trainer.steps=3", "trainer.save_every=2", "trainer.trackers=[]"]


def _train_cli(overrides: list[str]) -> list[dict]:
    """`hybridrl train` (checkpoints, resume) in this process; the run's metrics.jsonl records."""
    import argparse
    import json
    from pathlib import Path

    from hybridrl.cli.train import run

    assert run(argparse.Namespace(config=None, overrides=overrides, print_config=False)) == 0
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.run_dir=")))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_ppo_with_lora_actor_and_critic_checkpoints_adapters_and_resumes_exactly(ray_two_devices, tmp_path, capsys):
    from hybridrl.cli import main
    from hybridrl.models.peft import read_peft_adapter

    whole = _train_cli(PPO + [f"trainer.run_dir={tmp_path / 'a'}", "trainer.progress_bar=false"])
    assert all(h["critic/grad_norm"] > 0 and math.isfinite(h["critic/value_loss"]) for h in whole)  # the critic trains
    step2 = tmp_path / "a" / "ckpt" / "step_2"
    assert (step2 / "actor" / "adapter" / "adapter_config.json").is_file() and not (step2 / "actor" / "model").exists()
    critic = next(p for p in step2.iterdir() if p.name.startswith("critic"))
    assert "score.weight" in read_peft_adapter(critic / "adapter").saved  # the value head trained beside the adapters
    resumed = _train_cli(PPO + [f"trainer.run_dir={tmp_path / 'b'}", f"trainer.resume={step2}",
                                "trainer.progress_bar=false"])
    by_step = {h["step"]: h for h in resumed}
    for key in ("reward_mean", "actor/pg_loss", "actor/grad_norm", "critic/value_loss", "kl_mean"):
        assert by_step[3][key] == pytest.approx(whole[2][key], rel=1e-6, abs=1e-9), key
    assert main(["convert", "--from", "ckpt", "--to", "peft", str(step2), str(tmp_path / "peft")]) == 0
    assert read_peft_adapter(tmp_path / "peft").rank == 4
    assert main(["convert", "--from", "ckpt", "--to", "hf", str(step2), str(tmp_path / "hf")]) == 2
    assert "--merge-lora" in capsys.readouterr().err
    # the merged export of the run's policy reads as peft + transformers read the exported adapters
    assert main(["convert", "--from", "ckpt", "--to", "hf", "--merge-lora", str(step2), str(tmp_path / "hf")]) == 0
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    adapters = peft_model(read_peft_adapter(tmp_path / "peft").base, str(tmp_path / "peft"))
    with torch.no_grad():
        want, got = adapters(input_ids=ids).logits, merged(input_ids=ids).logits
        with adapters.disable_adapter():
            base = adapters(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-4 and (want - base).abs().max() > 1e-4  # the trained adapters count
