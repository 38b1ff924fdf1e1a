"""The trainer's roles, started from its checked plan: each role's typed config section (model path, layout,
pool and the resolved rollout / loss settings from the plan) goes to the role objects of hybridrl.roles."""
from __future__ import annotations

import dataclasses
from typing import Any

from hybridrl.config import ModelConfig, typed
from hybridrl.controller import ResourcePool
from hybridrl.roles import Actor, Critic, ReferencePolicy, RewardModel, RolloutReplicas
from hybridrl.trainer.plan import RunPlan


def start_roles(cfg: Any, plan: RunPlan, pools: dict[str, ResourcePool], tokenizer: Any) -> dict[str, Any]:
    """Every role of the plan except the rollout replicas (start_rollout_replicas), on its pool."""
    seed, timeout = cfg.trainer.seed, cfg.trainer.call_timeout_s

    def placed(role: str) -> tuple[Any, ResourcePool, str]:
        where = plan.roles[role]
        return where.layout, pools[where.pool], where.model_path

    layout, pool, path = placed("actor")
    actor = dataclasses.replace(typed(cfg.actor), model=ModelConfig(path, cfg.actor.model.dtype))
    roles: dict[str, Any] = {"actor": Actor.from_settings(actor, plan.rollout, plan.loss, layout, pool, tokenizer, seed,
                                                          call_timeout_s=timeout)}
    if "ref" in plan.roles:
        layout, pool, path = placed("ref")
        ref = cfg.ref
        roles["ref"] = ReferencePolicy(path, pool, layout, ref.micro_batch_size, ref.max_tokens_per_micro_batch,
                                       ref.model.dtype, seed, call_timeout_s=timeout)
    for role in ("critic", "cost_critic"):
        if role in plan.roles:
            layout, pool, path = placed(role)
            critic = cfg.critic
            roles[role] = Critic(path, pool, layout, typed(critic.optim), critic.micro_batch_size,
                                 critic.max_tokens_per_micro_batch, critic.model.dtype, seed, role=role,
                                 call_timeout_s=timeout, offload=typed(critic.offload))
    for role, fn, section in (("reward", plan.reward_fn, cfg.reward_model), ("cost", plan.cost_fn, cfg.cost_model)):
        if role in plan.roles:
            layout, pool, path = placed(role)
            roles[role] = RewardModel(model=path, resource_pool=pool, parallel=layout,
                                      micro_batch_size=section.micro_batch_size,
                                      max_tokens_per_micro_batch=section.max_tokens_per_micro_batch,
                                      dtype=section.dtype, tokenizer=section.tokenizer,
                                      chat_template=section.chat_template, seed=seed, role=role,
                                      call_timeout_s=timeout)
        elif fn:
            roles[role] = RewardModel(fn=fn, num_workers=cfg.reward.num_workers)
    return roles


def start_rollout_replicas(cfg: Any, plan: RunPlan, actor: Actor, pool: ResourcePool) -> RolloutReplicas:
    """Generation replicas on rollout.pool, fed shard to shard by the actor (the plan's rollout settings)."""
    return RolloutReplicas(actor, pool, plan.rollout, seed=cfg.trainer.seed, call_timeout_s=cfg.trainer.call_timeout_s)
