"""Multi-turn episodes: the policy and an environment (hybridrl/envs) take turns, batched per turn.

An episode starts from the environment's first observation, encoded like a dataset prompt. Each turn, every
unfinished episode's whole conversation so far goes to the actor in ONE generate call (episodes advance
together, inside one training -> generation transition for all turns); the environment steps on the decoded
turn; its observation is encoded on its own and appended. Nothing earlier is ever re-tokenized: the token ids
the model generated are exactly the ones it is trained on.

The result is the rollout Batch of rollout/base.py: "responses" hold every token after the first prompt,
"response_mask" (and "rollout_log_probs") only the model's own tokens, so observations and tool results are
context, never trained. The episode's reward is the sum of its turn rewards discounted by `turn_discount`
per turn; it travels as the non-tensor "episode_rewards" with the per-episode "episode_turns",
"episode_tool_calls" and "episode_tool_errors".

Limits: `max_turns` model turns; `max_new_tokens` per turn; `max_episode_tokens` after the first prompt (model
and observation tokens). An episode ends "stop" when the environment says done, "turns" at the turn limit,
"length" when the next turn or observation would not fit the token budget.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hybridrl.envs.base import Environment, EnvironmentStepError, StepResult, make_env
from hybridrl.protocol import Batch
from hybridrl.rollout.base import GeneratedSequence, SamplingParams, assemble_batch
from hybridrl.rollout.types import Rollout

_MARK = "\u2063HRL_TURN_END\u2063"  # stands for the model's turn when the chat template renders an observation


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_new_tokens: int  # per model turn
    max_episode_tokens: int  # after the first prompt: model turns + observations
    max_prompt_length: int  # the first observation, encoded
    turn_discount: float = 1.0  # episode reward = sum_t turn_discount**t * reward_t


class ConversationFormat:
    """Text -> tokens for an episode. chat=True (data.chat_template): the first observation is a user message
    with the generation prompt, later ones the template's text between the model's turn and the next
    generation prompt; else the first is encoded like a plain prompt and later ones as they are."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        if chat and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("data.chat_template=true needs a tokenizer with a chat template for the episodes' "
                             "messages; set data.chat_template=false or use a chat tokenizer")
        self.tokenizer, self.chat = tokenizer, chat

    def first(self, text: str, tools: list[dict] | None = None) -> list[int]:
        """The episode's prompt; `tools` (the environment's tool specs) go to the chat template's `tools=`."""
        return self.prompt([{"role": "user", "content": text}], tools)

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A whole conversation as a prompt (with the generation prompt); plain: the contents joined by newlines,
        encoded like a dataset prompt."""
        if not self.chat:
            return list(self.tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
        rendered = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=True)
        return self._encode(rendered)

    def observation(self, text: str, role: str = "user", after_token: int | None = None) -> list[int]:
        """Tokens that follow the model's turn: the observation (as a `role` message with chat=True) and the
        next generation prompt. `after_token`: the stop token the turn ended with; when the template closes
        the turn with that same token, it is not repeated."""
        return self.continuation([{"role": role, "content": text}], after_token)

    def continuation(self, messages: list[dict], after_token: int | None = None) -> list[int]:
        """Tokens that follow the model's turn: `messages` (chat: as the template renders them after an assistant
        message; plain: their contents joined by newlines) and the next generation prompt. The model's turn is
        never rendered: its tokens are the ones it generated."""
        if not self.chat:
            return self._encode("\n".join(m["content"] for m in messages))
        before = [{"role": "user", "content": "."}, {"role": "assistant", "content": _MARK}]
        rendered = self.tokenizer.apply_chat_template(before + list(messages), tokenize=False,
                                                      add_generation_prompt=True)
        if _MARK not in rendered:
            raise ValueError("the chat template does not render assistant messages; give episodes a template "
                             "that does, or set data.chat_template=false")
        ids = self._encode(rendered[rendered.index(_MARK) + len(_MARK):])
        return ids[1:] if ids and after_token is not None and ids[0] == after_token else ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Episode:
    env: Environment
    row: dict
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # after the prompt
    model_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish: str = ""  # "" while running

    @property
    def running(self) -> bool:
        return not self.finish


class EpisodeRunner:
    """Runs batches of episodes of one environment with the actor (roles.Actor: sampling_params(), generation(),
    generate_turn())."""

    def __init__(self, env: str, env_kwargs: dict, tokenizer: Any, chat: bool, limits: EpisodeLimits,
                 env_threads: int = 16) -> None:
        self.env_name, self.env_kwargs = env, dict(env_kwargs)
        make_env(env, **self.env_kwargs)  # a bad name or bad arguments fail here, before any work
        self.tokenizer, self.format, self.limits = tokenizer, ConversationFormat(tokenizer, chat), limits
        self.env_threads = env_threads

    def run(self, actor: Any, prompts: Any, settings: list[dict]) -> list[Any]:
        """One Rollout per setting (sampled, greedy, ...) for a PromptBatch: each prompt row becomes `n` episodes
        (1 for greedy), all settings inside one generation transition."""
        rows = [{"prompt": text, **meta} for text, meta in zip(prompts.texts, prompts.metadata)]
        all_params = [actor.sampling_params(setting) for setting in settings]
        env_s = 0.0
        with actor.generation() as timing:
            results = []
            for params in all_params:
                episodes = self._start([row for row in rows for _ in range(params.n)])
                env_s += self._play(actor, episodes, params)
                results.append(episodes)
        rollouts = []
        for params, episodes in zip(all_params, results):
            sequences = self._batch(episodes, params)
            rollouts.append(Rollout(sequences, [self.tokenizer.decode(e.tokens, skip_special_tokens=True)
                                                for e in episodes],
                                    [e.row["prompt"] for e in episodes],
                                    [{k: v for k, v in e.row.items() if k != "prompt"} for e in episodes],
                                    self.tokenizer))
        rollouts[0].sequences.meta["timing"] = {"transition": timing["transition"], "env": env_s}
        return rollouts

    # ---- an episode batch --------------------------------------------------------------------------------
    def _start(self, rows: list[dict]) -> list[Episode]:
        episodes = []
        for row in rows:
            env = make_env(self.env_name, **self.env_kwargs)
            first = self._env_call(env.reset, row, row, "reset")
            prompt = self.format.first(str(first), env.tool_specs())
            if len(prompt) > self.limits.max_prompt_length:
                raise EnvironmentStepError(
                    f"rollout.env={self.env_name!r}: the first observation of prompt {row['prompt'][:40]!r} is "
                    f"{len(prompt)} tokens > data.max_prompt_length={self.limits.max_prompt_length}; raise it")
            episodes.append(Episode(env, row, prompt))
        return episodes

    def _play(self, actor: Any, episodes: list[Episode], params: SamplingParams) -> float:
        """All turns of a batch of episodes; returns the seconds spent in the environment."""
        limits, env_s = self.limits, 0.0
        for turn in range(limits.max_turns):
            running = [e for e in episodes if e.running]
            if not running:
                break
            # one generate call per distinct allowance (the budget left shortens the last turns)
            by_allowance: dict[int, list[Episode]] = defaultdict(list)
            for e in running:
                by_allowance[min(limits.max_new_tokens, limits.max_episode_tokens - len(e.tokens))].append(e)
            turn_tokens: dict[int, list[int]] = {}
            for allowance, members in by_allowance.items():
                turn_params = dataclasses.replace(params, n=1, max_new_tokens=allowance,
                                                  seed=int(params.seed) + 1_000_003 * turn)
                out = actor.generate_turn([e.prompt + e.tokens for e in members], turn_params)
                for row, e in enumerate(members):
                    keep = out["response_mask"][row].bool()
                    tokens = out["responses"][row][keep].tolist()
                    e.tokens += tokens
                    e.model_mask += [1] * len(tokens)
                    e.log_probs += out["rollout_log_probs"][row][keep].tolist()
                    turn_tokens[id(e)] = tokens
            start = time.perf_counter()
            texts = [self.tokenizer.decode(turn_tokens[id(e)], skip_special_tokens=True) for e in running]
            with ThreadPoolExecutor(max_workers=max(1, min(self.env_threads, len(running)))) as pool:
                steps = list(pool.map(lambda e, text: self._env_call(e.env.step, text, e.row, "step"), running, texts))
            env_s += time.perf_counter() - start
            for e, result in zip(running, steps):
                self._advance(e, result, turn, turn_tokens[id(e)])
        for e in episodes:
            e.finish = e.finish or "turns"
        return env_s

    def _advance(self, e: Episode, result: StepResult, turn: int, tokens: list[int]) -> None:
        if not isinstance(result, StepResult):
            raise EnvironmentStepError(f"rollout.env={self.env_name!r}: step() returned {type(result).__name__}, "
                                       f"not a StepResult")
        limits = self.limits
        e.reward += limits.turn_discount ** turn * float(result.reward)
        e.turns += 1
        e.tool_calls += int(result.info.get("tool_calls", 0))
        e.tool_errors += int(result.info.get("tool_errors", 0))
        if result.done:
            e.finish = "stop"
            return
        if e.turns >= limits.max_turns:
            e.finish = "turns"
            return
        eos = self.tokenizer.eos_token_id  # the actor's stop token
        after = tokens[-1] if tokens and eos is not None and tokens[-1] == eos else None
        observation = self.format.observation(result.observation, result.info.get("role", "user"), after)
        if len(e.tokens) + len(observation) >= limits.max_episode_tokens:  # no room left for a model turn
            e.finish = "length"
            return
        e.tokens += observation
        e.model_mask += [0] * len(observation)
        e.log_probs += [0.0] * len(observation)

    def _env_call(self, fn: Callable, argument: Any, row: dict, what: str) -> Any:
        try:
            return fn(argument)
        except Exception as exc:  # noqa: BLE001 - the user's environment: name it and the row, keep the cause
            raise EnvironmentStepError(f"rollout.env={self.env_name!r}: {what}() raised {type(exc).__name__}: {exc} "
                                       f"(prompt {str(row.get('prompt'))[:60]!r})") from exc

    def _batch(self, episodes: list[Episode], params: SamplingParams) -> Batch:
        sequences = [GeneratedSequence(e.prompt, e.tokens, e.log_probs, e.finish, model_mask=e.model_mask)
                     for e in episodes]
        batch = assemble_batch(sequences, params, self.tokenizer.pad_token_id or 0)
        return Batch(batch.tensors, {**batch.non_tensors,
                                     "episode_rewards": [e.reward for e in episodes],
                                     "episode_turns": [e.turns for e in episodes],
                                     "episode_tool_calls": [e.tool_calls for e in episodes],
                                     "episode_tool_errors": [e.tool_errors for e in episodes]}, batch.meta)


def episode_metrics(sequences: Any) -> dict[str, float]:
    """rollout/* metrics of a Batch of episodes (empty for single-turn rollouts)."""
    extra = sequences.non_tensors
    if "episode_turns" not in extra:
        return {}
    tokens = sequences["attention_mask"][:, sequences["prompts"].shape[1]:].sum(-1).float()
    return {"rollout/turns_mean": float(np.mean(extra["episode_turns"].astype(float))),
            "rollout/tool_calls_mean": float(np.mean(extra["episode_tool_calls"].astype(float))),
            "rollout/tool_errors": float(np.sum(extra["episode_tool_errors"].astype(float))),
            "rollout/episode_tokens_mean": float(tokens.mean())}
