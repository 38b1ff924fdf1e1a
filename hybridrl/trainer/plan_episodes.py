"""The run plan's checks of episodes and lengths: an environment or an agent program and their budgets, the tool
sandbox their tools run code in, and the context length every role's micro-batches must hold."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from hybridrl.config import ConfigError, RolloutConfig, check_config
from hybridrl.envs import SandboxUnavailable, ToolRegistry, env_class, resolve_sandbox
from hybridrl.rollout.agent import load_agent

logger = logging.getLogger(__name__)


def episode_tokens(roll: Any) -> int:
    return roll.max_episode_tokens or 2 * roll.max_turns * roll.max_new_tokens


def check_episodes(cfg: Any) -> None:
    """rollout.env and its options: the environment builds from its arguments; budgets that fit."""
    roll = cfg.rollout
    if not roll.env:
        check_config(not roll.env_kwargs, f"rollout.env_kwargs={dict(roll.env_kwargs)} is set but rollout.env is not; "
                                    f"name the environment or drop its arguments")
        return
    try:
        env_class(roll.env)(**dict(roll.env_kwargs))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    except TypeError as exc:
        raise ConfigError(f"rollout.env_kwargs={dict(roll.env_kwargs)}: {roll.env} does not take them ({exc})") \
            from None
    check_config(episode_tokens(roll) >= roll.max_new_tokens,
           f"rollout.max_episode_tokens={roll.max_episode_tokens} < rollout.max_new_tokens={roll.max_new_tokens}: "
           f"not even one turn fits; raise it or leave it unset")


def check_agent(cfg: Any) -> None:
    """rollout.agent: an importable async function (openai / aiohttp installed), not with rollout.env; groups of
    other sizes than rollout.n (runs that split or drop) rule out dynamic sampling."""
    roll, alg = cfg.rollout, cfg.algorithm
    if not roll.agent:
        return
    check_config(not roll.env, f"rollout.agent={roll.agent!r} and rollout.env={roll.env!r} are both set: an "
                               f"agent program or an environment makes the episodes; unset one")
    try:
        load_agent(roll.agent)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_config(episode_tokens(roll) >= roll.max_new_tokens,
           f"rollout.max_episode_tokens={roll.max_episode_tokens} < rollout.max_new_tokens={roll.max_new_tokens}: "
           f"not even one request fits; raise it or leave it unset")
    check_config(not alg.get("max_refill_rounds"),
           f"algorithm.max_refill_rounds={alg.get('max_refill_rounds')} (dynamic sampling) keeps groups of "
           f"rollout.n samples; agent runs that split into several trajectories or are dropped make other group "
           f"sizes: set algorithm.max_refill_rounds=0 with rollout.agent")


def resolve_tool_sandbox(cfg: Any, roll: RolloutConfig) -> RolloutConfig:
    """rollout.tool_sandbox for an environment whose tools run model-written code: the sandbox started once here
    (auto: the strongest available), or one line saying why none can; the weak ones said out loud."""
    tools = getattr(env_class(roll.env)(**dict(roll.env_kwargs)), "tools", None) if roll.env else None
    if not (isinstance(tools, ToolRegistry) and tools.runs_code()):
        return roll
    try:
        sandbox = resolve_sandbox(roll.tool_sandbox, roll.tool_sandbox_url)
    except (SandboxUnavailable, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if sandbox.name in ("guard", "none"):
        logger.warning("rollout.tool_sandbox=%s: model-written code runs %s; it is no boundary against code that "
                       "tries to get out (README: the tool sandbox)", sandbox.name,
                       "under the audit-hook guard" if sandbox.name == "guard" else "without any isolation")
    return dataclasses.replace(roll, tool_sandbox=sandbox.name)



def max_model_len(cfg: Any, response_length: int) -> int:
    """The context length: prompt + response tokens; every role's micro-batch budget must hold one sequence."""
    roll, data = cfg.rollout, cfg.data
    what = "rollout.max_episode_tokens" if roll.env or roll.agent else "rollout.max_new_tokens"
    max_len = roll.max_model_len or data.max_prompt_length + response_length
    check_config(max_len >= data.max_prompt_length + response_length,
           f"rollout.max_model_len={max_len} < data.max_prompt_length + {what} = "
           f"{data.max_prompt_length + response_length}; raise it or leave it unset")
    for role, section in [(r, cfg[r]) for r in ("actor", "ref", "critic", "reward_model", "cost_model")] + \
            [("algorithm.distill", cfg.algorithm.distill)]:
        budget = section.max_tokens_per_micro_batch
        check_config(budget is None or budget >= max_len,
               f"{role}.max_tokens_per_micro_batch={budget} is below the longest sequence (data.max_prompt_length + "
               f"{what} = {max_len} tokens); raise it to at least {max_len} or set it to null "
               f"({role}.micro_batch_size sequences per micro-batch)")
    return max_len
