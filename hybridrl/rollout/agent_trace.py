"""Token-in-token-out bookkeeping of one agent run: which token ids each request sends to the engine, and the
trajectories (rows to train on) the run's requests make.

A run holds trajectories. A request whose conversation extends one of them continues it: its prompt is that
trajectory's tokens exactly as the engine consumed and produced them, followed by the new messages only
(chat: encoded by rollout/multiturn.py's ConversationFormat as they follow the model's turn, exactly as a
multi-turn episode's observations are; completions: the new text, or the new token ids). Earlier model output
is never re-tokenized. "Extends" means, for chat, that the trajectory's messages (the model's turns compared
as served: content and tool calls) are the request's first messages, with the same tools; for completions,
that the request's prompt text starts with the trajectory's text (the decoded tokens, a matched stop string
included), or its token ids with the trajectory's ids.

Where the agent edited history (dropped, rewrote or reordered earlier messages), or asked twice from the same
point (n > 1, or a second request while the first is still being generated), the request starts a new
trajectory. Its prompt reuses the tokens of the longest run of messages it shares with a trajectory, up to the
end of a model turn, and encodes the rest (a conversation sharing no model turn is encoded whole by the chat
template). Everything in a new trajectory's prompt is context (response mask 0): the model tokens it repeats
are trained on in the trajectory they were generated in. Every trajectory of a run gets the run's reward.

Per trajectory the mask is 1 on the model's tokens only, the log-probs are the engine's and each model token
records the policy version that generated it.
"""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from hybridrl.rollout.base import GeneratedSequence
from hybridrl.rollout.multiturn import ConversationFormat
from hybridrl.rollout.openai_wire import (ChatRequest, ServedChoice, WireError, message_key, served_message,
                                          template_message)


@dataclass(frozen=True)
class TraceLimits:
    max_requests: int  # rollout.max_turns: requests per run
    max_new_tokens: int  # per request
    max_episode_tokens: int  # per trajectory, after its prompt (model tokens and context)
    max_model_len: int  # the engine's context


@dataclass
class Generated:
    """One row the engine generated: its tokens, their log-probs and policy versions, why it ended."""
    tokens: list[int]
    log_probs: list[float]
    versions: list[int]
    finish: str  # stop | length


@dataclass
class Trajectory:
    prompt: list[int]
    tools: str | None = None  # chat: the tools its conversation was rendered with
    tokens: list[int] = field(default_factory=list)  # after the prompt
    model_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[tuple] = field(default_factory=list)  # chat: message keys, ending with a served model turn
    served: dict[int, int] = field(default_factory=dict)  # chat: served turn's message index -> tokens to its end
    text: str | None = None  # completions from text: the text its tokens hold
    ids_prompt: bool = False  # completions from token ids
    requests: int = 0
    tool_calls: int = 0
    finish: str = "stop"
    busy: bool = False  # a request extending it is being generated

    @property
    def full(self) -> list[int]:
        return self.prompt + self.tokens

    def append(self, tokens: list[int], model: bool, log_probs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        self.tokens += tokens
        self.model_mask += [int(model)] * len(tokens)
        self.log_probs += log_probs if model else [0.0] * len(tokens)
        self.versions += versions if model else [-1] * len(tokens)


@dataclass
class PromptPlan:
    """What one prompt of a request sends to the engine, and where its result goes."""
    prompt_ids: list[int]
    max_new_tokens: int
    extends: Trajectory | None = None  # None: the choices start new trajectories
    context: list[int] = field(default_factory=list)  # appended to `extends` before the model's tokens
    messages: list[tuple] | None = None  # chat: the request's message keys
    served: dict[int, int] = field(default_factory=dict)  # chat: served turns inside prompt_ids
    text: str | None = None  # completions from text: the prompt text
    tools: str | None = None


@dataclass
class RequestRecord:
    """A served request, kept for metrics and checks: what the engine consumed and produced."""
    prompt_ids: list[int]
    outputs: list[Generated]
    trajectories: list[int]  # the trajectory each choice went to


def tools_key(tools: list[dict] | None) -> str | None:
    return None if not tools else json.dumps(tools, sort_keys=True)


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RunTrace:
    """The trajectories of one agent run. Requests are prepared and recorded under its lock (the endpoint's
    handlers), results read once the run is closed."""

    def __init__(self, run_id: str, fmt: ConversationFormat, limits: TraceLimits) -> None:
        self.run_id, self.format, self.limits = run_id, fmt, limits
        self.eos = fmt.tokenizer.eos_token_id
        self.trajectories: list[Trajectory] = []
        self.records: list[RequestRecord] = []
        self.lock = threading.Lock()
        self.closed = False
        self.started = 0  # requests admitted (counted against max_requests)
        self.refused = 0  # requests answered with an error

    # ---- preparing a request -------------------------------------------------------------------------------
    def _admit(self) -> None:
        if self.closed:
            raise WireError(f"agent run {self.run_id} has ended", status=404, code="run_ended")
        if self.started >= self.limits.max_requests:
            raise WireError(f"agent run {self.run_id} made {self.started} requests: rollout.max_turns="
                            f"{self.limits.max_requests} is the most a run may make", code="too_many_requests")
        self.started += 1

    @contextmanager
    def _counting_refusals(self) -> Iterator[None]:
        try:
            yield
        except WireError:
            self.refused += 1
            raise

    @staticmethod
    def _render(encode: Any, messages: list[dict], extra: Any) -> list[int]:
        """Messages through the chat template; a template that refuses them (e.g. roles out of its order) is the
        request's fault: a 400, not a crash."""
        try:
            return encode(messages, extra)
        except Exception as exc:  # noqa: BLE001 - jinja's errors (TemplateError, its raise_exception) and others
            raise WireError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                            param="messages") from None

    def _after(self, tokens: list[int]) -> int | None:
        return tokens[-1] if tokens and self.eos is not None and tokens[-1] == self.eos else None

    def _budget(self, prompt: list[int], used: int, wanted: int | None) -> int:
        limits = self.limits
        room = min(limits.max_episode_tokens - used, limits.max_model_len - len(prompt))
        if room < 1:
            raise WireError(f"the prompt ({len(prompt)} tokens, {used} after the trajectory's first prompt) leaves no "
                            f"room to generate: rollout.max_episode_tokens={limits.max_episode_tokens}, context "
                            f"{limits.max_model_len} tokens", code="context_length_exceeded")
        return min(wanted or limits.max_new_tokens, limits.max_new_tokens, room)

    def prepare_chat(self, request: ChatRequest) -> PromptPlan:
        with self.lock, self._counting_refusals():
            self._admit()
            keys = [message_key(m) for m in request.messages]
            tools = tools_key(request.tools)
            same_tools = [t for t in self.trajectories if t.tools == tools and t.messages]
            extendable = [t for t in same_tools if not t.busy and len(t.messages) <= len(keys)
                          and keys[:len(t.messages)] == t.messages]
            if extendable:
                base = max(extendable, key=lambda t: len(t.messages))
                new = [template_message(m) for m in request.messages[len(base.messages):]]
                context = self._render(self.format.continuation, new, self._after(base.tokens))
                prompt = base.full + context
                plan = PromptPlan(prompt, self._budget(prompt, len(base.tokens) + len(context),
                                                       request.sampling.max_tokens),
                                  base, context, keys, dict(base.served), tools=tools)
                base.busy = True
                return plan
            prompt, served = self._reused_prompt(request, keys, same_tools)
            return PromptPlan(prompt, self._budget(prompt, 0, request.sampling.max_tokens), None, [], keys, served,
                              tools=tools)

    def _reused_prompt(self, request: ChatRequest, keys: list[tuple], candidates: list[Trajectory]
                       ) -> tuple[list[int], dict[int, int]]:
        """A new trajectory's prompt: the tokens of the longest shared run of messages ending with a served model
        turn, then the rest encoded; no shared model turn: the whole conversation through the template."""
        best: tuple[int, Trajectory] | None = None
        for t in candidates:
            shared = _common_prefix(t.messages, keys)
            ends = [i for i in t.served if i < shared]
            if ends and (best is None or max(ends) > best[0]):
                best = (max(ends), t)
        if best is None:
            messages = [template_message(m) for m in request.messages]
            return self._render(self.format.prompt, messages, request.tools), {}
        turn, source = best
        reused = source.full[:source.served[turn]]
        rest = [template_message(m) for m in request.messages[turn + 1:]]
        served = {i: end for i, end in source.served.items() if i <= turn}
        return reused + self._render(self.format.continuation, rest, self._after(reused)), served

    def prepare_completion(self, prompt: str | list[int], max_tokens: int | None) -> PromptPlan:
        with self.lock, self._counting_refusals():
            self._admit()
            if isinstance(prompt, str):
                holders = [t for t in self.trajectories if t.text is not None and not t.busy
                           and prompt.startswith(t.text)]
                if holders:
                    base = max(holders, key=lambda t: len(t.text))
                    rest = prompt[len(base.text):]
                    context = list(self.format.tokenizer(rest, add_special_tokens=False)["input_ids"])
                    ids = base.full + context
                    plan = PromptPlan(ids, self._budget(ids, len(base.tokens) + len(context), max_tokens), base,
                                      context, text=prompt)
                    base.busy = True
                    return plan
                ids = list(self.format.tokenizer(prompt)["input_ids"])
                return PromptPlan(ids, self._budget(ids, 0, max_tokens), text=prompt)
            ids = [int(t) for t in prompt]
            vocab = len(self.format.tokenizer)
            if min(ids) < 0 or max(ids) >= vocab:
                raise WireError(f"prompt token ids must be in [0, {vocab}) (the tokenizer's vocabulary)",
                                param="prompt")
            holders = [t for t in self.trajectories if t.ids_prompt and not t.busy and ids[:len(t.full)] == t.full]
            if holders:
                base = max(holders, key=lambda t: len(t.full))
                context = ids[len(base.full):]
                plan = PromptPlan(ids, self._budget(ids, len(base.tokens) + len(context), max_tokens), base, context)
                base.busy = True
                return plan
            return PromptPlan(ids, self._budget(ids, 0, max_tokens))

    def release(self, plan: PromptPlan) -> None:
        """A prepared request that failed: the trajectory it would extend is free again."""
        with self.lock:
            self.refused += 1
            if plan.extends is not None:
                plan.extends.busy = False

    # ---- recording what was served -------------------------------------------------------------------------
    def record(self, plan: PromptPlan, outputs: list[Generated], served: list[ServedChoice]) -> list[int]:
        """Append a served request's choices to its trajectories (the first choice continues the one it
        extends; the others, or all when it extends none, start new ones). Returns their indices."""
        with self.lock:
            if plan.extends is not None:
                plan.extends.busy = False
            if self.closed:
                return []
            indices = []
            for k, (out, choice) in enumerate(zip(outputs, served)):
                if k == 0 and plan.extends is not None:
                    trajectory = plan.extends
                    trajectory.append(plan.context, model=False)
                else:
                    trajectory = Trajectory(list(plan.prompt_ids), plan.tools, ids_prompt=plan.text is None
                                            and plan.messages is None)
                    self.trajectories.append(trajectory)
                trajectory.append(out.tokens, True, out.log_probs, out.versions)
                trajectory.requests += 1
                trajectory.tool_calls += len(choice.tool_calls)
                trajectory.finish = out.finish
                if plan.messages is not None:
                    trajectory.messages = plan.messages + [message_key(served_message(choice))]
                    trajectory.served = {**plan.served, len(plan.messages): len(trajectory.full)}
                elif plan.text is not None:
                    trajectory.text = plan.text + self.format.tokenizer.decode(out.tokens, skip_special_tokens=True)
                indices.append(self.trajectories.index(trajectory))
            self.records.append(RequestRecord(list(plan.prompt_ids), list(outputs), indices))
            return indices

    def close(self) -> None:
        with self.lock:
            self.closed = True

    # ---- results -------------------------------------------------------------------------------------------
    def sequences(self) -> list[GeneratedSequence]:
        """One GeneratedSequence per trajectory holding model tokens (rollout/base.py's layout)."""
        return [GeneratedSequence(t.prompt, t.tokens, t.log_probs, t.finish, model_mask=t.model_mask,
                                  versions=t.versions)
                for t in self.trajectories if any(t.model_mask)]

    def model_tokens(self) -> int:
        return sum(len(r.tokens) for record in self.records for r in record.outputs)

    def detail(self) -> dict[str, Any]:
        return {"requests": len(self.records), "trajectories": len(self.sequences()),
                "tool_calls": sum(t.tool_calls for t in self.trajectories)}
