"""Disaggregated and asynchronous RL through the trainer: generation on a pool of its own (rollout.pool),
trainer.mode sync / one_step_off / async with a staleness bound, recovery of a dead rollout pool."""
from __future__ import annotations

import math

import pytest
import ray

from hybridrl.config import load_config
from hybridrl.trainer.loop import RLTrainer
from hybridrl.trainer.run import run_training
from hybridrl.trainer.plan import plan_run

pytestmark = pytest.mark.slow

SMALL = ["trainer.steps=3", "data.batch_size=8", "rollout.max_new_tokens=8", "rollout.n=2", "algorithm.name=grpo",
         "actor.parallel.tp=2", "rollout.tp=1", "algorithm.kl.coef=0.001"]
APART = ["resources.pools={gen: 2}", "rollout.pool=gen"]  # 2 replicas, like the colocated TP=2 -> TP=1


def _steps(overrides: list[str], config: str | None = None) -> list[dict]:
    cfg = load_config(config, overrides)
    trainer = RLTrainer(cfg, plan_run(cfg))
    try:
        trainer.start()
        return [trainer.train_step() for _ in range(cfg.trainer.steps)]
    finally:
        trainer.close()


def test_async_with_staleness_0_equals_colocated_sync(ray_four_devices):
    """The same seeds and weights give the same samples: generation on the actor's pool through the hybrid
    engine, and on a pool of its own fed over the bridge with trainer.mode=async, max_staleness 0 (with
    rollout.partial on: nothing is in flight when weights are sent, so no sequence is interrupted)."""
    colocated = _steps(SMALL)
    apart = _steps(SMALL + APART + ["trainer.mode=async", "algorithm.max_staleness=0", "rollout.partial=true"])
    for a, b in zip(colocated, apart):
        for key in ("reward_mean", "kl_mean", "actor/pg_loss", "actor/grad_norm", "response_length_mean"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (key, a[key], b[key])
        assert b["async/staleness_max"] == 0.0 and b["async/queue_size"] == 0.0 and b["async/partial_resumed"] == 0.0


def test_async_config_learns(ray_four_devices):
    """configs/remax_async_tiny.yaml: reward first < 0.3 -> last > 0.7 with samples one version old."""
    history = _steps([], "remax_async_tiny.yaml")
    rewards = [m["reward_mean"] for m in history]
    assert rewards[0] < 0.3 and sum(rewards[-5:]) / 5 > 0.7, rewards
    assert all(m["async/staleness_max"] <= 1.0 for m in history) and history[-1]["async/staleness_max"] == 1.0


class _KillRolloutAt:
    """A tracker that kills the rollout pool's worker process after step `at` is logged."""

    def __init__(self, trainer: RLTrainer, at: int) -> None:
        self.trainer, self.at, self.logged, self.metrics = trainer, at, [], []

    def log(self, step: int, metrics: dict) -> None:
        self.logged.append(step)
        self.metrics.append(metrics)
        if step == self.at:
            for host in self.trainer.pools["gen"]._hosts.actors:
                ray.kill(host, no_restart=True)

    def truncate_after(self, step: int) -> None:
        self.logged = [s for s in self.logged if s <= step]

    def console_line(self, step: int, metrics: dict) -> str:
        return ""

    show = console_line


def test_one_step_off_and_a_dead_rollout_pool_restarted_alone(ray_four_devices, tmp_path, caplog):
    """One-step-off trains on samples one version old (TIS sees the mismatch); when the rollout pool dies it is
    restarted alone from the actor's current weights, and the trainer goes on without a checkpoint reload."""
    cfg = load_config(None, SMALL + APART + ["trainer.steps=4", "trainer.mode=one_step_off", "trainer.max_restarts=1",
                                             "trainer.log_every=0", "algorithm.rollout_correction=tis"])
    trainer = RLTrainer(cfg, plan_run(cfg))
    tracker = _KillRolloutAt(trainer, at=2)
    try:
        history = run_training(trainer, tracker, tmp_path)
        weights_version = trainer.roles["rollout"].version
    finally:
        trainer.close()
    assert "restart 1/1 of the rollout pool only" in caplog.text
    # no checkpoint was written: a restart of everything would have begun again at step 1
    assert tracker.logged == [1, 2, 3, 4] and trainer.step == 4
    assert weights_version >= 1  # the new replicas were sent the actor's weights
    assert all(m["actor/update_ok"] == 1.0 and math.isfinite(m["reward_mean"]) for m in history)
    # one version behind, except the first batch and the first one the new pool generates with fresh weights (at
    # step 3 or 4: the death surfaces with the batch in flight, or with the sync after step 3)
    stale = [m["async/staleness_max"] for m in tracker.metrics]
    assert stale[:2] == [0.0, 1.0] and 0.0 in stale[2:] and set(stale) <= {0.0, 1.0}, stale
    assert all(m["async/queue_size"] == 1.0 for m in tracker.metrics)
    first, second = tracker.metrics[0], tracker.metrics[1]
    assert first["mismatch/log_prob_diff"] < 1e-4 < second["mismatch/log_prob_diff"]  # the trainer sees the lag
