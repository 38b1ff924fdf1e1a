"""Agent programs as rollouts (rollout.agent): any program written against an OpenAI-style client is trained as it is.

    async def agent(client: openai.AsyncOpenAI, row: dict) -> float | dict | None

`client` is already pointed at the rollout engine's endpoint (rollout/endpoint.py: base_url with the run in it,
the run's bearer token); `row` is one data row (its "prompt" and extra columns). The agent calls the model as
often as it likes, runs tools itself, and returns its reward: a number, a dict with "reward" (its other numeric
entries are logged as agent/<key>), or None to leave scoring to reward.fn / the reward model / reward.sources.
Each prompt row gets rollout.n runs (greedy settings: one run whose every request is greedy); at most
rollout.agent_concurrency run at once, all inside one training -> generation transition (colocated) or on the
rollout pool's replicas. A run still going after rollout.agent_timeout_s is cancelled; a run that raised or
timed out is dropped, or kept with rollout.agent_failure_reward when that is set (agent/errors,
agent/timeouts count them).

Every run becomes one trajectory (several where it edited history: rollout/agent_trace.py) in rollout/base.py's
layout: prompt, then every token after it, the response mask on the model's tokens only, the engine's log-probs
and the policy version of each model token. Rows carry "group_index" (the prompt row they came from) for the
group baselines, since runs that split or drop make groups of other sizes than rollout.n.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import inspect
import logging
import math
import secrets
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hybridrl.config import EndpointConfig
from hybridrl.controller.interrupts import raise_if_requested
from hybridrl.envs.base import EnvironmentStepError
from hybridrl.protocol import Batch
from hybridrl.registry import resolve_dotted
from hybridrl.rollout.agent_trace import RunTrace, TraceLimits
from hybridrl.rollout.base import SamplingParams, assemble_batch
from hybridrl.rollout.endpoint import AgentEndpoint, EventLoopThread
from hybridrl.rollout.multiturn import ConversationFormat
from hybridrl.rollout.types import Rollout

logger = logging.getLogger(__name__)

PACKAGES = ("openai", "aiohttp", "httpx")


class AgentError(EnvironmentStepError):
    """The user's agent program cannot be trained on (every run of a batch failed, no reward anywhere)."""


def load_agent(path: str) -> Callable:
    """"package.module:function" -> the async agent function, or a ValueError naming the option."""
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"rollout.agent needs {missing} (pip install 'hybridrl[agent]')")
    fn = resolve_dotted(path, "rollout.agent")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.agent={path!r} is not an async function (async def agent(client, row))")
    return fn


@dataclass(frozen=True)
class AgentSettings:
    concurrency: int
    timeout_s: float
    failure_reward: float | None
    endpoint: EndpointConfig
    scored_elsewhere: bool  # reward.fn or a reward model scores the trajectories too


@dataclass
class RunResult:
    trace: RunTrace
    row: dict
    group: int
    status: str  # ok | error | timeout
    reward: float | None = None
    error: str = ""
    extra: dict[str, float] = field(default_factory=dict)
    fatal: bool = False  # the program cannot be trained on as configured (AgentError): the run stops


class _ClientSlots:
    """One httpx client per concurrent run slot, handed from run to run (a client per run costs ~3 ms; one client
    for all runs scans its whole connection pool on every request: 64 agents spent most of their time there). A
    run's agent closing its client must not close the slot's."""

    def __init__(self, slots: int, timeout_s: float) -> None:
        import httpx  # the agent extra's client, needed only with rollout.agent

        class Slot(httpx.AsyncClient):
            async def aclose(self) -> None:  # the runner closes it (really_close)
                pass

            async def really_close(self) -> None:
                await super().aclose()

        self.free: asyncio.Queue = asyncio.Queue()
        tls = ssl.create_default_context()  # one for all slots (each client would load the CA bundle again)
        for _ in range(slots):
            # trust_env=False: an http_proxy in the environment must not carry requests to the local endpoint
            self.free.put_nowait(Slot(timeout=timeout_s, trust_env=False, verify=tls,
                                      limits=httpx.Limits(max_connections=8, max_keepalive_connections=8)))
        self.all = list(self.free._queue)

    async def close(self) -> None:
        for client in self.all:
            await client.really_close()


class AgentRunner:
    """Runs the agent program over prompt rows against the endpoint, and turns the runs into Rollouts."""

    def __init__(self, agent: str, settings: AgentSettings, tokenizer: Any, chat: bool, limits: TraceLimits,
                 model_name: str) -> None:
        self.path, self.fn = agent, load_agent(agent)
        self.settings, self.tokenizer, self.limits = settings, tokenizer, limits
        self.format = ConversationFormat(tokenizer, chat)
        self.endpoint = AgentEndpoint(settings.endpoint, tokenizer, model_name, limits.max_model_len)
        self._loop: EventLoopThread | None = None
        self._pending: set[concurrent.futures.Future] = set()

    def start(self) -> None:
        if self._loop is not None:
            return
        if self.settings.endpoint.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("rollout.endpoint.host=%s: the agent endpoint is reachable from other machines (the bearer "
                           "token still guards it)", self.settings.endpoint.host)
        self.endpoint.start()
        for name in ("httpx", "openai"):  # one INFO line per request otherwise (thousands a step)
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
        self._loop = EventLoopThread("hybridrl-agents")

        async def setup() -> None:  # in the agents' loop: its queue belongs there
            self._slots = _ClientSlots(self.settings.concurrency, self.settings.timeout_s)

        self._loop.submit(setup()).result(timeout=30)

    def close(self) -> None:
        self.cancel()
        if self._loop is not None:
            self._loop.stop(self._slots.close())
            self._loop = None
        self.endpoint.close()

    def cancel(self) -> None:
        """Stop every agent run in flight (their batches are abandoned: a restart or a resume)."""
        for future in list(self._pending):
            future.cancel()
        self._pending.clear()

    # ---- colocated: inside one generation transition ----------------------------------------------------
    def run(self, actor: Any, prompts: Any, settings: list[dict], version: int = 0) -> list[Rollout]:
        """One Rollout per setting (sampled, greedy, ...) for a PromptBatch, the actor holding the generation
        layout while the agents run (roles.Actor: sampling_params(), generation(), generate_turn())."""
        self.start()
        rows = [{"prompt": text, **meta} for text, meta in zip(prompts.texts, prompts.metadata)]
        all_params = [actor.sampling_params(setting) for setting in settings]
        with actor.generation() as timing:
            self.endpoint.backend = lambda ids, params: (actor.generate_turn(ids, params), version)
            try:
                results, agent_s = self.wait(self._submit(rows, all_params))
            finally:
                self.endpoint.backend = None
        rollouts = [self.rollout(r, params) for r, params in zip(results, all_params)]
        rollouts[0].sequences.meta["timing"] = {"transition": timing["transition"], "agent": agent_s}
        return rollouts

    # ---- a rollout pool of its own -------------------------------------------------------------------------
    def submit(self, replicas: Any, prompts: Any, settings: list[dict]) -> "PendingAgentRollouts":
        """Start the agent runs of a batch on the rollout pool's replicas without waiting (trainer.mode
        one_step_off / async: RolloutQueue); `.result()` collects."""
        self.start()
        self.endpoint.backend = replicas.generate_turn
        rows = [{"prompt": text, **meta} for text, meta in zip(prompts.texts, prompts.metadata)]
        all_params = [replicas.actor.sampling_params(setting) for setting in settings]
        return PendingAgentRollouts(self, self._submit(rows, all_params), all_params, replicas.version)

    # ---- the runs ---------------------------------------------------------------------------------------
    def _submit(self, rows: list[dict], all_params: list[SamplingParams]) -> concurrent.futures.Future:
        self.endpoint.seed = int(all_params[0].seed or 0)
        future = self._loop.submit(self._run_all(rows, all_params))
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def wait(self, future: concurrent.futures.Future) -> Any:
        """The runs' results; raises at once when a generate call failed or the driver was interrupted."""
        try:
            while True:
                try:
                    return future.result(timeout=0.5)
                except concurrent.futures.TimeoutError:
                    pass
                raise_if_requested()
                if self.endpoint.failure is not None:
                    failure, self.endpoint.failure = self.endpoint.failure, None
                    raise failure
        except BaseException:
            future.cancel()
            raise

    async def _run_all(self, rows: list[dict], all_params: list[SamplingParams]) -> tuple[list, float]:
        start = time.perf_counter()
        tasks = [[self._one(row, group, params) for group, row in enumerate(rows) for _ in range(params.n)]
                 for params in all_params]
        flat = await asyncio.gather(*(t for per_setting in tasks for t in per_setting))
        out, at = [], 0
        for per_setting in tasks:
            out.append(flat[at:at + len(per_setting)])
            at += len(per_setting)
        return out, time.perf_counter() - start

    async def _one(self, row: dict, group: int, params: SamplingParams) -> RunResult:
        http = await self._slots.free.get()  # at most rollout.agent_concurrency runs at once
        trace = RunTrace(secrets.token_hex(8), self.format, self.limits)
        try:
            base_url = self.endpoint.open_run(trace, params, greedy=params.is_greedy)
            return await self._call_agent(trace, row, group, base_url, http)
        finally:
            self.endpoint.close_run(trace.run_id)
            self._slots.free.put_nowait(http)

    async def _call_agent(self, trace: RunTrace, row: dict, group: int, base_url: str, http: Any) -> RunResult:
        import openai  # the agent extra's client, needed only with rollout.agent

        client = openai.AsyncOpenAI(base_url=base_url, api_key=self.endpoint.token, max_retries=0,
                                    timeout=self.settings.timeout_s, http_client=http)
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                value = await self.fn(client, dict(row))
            result = RunResult(trace, row, group, "ok")
            self._read_reward(result, value)
        except AgentError as exc:
            result = RunResult(trace, row, group, "error", error=str(exc), fatal=True)
        except TimeoutError as exc:
            timed_out = time.perf_counter() - start >= self.settings.timeout_s
            result = RunResult(trace, row, group, "timeout" if timed_out else "error",
                               error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the user's agent: counted, the run dropped or scored
            result = RunResult(trace, row, group, "error", error=f"{type(exc).__name__}: {exc}")
        return result

    def _read_reward(self, result: RunResult, value: Any) -> None:
        if isinstance(value, dict):
            result.extra = {k: float(v) for k, v in value.items() if k != "reward" and isinstance(v, (int, float))
                            and not isinstance(v, bool)}
            value = value.get("reward")
        if value is None:
            if not self.settings.scored_elsewhere:
                raise AgentError(f"rollout.agent={self.path!r} returned no reward for prompt "
                                 f"{str(result.row.get('prompt'))[:60]!r} and no reward.fn, reward_model or "
                                 f"reward.sources scores the trajectories: return a number (or a dict with "
                                 f"'reward'), or set reward.fn")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"the agent returned {type(value).__name__} {value!r:.60}; return a number, a dict with "
                            f"'reward', or None")
        result.reward = float(value)

    # ---- results -> Rollout -----------------------------------------------------------------------------
    def rollout(self, results: list[RunResult], params: SamplingParams) -> Rollout:
        """The trajectories of one setting's runs as a Rollout (episode layout + group_index), meta["agent"]
        its agent/* statistics."""
        fatal = [r for r in results if r.fatal]
        if fatal:
            raise AgentError(fatal[0].error)
        keep = self.settings.failure_reward
        sequences, texts, prompts, metadata, extra = [], [], [], [], {k: [] for k in
                                                                        ("episode_rewards", "episode_turns",
                                                                         "episode_tool_calls", "group_index")}
        for r in results:
            if r.status != "ok" and keep is None:
                continue
            reward = (r.reward if r.status == "ok" else keep) or 0.0
            kept = [t for t in r.trace.trajectories if any(t.model_mask)]
            for sequence, trajectory in zip(r.trace.sequences(), kept):
                sequences.append(sequence)
                texts.append(self.tokenizer.decode(trajectory.tokens, skip_special_tokens=True))
                prompts.append(r.row["prompt"])
                metadata.append({k: v for k, v in r.row.items() if k != "prompt"})
                for key, value in zip(extra, (reward, trajectory.requests, trajectory.tool_calls, r.group)):
                    extra[key].append(value)
        if not sequences:
            first = next((r.error for r in results if r.error), "no run made a request")
            raise AgentError(f"rollout.agent={self.path!r}: no agent run of the batch left a trajectory to train on "
                             f"({sum(r.status == 'error' for r in results)} raised, "
                             f"{sum(r.status == 'timeout' for r in results)} timed out); the first: {first}")
        batch = assemble_batch(sequences, params, self.tokenizer.pad_token_id or 0)
        meta = {**batch.meta, "agent": self._stats(results)}
        non_tensors = {**batch.non_tensors, **extra, "episode_tool_errors": [0] * len(sequences)}
        return Rollout(Batch(batch.tensors, non_tensors, meta), texts, prompts, metadata, self.tokenizer)

    def _stats(self, results: list[RunResult]) -> dict[str, float]:
        for r in results:
            if r.status != "ok":
                logger.debug("agent run (prompt %r) %s: %s", str(r.row.get("prompt"))[:40], r.status, r.error)
        errors = [r for r in results if r.status == "error"]
        if errors:
            logger.warning("%d of %d agent runs raised; the first: %s", len(errors), len(results), errors[0].error)
        stats = {"requests_mean": float(np.mean([len(r.trace.records) for r in results])),
                 "tokens_mean": float(np.mean([r.trace.model_tokens() for r in results])),
                 "trajectories_mean": float(np.mean([len(r.trace.sequences()) for r in results])),
                 "errors": float(len(errors)), "timeouts": float(sum(r.status == "timeout" for r in results)),
                 "request_errors": float(sum(r.trace.refused for r in results))}
        for key in sorted({k for r in results for k in r.extra}):
            values = [r.extra[key] for r in results if key in r.extra and math.isfinite(r.extra[key])]
            if values:
                stats[key] = float(np.mean(values))
        return stats


class PendingAgentRollouts:
    """Agent runs of one batch in flight on a rollout pool (api.PendingRollouts' interface for RolloutQueue)."""

    def __init__(self, runner: AgentRunner, future: concurrent.futures.Future, all_params: list[SamplingParams],
                 version: int) -> None:
        self.runner, self.future, self.all_params, self.version = runner, future, all_params, version

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> list[Rollout]:
        results, agent_s = self.runner.wait(self.future)
        rollouts = [self.runner.rollout(r, params) for r, params in zip(results, self.all_params)]
        rollouts[0].sequences.meta["timing"] = {"agent": agent_s}
        for rollout in rollouts:
            rollout.sequences.meta["policy_version"] = self.version
        return rollouts


class AgentReplicas:
    """The rollout pool's replicas as RolloutQueue sees them, generating through agent runs."""

    def __init__(self, runner: AgentRunner, replicas: Any) -> None:
        self.runner, self.replicas = runner, replicas

    @property
    def version(self) -> int:
        return self.replicas.version

    def sync(self, in_flight: int = 1) -> dict[str, float]:
        return self.replicas.sync(in_flight)

    def submit(self, prompts: Any, settings: list[dict]) -> PendingAgentRollouts:
        return self.runner.submit(self.replicas, prompts, settings)


def agent_metrics(sequences: Any) -> dict[str, float]:
    """agent/* metrics of a Batch from agent runs (empty otherwise)."""
    stats = sequences.meta.get("agent")
    return {} if stats is None else {f"agent/{key}": value for key, value in stats.items()}
