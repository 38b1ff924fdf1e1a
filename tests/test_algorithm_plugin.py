"""An algorithm and a policy loss added in a test module (not in the package) train through `hybridrl train`
by name; the policy-loss registry in-process (duplicates, unknown names, a module imported on demand)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.algorithms import register_algorithm
from hybridrl.algorithms.losses import ppo_policy_token_loss
from hybridrl.algorithms.policy_losses import (POLICY_LOSS_REGISTRY, cispo_token_loss, get_policy_loss,
                                               gspo_token_loss, policy_token_loss, register_policy_loss)
from hybridrl.workers.policy import PolicyLossConfig

TESTS = Path(__file__).resolve().parent


def _train(tmp_path, *overrides, timeout=600):
    env = {**os.environ, "HYBRIDRL_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", "grpo_tiny.yaml", *overrides],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.slow  # ~1 min: a local Ray cluster, 3 GRPO-shaped steps
def test_plugin_algorithm_and_policy_loss_train_by_name(tmp_path):
    """An algorithm and its policy loss registered only in the user's module (the actor's Ray workers must
    import it to run the loss), with the rollout correction on. (The plugin's other algorithm, a plain advantage
    function, is checked in-process: tests/test_algorithms.py registers one.)"""
    run_dir = tmp_path / "run"
    proc = _train(tmp_path, "algorithm.name=plugin_capped_reinforce", "algorithm.module=algorithm_plugin",
                  "algorithm.rollout_correction=tis", "trainer.steps=3", f"trainer.run_dir={run_dir}",
                  "trainer.progress_bar=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # a stat only this loss reports (ppo's would not): the plugin's loss ran in the workers
        assert 0.9 < r["actor/plugin_is_weight"] <= 1.2 + 1e-6, r
        assert r["actor/pg_loss"] == r["actor/pg_loss"] and r["actor/clipfrac"] >= 0.0, r
        # the native engine (TP=1) and the trainer (TP=2) agree in fp32: a tiny mismatch, no weight reaches the cap
        assert 0.0 <= r["mismatch/log_prob_diff"] < 1e-3 and abs(r["mismatch/kl"]) < 1e-4, r
        assert r["mismatch/corrected_fraction"] == 0.0, r
    config = (run_dir / "config.yaml").read_text()
    assert "plugin_capped_reinforce" in config and "module: algorithm_plugin" in config


def test_unknown_algorithm_and_unimportable_module_are_refused_before_work(tmp_path):
    proc = _train(tmp_path, "algorithm.module=no_such_plugin_module", timeout=120)
    assert proc.returncode == 2 and "algorithm.module='no_such_plugin_module' cannot be imported" in proc.stderr
    proc = _train(tmp_path, "algorithm.name=plugin_mean_baseline", timeout=120)  # registered only by the module
    assert proc.returncode == 2 and "algorithm.name='plugin_mean_baseline' is unknown; registered:" in proc.stderr
    proc = _train(tmp_path, "algorithm.rollout_correction=is", timeout=120)
    assert proc.returncode == 2 and "algorithm.rollout_correction='is' is unknown; choose one of none, tis, mis" \
        in proc.stderr
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob("**/metrics.jsonl"))


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=gen) * 2
    old = logp + 0.3 * torch.randn(3, 5, generator=gen)
    adv = torch.randn(3, 5, generator=gen)
    mask = (torch.rand(3, 5, generator=gen) > 0.2).float()
    return logp, old, adv, mask


def test_builtin_policy_losses_by_name_give_the_same_numbers():
    logp, old, adv, mask = _inputs()
    for name, direct, kwargs in [("ppo", ppo_policy_token_loss, {}), ("ppo", ppo_policy_token_loss, {"dual_clip": 2.0}),
                                 ("gspo", gspo_token_loss, {}), ("cispo", cispo_token_loss, {})]:
        tokens, stats = policy_token_loss(name, logp, old, adv, mask, 0.2, 0.28, **kwargs)
        ref_tokens, ref_stats = direct(logp, old, adv, mask, 0.2, 0.28, **kwargs)
        assert torch.equal(tokens, ref_tokens) and stats.keys() == ref_stats.keys(), name
        assert all(torch.equal(stats[k], ref_stats[k]) for k in stats), name
    for name in ("gspo", "cispo"):  # dual_clip stays ppo's
        with pytest.raises(ValueError, match=f"dual_clip does not apply to the '{name}' policy loss"):
            PolicyLossConfig(policy_loss=name, dual_clip=2.0)
    PolicyLossConfig(policy_loss="ppo", dual_clip=2.0)


def test_duplicate_and_unknown_policy_losses_are_refused():
    register_policy_loss("ppo")(ppo_policy_token_loss)  # the same function again (a re-import) is fine
    with pytest.raises(ValueError, match="policy loss 'ppo' is already registered by hybridrl.algorithms.losses"):
        @register_policy_loss("ppo")
        def my_ppo(log_prob, old_log_prob, advantages, mask, clip_ratio, clip_ratio_high):
            return -advantages * log_prob, {}
    with pytest.raises(ValueError, match=r"policy loss 'nope' is unknown \(no algorithm.module registers it\); "
                                         r"registered: .*cispo, gspo, ppo"):
        PolicyLossConfig(policy_loss="nope")
    with pytest.raises(ValueError, match="algorithm 'uses_nope': policy_loss='nope' is not registered"):
        register_algorithm("uses_nope", policy_loss="nope")(lambda x: x)
    with pytest.raises(ValueError, match="algorithm.module='no_such_module_xyz' cannot be imported"):
        get_policy_loss("nope", module="no_such_module_xyz")


def test_a_worker_imports_the_module_that_registers_the_loss(tmp_path, monkeypatch):
    """What an actor worker does: the name is not registered in its process until algorithm.module is imported."""
    (tmp_path / "loss_module_xyz.py").write_text(
        "from hybridrl.algorithms import masked_mean, register_policy_loss\n\n"
        "@register_policy_loss('tmp_reinforce')\n"
        "def reinforce(log_prob, old_log_prob, advantages, mask, clip_ratio, clip_ratio_high):\n"
        "    zero = masked_mean(0 * log_prob, mask)\n"
        "    return -advantages * log_prob, {'clipfrac': zero, 'approx_kl': zero, 'calls': zero + 1}\n"
        "\n@register_policy_loss('tmp_no_kl')\n"
        "def no_kl(log_prob, old_log_prob, advantages, mask, clip_ratio, clip_ratio_high):\n"
        "    return -advantages * log_prob, {'clipfrac': masked_mean(0 * log_prob, mask)}\n")
    (tmp_path / "empty_module_xyz.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        _check_loss_from_module()
    finally:  # leave the registry and sys.modules as they were for the other tests
        for name in ("tmp_reinforce", "tmp_no_kl"):
            POLICY_LOSS_REGISTRY.pop(name, None)
        for module in ("loss_module_xyz", "empty_module_xyz"):
            sys.modules.pop(module, None)


def _check_loss_from_module() -> None:
    with pytest.raises(ValueError, match="'tmp_reinforce' is unknown \\(module 'empty_module_xyz' does not register"):
        PolicyLossConfig(policy_loss="tmp_reinforce", module="empty_module_xyz")
    assert "tmp_reinforce" not in POLICY_LOSS_REGISTRY
    cfg = PolicyLossConfig(policy_loss="tmp_reinforce", module="loss_module_xyz")
    logp, old, adv, mask = _inputs()
    tokens, stats = policy_token_loss(cfg.policy_loss, logp, old, adv, mask, module=cfg.module)
    assert torch.equal(tokens, -adv * logp) and float(stats["calls"]) == 1.0
    with pytest.raises(ValueError, match=r"policy loss 'tmp_no_kl' must report stats \['approx_kl'\]"):
        policy_token_loss("tmp_no_kl", logp, old, adv, mask)
    with pytest.raises(ValueError, match="dual_clip does not apply to the 'tmp_reinforce' policy loss"):
        policy_token_loss("tmp_reinforce", logp, old, adv, mask, dual_clip=2.0)
