"""The short API: RL roles as plain Python objects, so a new algorithm is a few lines of driver code.

    pool = hybridrl.ResourcePool(devices=4)
    actor = hybridrl.Actor(model=PATH, parallel={"tp": 2, "pp": 1}, rollout={"tp": 1}, resource_pool=pool)
    ref_policy = hybridrl.ReferencePolicy(model=PATH, resource_pool=pool)
    reward_model = hybridrl.RewardModel(fn=my_reward)          # or model=RM_PATH, resource_pool=pool
    for batch in dataloader:
        out = actor.generate_sequences(batch["prompt"])        # Rollout: .sequences .texts .log_probs .mask
        ref_log_probs = ref_policy.get_log_probs(batch["prompt"], out.sequences)
        rewards = reward_model.score(batch["prompt"], out.texts)
        actor.update(states=batch["prompt"], actions=out.sequences, advantages=rewards - ...)

Where each piece lives:
  roles/        the role objects: Actor, RolloutReplicas (generation on a pool of its own), ReferencePolicy,
                Critic, RewardModel (+ TextScoring: how a reward model reads text), Judge (a generative reward
                model: template + verdict parser), sources.py (reward sources combined with weights)
  rollout/      Rollout (what generation returns), prompt encoding, SamplingParams, the engines
  controller/   ResourcePool, WorkerGroup and @register: the single controller on Ray
  config        the typed settings every role takes (RolloutConfig, OptimConfig, ParallelConfig, MoeConfig);
                keyword dicts given here are checked and converted once (config.as_section)

Each role is a WorkerGroup of Megatron-backed workers (workers/) on a ResourcePool; roles on one pool colocate
(share processes, devices and layout). The trainer (trainer/loop.py) drives these same objects. Ray is started
locally on first use when no cluster is running (enough fake devices for the pool).
"""
from __future__ import annotations

from hybridrl.config import MoeConfig, OptimConfig, ParallelConfig, RolloutConfig, VllmConfig
from hybridrl.controller import ResourcePool, init_local_ray, shutdown_ray
from hybridrl.roles import (Actor, Critic, Judge, JudgeScores, PendingRollouts, ReferencePolicy, RewardModel,
                            RolloutReplicas, TextScoring)
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.prompts import check_prompts, encode_prompts
from hybridrl.rollout.types import Rollout
from hybridrl.workers.policy import PolicyLossConfig

__all__ = [
    "Actor", "Critic", "Judge", "JudgeScores", "MoeConfig", "OptimConfig", "ParallelConfig", "PendingRollouts",
    "PolicyLossConfig",
    "ReferencePolicy", "ResourcePool", "RewardModel", "Rollout", "RolloutConfig", "RolloutReplicas",
    "SamplingParams", "TextScoring", "VllmConfig", "check_prompts", "encode_prompts", "init_local_ray",
    "shutdown_ray",
]
