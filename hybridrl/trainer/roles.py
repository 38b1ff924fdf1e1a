"""The trainer's roles, started from its checked plan: each role's typed config section (model path, layout,
pool and the resolved rollout / loss settings from the plan) goes to the role objects of hybridrl.roles; the reward
sources (rules, reward models, judges) start by their registered kinds (roles/sources.py)."""
from __future__ import annotations

import dataclasses
from typing import Any

from hybridrl.config import ModelConfig, typed
from hybridrl.controller import ResourcePool
from hybridrl.roles import Actor, Critic, ReferencePolicy, RewardModel, RolloutReplicas
from hybridrl.roles.sources import SOURCE_KINDS, Placement, RewardSources
from hybridrl.trainer.plan import RunPlan


def start_roles(cfg: Any, plan: RunPlan, pools: dict[str, ResourcePool], tokenizer: Any) -> dict[str, Any]:
    """Every role of the plan except the rollout replicas (start_rollout_replicas), on its pool."""
    seed, timeout = cfg.trainer.seed, cfg.trainer.call_timeout_s

    def placed(role: str) -> tuple[Any, ResourcePool, str]:
        where = plan.roles[role]
        return where.layout, pools[where.pool], where.model_path

    layout, pool, path = placed("actor")
    actor = dataclasses.replace(typed(cfg.actor), model=ModelConfig(path, cfg.actor.model.dtype),
                                lora=plan.lora.get("actor", typed(cfg.actor.lora)))
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
                                 call_timeout_s=timeout, lora=plan.lora.get("critic"), offload=typed(critic.offload))
    if "teacher" in plan.roles:  # a reference-like log-prob role on the teacher's model (algorithm.distill)
        layout, pool, path = placed("teacher")
        teacher = plan.distill
        roles["teacher"] = ReferencePolicy(path, pool, layout, teacher.micro_batch_size,
                                           teacher.max_tokens_per_micro_batch, teacher.dtype, seed, role="teacher",
                                           call_timeout_s=timeout)
    if "cost" in plan.roles:
        layout, pool, path = placed("cost")
        section = cfg.cost_model
        roles["cost"] = RewardModel(model=path, resource_pool=pool, parallel=layout,
                                    micro_batch_size=section.micro_batch_size,
                                    max_tokens_per_micro_batch=section.max_tokens_per_micro_batch, dtype=section.dtype,
                                    tokenizer=section.tokenizer, chat_template=section.chat_template,
                                    format=section.format, seed=seed, role="cost", call_timeout_s=timeout)
    elif plan.cost_fn:
        roles["cost"] = RewardModel(fn=plan.cost_fn, num_workers=cfg.reward.num_workers)
    return roles


def start_reward_sources(cfg: Any, plan: RunPlan, pools: dict[str, ResourcePool]) -> RewardSources:
    """The reward's sources (plan.sources), each started by its registered kind on its pool."""
    started = []
    for spec in plan.sources:
        where = plan.roles.get(spec.role)
        placement = Placement(pool=pools[where.pool] if where else None, layout=where.layout if where else None,
                              seed=cfg.trainer.seed, call_timeout_s=cfg.trainer.call_timeout_s,
                              num_workers=cfg.reward.num_workers)
        started.append((spec, SOURCE_KINDS.lookup(spec.kind).build(spec, placement)))
    return RewardSources(started)


def start_rollout_replicas(cfg: Any, plan: RunPlan, actor: Actor, pool: ResourcePool) -> RolloutReplicas:
    """Generation replicas on rollout.pool, fed shard to shard by the actor (the plan's rollout settings)."""
    return RolloutReplicas(actor, pool, plan.rollout, seed=cfg.trainer.seed, call_timeout_s=cfg.trainer.call_timeout_s)
