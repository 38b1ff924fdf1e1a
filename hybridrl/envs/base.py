"""Environments for multi-turn rollouts: text in, text out, registered by name or found by dotted path.

An episode: `obs = env.reset(row)` (row: the prompt row with its extra columns), then for each model turn
`env.step(action_text) -> StepResult(observation, reward, done, info)` until `done` or the turn limit. The
observation is fed back to the model as the next user / tool message; rewards of all turns add up to the
episode's reward. One Environment object serves one episode (the registry builds a fresh one per episode).

    @register_env("my_env")
    class MyEnv(Environment): ...

    make_env("my_env")  or  make_env("my_package.envs:MyEnv")
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

ENVIRONMENTS: dict[str, type["Environment"]] = {}


class EnvironmentStepError(ValueError):
    """The user's environment raised or returned something that is not a StepResult (names the row)."""


@dataclass
class StepResult:
    observation: str  # shown to the model next ("" with done=True: nothing more to show)
    reward: float = 0.0
    done: bool = False
    # counted into the rollout/* metrics: "tool_calls", "tool_errors"; "role": the observation's chat role
    # (default "user"; e.g. "tool" where the chat template renders tool results itself)
    info: dict = field(default_factory=dict)


class Environment(ABC):
    """One episode of a text environment."""

    @abstractmethod
    def reset(self, row: dict[str, Any]) -> str:
        """Start an episode for a prompt row; return the first observation (often the row's prompt)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """The model's turn (its generated text, decoded) -> what happens next."""

    def tool_specs(self) -> list[dict]:
        """The tools the model may call (OpenAI-style specs), rendered into the first prompt by a chat template
        that supports `tools=`; none by default."""
        return []


def register_env(name: str) -> Callable[[type[Environment]], type[Environment]]:
    def add(cls: type[Environment]) -> type[Environment]:
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"register_env({name!r}): {cls!r} is not an Environment subclass")
        if name in ENVIRONMENTS and ENVIRONMENTS[name] is not cls:
            raise ValueError(f"an environment named {name!r} is registered already ({ENVIRONMENTS[name]!r})")
        ENVIRONMENTS[name] = cls
        return cls
    return add


def env_class(name: str) -> type[Environment]:
    """A registered name, or "package.module:Class" / "package.module.Class"; a clear error otherwise."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module_name, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not module_name:
        raise ValueError(f"rollout.env={name!r} is not a registered environment ({sorted(ENVIRONMENTS)}) nor "
                         f"'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"rollout.env={name!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"rollout.env={name!r}: {module_name}.{attr} is not an Environment subclass")
    return cls


def make_env(name: str, **kwargs: Any) -> Environment:
    return env_class(name)(**kwargs)
