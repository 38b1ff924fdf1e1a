"""The trainer's reward step in process (trainer/loop.py _score and _advantages, no Ray): agent runs that split into
groups of other sizes than rollout.n, ReMax's greedy baseline per prompt group, samples and groups a judge dropped,
and the pieces of the plan they rely on (the scorer of a rewardless agent, the pool a restart builds)."""
from __future__ import annotations

import pytest
import torch

from hybridrl.config import load_config
from hybridrl.protocol import Batch
from hybridrl.roles.sources import Rewards
from hybridrl.rollout.types import Rollout
from hybridrl.trainer.loop import RLTrainer, StepData
from hybridrl.trainer.plan import plan_run

WIDTH = 3  # response tokens of every row (all real)


def _rollout(groups: list[int], episode_rewards: list[float] | None = None) -> Rollout:
    """Agent-like rows: their own prompt groups (runs split or dropped), WIDTH model tokens each."""
    rows = len(groups)
    non_tensors = {"group_index": groups}
    if episode_rewards is not None:
        non_tensors["episode_rewards"] = episode_rewards
    tensors = {"prompts": torch.ones(rows, 2, dtype=torch.long), "responses": torch.ones(rows, WIDTH, dtype=torch.long),
               "attention_mask": torch.ones(rows, 2 + WIDTH, dtype=torch.long),
               "response_mask": torch.ones(rows, WIDTH, dtype=torch.long),
               "rollout_log_probs": torch.zeros(rows, WIDTH)}
    return Rollout(Batch(tensors, non_tensors), [""] * rows, [""] * rows, [{}] * rows)


class _Sources:
    """The run's reward sources as the trainer calls them: submit(rollout).result() -> Rewards, by batch."""

    def __init__(self, by_rows: dict[int, Rewards]) -> None:
        self.by_rows = by_rows

    def submit(self, rollout):
        rewards = self.by_rows[len(rollout)]
        return type("Pending", (), {"result": lambda self: rewards})()


def _trainer(overrides: list[str]) -> RLTrainer:
    cfg = load_config(None, ["rollout.engine=native", "rollout.agent=agent_programs:splitting",
                             "data.chat_template=true", *overrides])
    return RLTrainer(cfg, plan_run(cfg))


def _step(trainer: RLTrainer, out: Rollout, greedy: Rollout | None, groups: int = 3) -> StepData:
    step = StepData(groups=groups, seed=0, out=out, greedy=greedy)
    assert trainer._score(step)
    trainer._advantages(step)
    return step


def test_remax_baseline_per_group_of_split_runs_and_a_dropped_greedy_verdict_drops_its_group():
    """ReMax, 3 prompts x n=2 agent runs: group 0's sampled run split into two trajectories and so did its greedy run
    (its baseline: the mean of both); group 1's greedy verdict was dropped by a judge (on_parse_error=drop): the whole
    group leaves the update; group 2 is plain."""
    trainer = _trainer(["algorithm.name=remax", "rollout.n=2", "reward.fn=hybridrl.data.tasks:charset_reward"])
    out, greedy = _rollout([0, 0, 0, 1, 1, 2, 2]), _rollout([0, 0, 1, 2])
    sampled = torch.tensor([1.0, 0.0, 0.5, 0.7, 0.2, 0.9, 0.1])
    trainer.rewards = _Sources({7: Rewards(sampled, torch.ones(7, dtype=torch.bool), {"reward/judge_mean": 0.5}),
                                4: Rewards(torch.tensor([0.2, 0.4, 0.0, 0.5]), torch.tensor([True, True, False, True]),
                                           {})})
    step = _step(trainer, out, greedy)
    assert step.baseline.tolist() == pytest.approx([0.3, 0.3, 0.3, 0.0, 0.0, 0.5, 0.5])
    assert step.keep.tolist() == [True, True, True, False, False, True, True]
    expected = (sampled - torch.tensor([0.3, 0.3, 0.3, 0.0, 0.0, 0.5, 0.5])) * step.keep
    assert torch.allclose(step.result.advantages, expected[:, None].expand(7, WIDTH))
    assert step.out.sequences["response_mask"].sum(-1).tolist() == [3, 3, 3, 0, 0, 3, 3]  # no tokens, no loss
    assert step.metrics["reward/judge_mean"] == 0.5


def test_remax_group_whose_greedy_agent_run_failed_leaves_the_update():
    """No reward source (the agent's own rewards): group 2's greedy run raised and was dropped (no greedy row). Its
    sampled rows have no baseline, so they leave the update instead of training on r - 0."""
    trainer = _trainer(["algorithm.name=remax", "rollout.n=2", "rollout.agent=agent_programs:turns_like_the_env"])
    assert not trainer.plan.sources  # the agent scores itself
    sampled = [1.0, 0.0, 0.6, 0.2, 0.8, 0.4]
    out, greedy = _rollout([0, 0, 1, 1, 2, 2], sampled), _rollout([0, 1], [0.5, 0.3])
    trainer.rewards = _Sources({6: Rewards(None, None, {}), 2: Rewards(None, None, {})})
    step = _step(trainer, out, greedy)
    assert step.keep.tolist() == [True] * 4 + [False] * 2
    expected = torch.tensor([0.5, -0.5, 0.3, -0.1, 0.0, 0.0])
    assert torch.allclose(step.result.advantages[:, -1], expected)
    assert step.out.sequences["response_mask"][4:].sum() == 0


def test_grpo_on_split_runs_with_a_dropped_sample():
    """GRPO on groups of other sizes (group 0: 3 trajectories, group 1: 1 left after a dropped run, group 2: 2),
    a sample whose verdict was dropped taking its group's kept mean, so it moves no other sample's advantage."""
    trainer = _trainer(["algorithm.name=grpo", "rollout.n=2", "reward.fn=hybridrl.data.tasks:charset_reward"])
    out = _rollout([0, 0, 0, 1, 2, 2])
    scores = torch.tensor([1.0, 0.0, 0.5, 0.3, 0.9, 0.1])
    keep = torch.tensor([True, True, True, True, True, False])
    trainer.rewards = _Sources({6: Rewards(scores, keep, {})})
    step = _step(trainer, out, None)
    advantages = step.result.advantages[:, -1]
    assert advantages[:3].tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-4)  # (x - 0.5) / std 0.5
    assert advantages[3:].tolist() == [0.0, 0.0, 0.0]  # a group of one; group 2's kept sample equals its mean
    assert step.out.sequences["response_mask"].sum(-1).tolist() == [3, 3, 3, 3, 3, 0]


def test_a_rewardless_agent_is_scored_by_reward_sources():
    """An agent that returns None is trained when reward.sources scores its runs (not only reward.fn / reward_model)."""
    source = "{name: task, fn: 'hybridrl.data.tasks:charset_reward'}"
    trainer = _trainer(["rollout.agent=test_agent_endpoint:rewardless_agent", f"reward.sources=[{source}]"])
    assert trainer.agents.settings.scored_elsewhere
    bare = _trainer(["rollout.agent=test_agent_endpoint:rewardless_agent"])
    assert not bare.agents.settings.scored_elsewhere  # nothing scores: the runner refuses the runs (AgentError)


def test_a_restarted_rollout_pool_keeps_its_nodes():
    """resources.node_devices: the rollout pool on the second node; the pool a restart builds is placed there too."""
    cfg = load_config("remax_async_tiny", ["resources.nodes=2", "resources.devices=2", "resources.pools={gen: 2}",
                                           "resources.node_devices={default: [2, 0], gen: [0, 2]}",
                                           "actor.parallel.tp=2"])
    trainer = RLTrainer(cfg, plan_run(cfg))
    for name, split in (("default", [2, 0]), ("gen", [0, 2])):
        pool = trainer._pool(name)
        assert (pool.node_split, pool.world_size, pool.name) == (split, 2, name)
