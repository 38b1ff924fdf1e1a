"""The OpenAI-compatible endpoint agent programs talk to while the rollout engine generates (rollout.agent).

An aiohttp server on the driver, in a thread of its own, serves `POST /agent/<run>/v1/chat/completions`,
`POST /agent/<run>/v1/completions` and `GET [/agent/<run>]/v1/models` (rollout/openai_wire.py's format). The run
in the URL is the agent run the request belongs to (rollout/agent_trace.py turns its requests into
trajectories); the client an agent gets has it in its base_url. Every request needs the run's bearer token
(random per training run); the server listens on 127.0.0.1 unless rollout.endpoint.host says otherwise; a body
over rollout.endpoint.max_request_bytes is refused unread. A request the endpoint cannot serve (bad JSON, bad
field, unknown run, a prompt longer than the context) gets OpenAI's error body with a 4xx status; nothing a
request holds can stop the run.

Batching: requests are queued, and the queue goes to the engine in one generate call (`backend`: the actor's
generate_turn in the generation layout, or the rollout pool's replicas) as soon as every open agent run is
waiting on a request or busy with its tools (no request within a window of its last answer: rollout.endpoint.
batch_window_ms, or half the last generate call if longer), or the oldest queued one waited 10 windows; requests
that arrive during a call go into the next. Requests that sample differently (temperature, top_p, top_k, stop tokens) go
into separate calls; different token allowances share a call (the longest is generated, each row cut to its
own). A failed generate call fails its requests with a 503 and is kept in `failure` for the runner to raise.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine

from hybridrl.config import EndpointConfig
from hybridrl.rollout.agent_trace import Generated, PromptPlan, RunTrace
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.openai_wire import (ServedChoice, WireError, chat_response, completion_response,
                                          models_response, parse_chat, parse_completion, split_tool_calls,
                                          stream_events, truncate_at_stop)

logger = logging.getLogger(__name__)

MAX_WAIT_WINDOWS = 10  # the longest a queued request waits for others, in batch windows

# backend(prompt token ids, sampling) -> (Batch in rollout/base.py's layout, rows in prompt order; policy version)
Backend = Callable[[list[list[int]], SamplingParams], tuple[Any, int]]


class EventLoopThread:
    """An asyncio event loop running in a daemon thread; coroutines are handed to it from other threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine) -> Any:
        """A concurrent.futures.Future of the coroutine's result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, first: Coroutine | None = None) -> None:
        """Run `first` (closing what the loop serves), cancel every task, stop the loop and its thread."""
        if self.loop.is_closed():
            return
        if first is not None:
            try:
                self.submit(first).result(timeout=10)
            except Exception:  # noqa: BLE001 - closing after a failure must not hide it
                logger.debug("%s: closing failed", self.thread.name, exc_info=True)

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(cancel_all()).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            if not self.thread.is_alive():
                self.loop.close()


@dataclass
class _Run:
    trace: RunTrace
    defaults: SamplingParams  # the run's sampling when a request gives none (the actor's rollout settings)
    greedy: bool  # every request of the run is greedy (ReMax's baseline runs)
    order: int  # runs are batched in the order they were opened
    ready_since: float = 0.0  # when it opened or got its last answer (its agent works since); inf: being answered
    queued: int = 0  # its requests waiting for a generate call


@dataclass
class _Queued:
    run: _Run
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    order: tuple[int, int]
    future: asyncio.Future = field(repr=False, default=None)

    @property
    def key(self) -> tuple:
        p = self.params
        return p.is_greedy, p.temperature, p.top_p, p.top_k, p.stop_token_ids, p.ignore_eos


class AgentEndpoint:
    def __init__(self, settings: EndpointConfig, tokenizer: Any, model_name: str, max_model_len: int,
                 seed: int = 0) -> None:
        self.settings, self.tokenizer, self.model_name = settings, tokenizer, model_name
        self.max_model_len = max_model_len  # the engine's context: every row of a call must fit it
        self.token = secrets.token_urlsafe(24)  # the per-run bearer token
        self.backend: Backend | None = None  # set while a generation phase is open
        self.failure: BaseException | None = None  # the first generate call that failed
        self.calls = self.rows = 0  # generate calls and rows, for agent/* metrics
        self.seed = seed
        self._runs: dict[str, _Run] = {}
        self._runs_lock = threading.Lock()
        self._opened = self._requests = 0
        self._queue: list[_Queued] = []
        self._last_call_s = 0.0
        self._thread: EventLoopThread | None = None
        self._executor: ThreadPoolExecutor | None = None  # the one thread that calls the engine
        self.url = ""

    # ---- life --------------------------------------------------------------------------------------------
    def start(self) -> str:
        """Start serving; returns the root URL (http://host:port)."""
        from aiohttp import web  # an optional dependency (the agent extra), needed only with rollout.agent

        self.failure = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridrl-generate")
        self._thread = EventLoopThread("hybridrl-endpoint")
        self.url = self._thread.submit(self._start(web)).result(timeout=60)
        logger.info("agent endpoint serving on %s (bearer token required)", self.url)
        return self.url

    async def _start(self, web: Any) -> str:
        app = web.Application(client_max_size=self.settings.max_request_bytes, middlewares=[self._middleware(web)])
        for prefix in ("", "/agent/{run}"):
            app.router.add_get(prefix + "/v1/models", self._models)
        app.router.add_post("/agent/{run}/v1/chat/completions", self._chat)
        app.router.add_post("/agent/{run}/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self._wake = asyncio.Event()
        self._batching = asyncio.get_running_loop().create_task(self._batch_loop())
        return f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop(self._runner.cleanup())
            self._thread = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # ---- runs --------------------------------------------------------------------------------------------
    def open_run(self, trace: RunTrace, defaults: SamplingParams, greedy: bool) -> str:
        """Register a run; returns its base URL (what its client's base_url is)."""
        with self._runs_lock:
            self._runs[trace.run_id] = _Run(trace, defaults, greedy, self._opened, time.monotonic())
            self._opened += 1
        return f"{self.url}/agent/{trace.run_id}/v1"

    def close_run(self, run_id: str) -> None:
        with self._runs_lock:
            run = self._runs.pop(run_id, None)
        if run is not None:
            run.trace.close()
        if self._thread is not None:  # the runs left may now all be waiting
            self._thread.loop.call_soon_threadsafe(self._wake.set)

    def _run(self, request: Any) -> _Run:
        run_id = request.match_info["run"]
        with self._runs_lock:
            run = self._runs.get(run_id)
        if run is None:
            raise WireError(f"no open agent run {run_id!r:.40} (it ended, or the URL is not a client's base_url)",
                            status=404, code="run_not_found")
        return run

    # ---- HTTP --------------------------------------------------------------------------------------------
    def _authorized(self, request: Any) -> bool:
        given = request.headers.get("Authorization", "")
        return given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), self.token.encode())

    def _middleware(self, web: Any) -> Any:
        @web.middleware
        async def handle(request: Any, handler: Any) -> Any:
            try:
                if not self._authorized(request):
                    raise WireError("missing or wrong bearer token (use the api_key of the client given to the "
                                    "agent)", status=401, code="invalid_api_key")
                return await handler(request)
            except WireError as exc:
                return web.json_response(exc.body(), status=exc.status)
            except web.HTTPException as exc:  # no such route (404), method (405), a body over the limit (413)
                message = (f"the request body is larger than rollout.endpoint.max_request_bytes="
                           f"{self.settings.max_request_bytes}" if exc.status == 413 else exc.reason)
                return web.json_response(WireError(message, status=exc.status).body(), status=exc.status)
            except Exception as exc:  # noqa: BLE001 - a request must never take the run down: log, answer 500
                logger.exception("agent endpoint: %s %s failed", request.method, request.path)
                return web.json_response(WireError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                                   kind="server_error").body(), status=500)
        return handle

    async def _json(self, request: Any) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except ValueError:
            raise WireError("the request body is not valid JSON") from None

    async def _models(self, request: Any) -> Any:
        from aiohttp import web  # see start()

        return web.json_response(models_response(self.model_name, int(time.time())))

    async def _chat(self, request: Any) -> Any:
        run = self._run(request)
        parsed = parse_chat(await self._json(request), self.settings.max_n)
        plan = run.trace.prepare_chat(parsed)
        outputs = await self._generate_plans(run, [plan], parsed.n, parsed.sampling)
        served = [self._serve(out, parsed.sampling.stop, parsed.parse_tools, parsed.logprobs) for out in outputs[0]]
        run.trace.record(plan, [g for g, _ in served], [c for _, c in served])
        body = chat_response(parsed, f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), [c for _, c in served],
                             plan.prompt_ids, {"policy_version": min(min(g.versions or [0]) for g, _ in served)})
        return await self._respond(request, body, parsed.stream, parsed.include_usage, chat=True)

    async def _completions(self, request: Any) -> Any:
        run = self._run(request)
        parsed = parse_completion(await self._json(request), self.settings.max_n)
        plans = []
        try:
            for prompt in parsed.prompts:
                plans.append(run.trace.prepare_completion(prompt, parsed.sampling.max_tokens))
        except WireError:
            for plan in plans:
                run.trace.release(plan)
            raise
        outputs = await self._generate_plans(run, plans, parsed.n, parsed.sampling)
        choices, versions = [], []
        for plan, outs in zip(plans, outputs):
            served = [self._serve(out, parsed.sampling.stop, False, parsed.logprobs) for out in outs]
            run.trace.record(plan, [g for g, _ in served], [c for _, c in served])
            choices += [c for _, c in served]
            versions += [min(g.versions or [0]) for g, _ in served]
        body = completion_response(parsed, f"cmpl-{secrets.token_hex(12)}", int(time.time()), choices,
                                   sum(len(p.prompt_ids) for p in plans), {"policy_version": min(versions)})
        return await self._respond(request, body, parsed.stream, parsed.include_usage, chat=False)

    async def _respond(self, request: Any, body: dict, stream: bool, usage: bool, chat: bool) -> Any:
        from aiohttp import web  # see start()

        if not stream:
            return web.json_response(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in stream_events(body, chat, usage):
            await response.write(event)
        await response.write_eof()
        return response

    # ---- from a request to rows of the engine ---------------------------------------------------------------
    def _params(self, run: _Run, sampling: Any) -> SamplingParams:
        """The run's defaults overridden by what the request asks (rollout.endpoint.sampling=request)."""
        d = run.defaults
        ask = sampling if self.settings.sampling == "request" and not run.greedy else None
        temperature = ask.temperature if ask and ask.temperature is not None else d.temperature
        stops = set(d.stop_token_ids) | set(sampling.stop_token_ids)
        for stop in sampling.stop:  # a stop string of one token also stops the engine early
            ids = self.tokenizer(stop, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                stops.add(int(ids[0]))
        return dataclasses.replace(
            d, n=1, greedy=run.greedy or d.greedy or temperature == 0.0, temperature=temperature,
            top_p=ask.top_p if ask and ask.top_p is not None else d.top_p,
            top_k=ask.top_k if ask and ask.top_k is not None else d.top_k,
            stop_token_ids=tuple(sorted(stops)), ignore_eos=sampling.ignore_eos or d.ignore_eos)

    async def _generate_plans(self, run: _Run, plans: list[PromptPlan], n: int, sampling: Any
                              ) -> list[list[Generated]]:
        loop = asyncio.get_running_loop()
        params = self._params(run, sampling)
        queued = []
        for plan in plans:
            for _ in range(n):
                self._requests += 1
                queued.append(_Queued(run, plan.prompt_ids, plan.max_new_tokens, params, (run.order, self._requests),
                                      loop.create_future()))
        self._queue += queued
        run.queued += len(queued)
        self._wake.set()
        try:
            results = await asyncio.gather(*(q.future for q in queued))
        except BaseException:
            for plan in plans:
                run.trace.release(plan)
            raise
        finally:
            run.ready_since = time.monotonic()
        return [results[i * n:(i + 1) * n] for i in range(len(plans))]

    def _serve(self, out: Generated, stops: tuple[str, ...], tools: bool, logprobs: bool
               ) -> tuple[Generated, ServedChoice]:
        """A generated row as served: cut at a stop string (its tokens kept), decoded, tool calls split out."""
        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

        keep, stop = truncate_at_stop(out.tokens, decode, stops)
        if stop is not None:
            out = Generated(out.tokens[:keep], out.log_probs[:keep], out.versions[:keep], "stop")
        text = decode(out.tokens)
        if stop is not None:
            text = text[:text.index(stop)]
        content, calls = split_tool_calls(text) if tools else (text, [])
        finish = "tool_calls" if calls else out.finish
        token_texts = [self.tokenizer.decode([t]) for t in out.tokens] if logprobs else []
        return out, ServedChoice(out.tokens, out.log_probs, text, finish, calls, content, token_texts)

    # ---- batching ------------------------------------------------------------------------------------------
    def _expected_until(self, window: float) -> float:
        """Until when a request may still come from an open run that waits on none: its agent got an answer (or
        started) less than a window ago. A run working longer than that is busy with its tools."""
        with self._runs_lock:
            runs = list(self._runs.values())
        return max((r.ready_since + window for r in runs if not r.queued), default=0.0)

    async def _batch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._queue:
                continue
            # requests may still come from runs whose agents got their answer less than a window ago: wait for
            # them, at most MAX_WAIT_WINDOWS windows in all. A window is batch_window_ms, or half the last generate
            # call when that is longer: a call costs about the same for few rows as for many, so while a call
            # takes long, waiting a little for more rows is cheaper than a second call
            window = max(self.settings.batch_window_ms / 1000.0, self._last_call_s / 2)
            deadline = time.monotonic() + MAX_WAIT_WINDOWS * window
            while True:
                left = min(self._expected_until(window), deadline) - time.monotonic()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=left)
                except TimeoutError:
                    pass
            batch, self._queue = sorted(self._queue, key=lambda q: q.order), []
            for q in batch:
                q.run.queued -= 1
            try:
                await self._dispatch(batch)
            except Exception:  # noqa: BLE001 - the loop must go on; the requests get the error
                logger.exception("agent endpoint: batching failed")
                for q in batch:
                    _settle(q, error=WireError("internal batching error", 500, "server_error"))
            for q in batch:  # expected back: their handlers answer one after another (then ready_since is set)
                q.run.ready_since = math.inf

    async def _dispatch(self, batch: list[_Queued]) -> None:
        live = [q for q in batch if not q.run.trace.closed]
        for q in batch:
            if q.run.trace.closed:
                _settle(q, error=WireError("the agent run ended", status=404, code="run_ended"))
        groups: dict[tuple, list[_Queued]] = {}
        for q in live:
            groups.setdefault(q.key, []).append(q)
        loop = asyncio.get_running_loop()
        for members in (call for group in groups.values() for call in fitting_calls(group, self.max_model_len)):
            backend = self.backend
            if backend is None or self.failure is not None:
                why = "no generation phase is open" if self.failure is None else "generation failed earlier"
                for q in members:
                    _settle(q, error=WireError(why, status=503, kind="server_error"))
                continue
            self.calls += 1
            params = dataclasses.replace(members[0].params, max_new_tokens=max(q.max_new_tokens for q in members),
                                         seed=(self.seed + 1_000_003 * self.calls) % (1 << 31))
            start = time.perf_counter()
            try:
                out, version = await loop.run_in_executor(self._executor, backend, [q.prompt_ids for q in members],
                                                          params)
                self._last_call_s = time.perf_counter() - start
            except BaseException as exc:  # noqa: BLE001 - a worker's error or an interrupt: the runner raises it
                self.failure = self.failure or exc
                for q in members:
                    _settle(q, error=WireError(f"generation failed: {type(exc).__name__}", status=503,
                                               kind="server_error"))
                continue
            self.rows += len(members)
            for q, generated in zip(members, rows_of(out, version, [q.max_new_tokens for q in members])):
                _settle(q, generated)


def fitting_calls(members: list[_Queued], max_model_len: int) -> list[list[_Queued]]:
    """Rows of one sampling setting as generate calls: a call generates its longest allowance for every row, so
    a row whose prompt leaves less room than that goes into a later call (each row fits its own allowance)."""
    calls, left = [], list(members)
    while left:
        longest = max(q.max_new_tokens for q in left)
        call = [q for q in left if len(q.prompt_ids) + longest <= max_model_len]
        calls.append(call)
        taken = {id(q) for q in call}
        left = [q for q in left if id(q) not in taken]
    return calls


def _settle(q: _Queued, result: Any = None, error: BaseException | None = None) -> None:
    """Answer a queued request unless its handler stopped waiting."""
    if q.future.done():
        return
    if error is not None:
        q.future.set_exception(error)
    else:
        q.future.set_result(result)


def rows_of(batch: Any, version: int, allowances: list[int]) -> list[Generated]:
    """The rows of a generate call's Batch, each cut to its own token allowance."""
    responses, mask = batch["responses"], batch["response_mask"].bool()
    versions = batch.tensors.get("policy_versions", None)
    reasons = list(batch.non_tensors["finish_reasons"])
    rows = []
    for row, allowance in enumerate(allowances):
        keep = mask[row]
        tokens = responses[row][keep].tolist()
        log_probs = batch["rollout_log_probs"][row][keep].tolist()
        row_versions = versions[row][keep].tolist() if versions is not None else [int(version)] * len(tokens)
        finish = reasons[row]
        if len(tokens) > allowance:
            tokens, log_probs, row_versions, finish = (tokens[:allowance], log_probs[:allowance],
                                                       row_versions[:allowance], "length")
        rows.append(Generated(tokens, log_probs, row_versions, finish))
    return rows
