"""The agent endpoint in-process (no Ray): OpenAI's wire format through the official `openai` client and raw
HTTP, the errors a bad request gets (the server goes on serving), tool calls, stop strings, streaming, the
token-in-token-out bookkeeping of a run (extension, history edits, n > 1, completions), batching of concurrent
agents, and the runner's timeouts, errors and rewards.

The token source here is `ScriptedActor`, which stands in for roles.Actor's generation interface and "generates"
a scripted text for each prompt: what is under test is the endpoint, not the model (tests/test_agent.py runs
the same code on the real actor and engines). A character tokenizer makes one token per character."""
from __future__ import annotations

import asyncio
import json
import string
from contextlib import contextmanager

import httpx
import openai
import psutil
import pytest
import torch

from hybridrl.config import EndpointConfig
from hybridrl.data.dataset import PromptRow
from hybridrl.data.loader import collate_prompts
from hybridrl.rollout.agent import AgentError, AgentRunner, AgentSettings
from hybridrl.rollout.agent_trace import RunTrace, TraceLimits
from hybridrl.rollout.base import GeneratedSequence, SamplingParams, assemble_batch
from hybridrl.rollout.endpoint import AgentEndpoint
from hybridrl.rollout.multiturn import ConversationFormat



def ascii_tokenizer():
    """One token per printable ASCII character (tool calls need braces, which the bundled tokenizer lacks), with
    the bundled tokenizer's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    from hybridrl.data.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(string.printable))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


TOKENIZER = ascii_tokenizer()
LIMITS = TraceLimits(max_requests=6, max_new_tokens=16, max_episode_tokens=200, max_model_len=400)


class ScriptedActor:
    """roles.Actor's generation interface with a scripted token source: for a prompt it generates the encoded
    `script(prompt text)` then EOS, cut at max_new_tokens or a stop token; log-prob of the k-th token -(k+1)/100."""

    def __init__(self, script, n: int = 1) -> None:
        self.script, self.n, self.calls = script, n, []

    def sampling_params(self, setting: dict) -> SamplingParams:
        greedy = bool(setting.get("greedy"))
        return SamplingParams(n=1 if greedy else self.n, greedy=greedy, max_new_tokens=LIMITS.max_new_tokens,
                              stop_token_ids=(TOKENIZER.eos_token_id,), seed=setting.get("seed", 0))

    @contextmanager
    def generation(self):
        yield {"transition": 0.0}

    def generate_turn(self, prompt_ids, params):
        self.calls.append(([list(p) for p in prompt_ids], params))
        rows = []
        for ids in prompt_ids:
            text = self.script(TOKENIZER.decode(ids, skip_special_tokens=True))
            tokens = (TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id])
            tokens = tokens[:params.max_new_tokens]
            for k, token in enumerate(tokens):
                if token in params.effective_stop_token_ids:
                    tokens = tokens[:k + 1]
                    break
            rows.append(GeneratedSequence(list(ids), tokens, [-(k + 1) / 100 for k in range(len(tokens))], "stop"
                                          if tokens[-1] in params.effective_stop_token_ids else "length"))
        return assemble_batch(rows, params, 0)


def f32(values: list[float]) -> list[float]:
    """The values as the rollout holds them (float32)."""
    return torch.tensor(values, dtype=torch.float32).tolist()


def encode(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def served():
    """An endpoint serving a ScriptedActor; open_run() registers a run and returns (trace, its base_url)."""
    actor = ScriptedActor(lambda prompt: "ok")
    endpoint = AgentEndpoint(EndpointConfig(max_request_bytes=4096, max_n=4), TOKENIZER, "tiny", LIMITS.max_model_len)
    endpoint.start()
    endpoint.backend = lambda ids, params: (actor.generate_turn(ids, params), 7)
    fmt = ConversationFormat(TOKENIZER, chat=True)

    def open_run(greedy: bool = False, limits: TraceLimits = LIMITS):
        trace = RunTrace(f"r{len(actor.calls)}x{id(object())}", fmt, limits)
        return trace, endpoint.open_run(trace, actor.sampling_params({}), greedy)

    endpoint.actor, endpoint.open_test_run = actor, open_run
    yield endpoint
    endpoint.close()


def _post(url: str, token: str | None, body, raw: bytes | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(url, headers=headers, content=raw if raw is not None else json.dumps(body).encode(),
                      timeout=30, trust_env=False)


def test_bad_requests_get_openai_error_bodies_and_the_server_goes_on(served):
    trace, base = served.open_test_run()
    chat = base + "/chat/completions"
    good = {"model": "m", "messages": [{"role": "user", "content": "vowels:"}]}
    cases = [  # (token, body or raw bytes, status, words in the message)
        (None, good, 401, "bearer token"), ("wrong", good, 401, "bearer token"),
        (served.token, b"{not json", 400, "not valid JSON"), (served.token, [1, 2], 400, "JSON object"),
        (served.token, {"model": "m"}, 400, "messages"),
        (served.token, {**good, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        (served.token, {**good, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
        (served.token, {**good, "n": 9}, 400, "n=9"), (served.token, {**good, "temperature": 3}, 400, "temperature"),
        (served.token, {**good, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
        (served.token, {**good, "top_logprobs": 3}, 400, "top_logprobs"),
        (served.token, {**good, "stop": [""]}, 400, "stop"),
        (served.token, {**good, "tools": [{"type": "function"}]}, 400, "tool"),
        (served.token, {**good, "messages": [{"role": "user", "content": "x" * 5000}]}, 413, "max_request_bytes"),
    ]
    for token, body, status, words in cases:
        raw = body if isinstance(body, bytes) else None
        response = _post(chat, token, body, raw)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert words in error["message"] and set(error) == {"message", "type", "param", "code"}, error
    assert _post(served.url + "/agent/nope/v1/chat/completions", served.token, good).status_code == 404
    port = int(served.url.rsplit(":", 1)[1])  # the default host: loopback only, never every interface
    listening = {c.laddr.ip for c in psutil.net_connections("inet") if c.laddr and c.laddr.port == port
                 and c.status == psutil.CONN_LISTEN}
    assert served.url.startswith("http://127.0.0.1:") and listening == {"127.0.0.1"}, listening
    assert _post(served.url + "/v1/nowhere", served.token, good).json()["error"]["message"]
    # a prompt longer than the context: 400 context_length_exceeded, nothing generated
    long = {**good, "messages": [{"role": "user", "content": "a" * 450}]}
    assert _post(chat, served.token, long).json()["error"]["code"] == "context_length_exceeded"
    assert trace.refused >= 1 and not trace.records
    # after all that, the same run is served, and the models route answers
    ok = _post(chat, served.token, good)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"
    client = openai.OpenAI(base_url=base, api_key=served.token, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(model="m", messages=good["messages"], presence_penalty=1.0)


def test_a_conversation_is_one_trajectory_of_the_served_tokens(served):
    """Three chat requests of one run (the assistant message echoed as the client's object, then as a dict):
    each prompt is the trajectory so far plus the new messages only; the mask covers the model's tokens."""
    served.actor.script = lambda prompt: "ae" if prompt.endswith("a:") else "zz"
    trace, base = served.open_test_run()
    client = openai.OpenAI(base_url=base, api_key=served.token, max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "vowels: qz"}]
    fmt = ConversationFormat(TOKENIZER, chat=True)
    expected_prompts = [fmt.prompt(messages)]
    for turn in range(3):
        response = client.chat.completions.create(model="m", messages=messages, logprobs=True,
                                                  extra_body={"return_token_ids": True})
        choice = response.choices[0]
        assert choice.message.content == "ae" and choice.finish_reason == "stop"
        assert response.model_extra["prompt_token_ids"] == expected_prompts[-1]
        assert choice.model_extra["token_ids"] == encode("ae") + [TOKENIZER.eos_token_id]
        assert [t.logprob for t in choice.logprobs.content] == f32([-0.01, -0.02, -0.03])
        assert response.model_extra["policy_version"] == 7 and response.usage.completion_tokens == 3
        messages.append(choice.message if turn == 0 else choice.message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"digits {turn}:"})
        served_ids = expected_prompts[-1] + choice.model_extra["token_ids"]
        expected_prompts.append(served_ids + fmt.continuation([messages[-1]], TOKENIZER.eos_token_id))
    assert [r.prompt_ids for r in trace.records] == expected_prompts[:3]
    assert [ids for ids, _ in served.actor.calls[-3:]] == [[p] for p in expected_prompts[:3]]  # the engine's input
    sequence, = trace.sequences()
    full = sequence.prompt + sequence.tokens
    assert sequence.prompt == expected_prompts[0] and full == expected_prompts[2] + encode("ae") + [2]
    model = [t for t, m in zip(sequence.tokens, sequence.model_mask) if m]
    assert model == (encode("ae") + [2]) * 3 and sum(sequence.model_mask) == 9
    assert [lp for lp, m in zip(sequence.log_probs, sequence.model_mask) if m] == f32([-0.01, -0.02, -0.03] * 3)
    assert all(lp == 0.0 for lp, m in zip(sequence.log_probs, sequence.model_mask) if not m)
    assert set(v for v, m in zip(sequence.versions, sequence.model_mask) if m) == {7}


def test_history_edits_and_branches_split_the_run(served):
    """A request that drops a turn starts a new trajectory whose prompt reuses the served tokens up to the last
    shared model turn (not re-tokenized) and is all context; n=2 gives a second trajectory."""
    served.actor.script = lambda prompt: "ae"
    trace, base = served.open_test_run()
    client = openai.OpenAI(base_url=base, api_key=served.token, max_retries=0)
    fmt = ConversationFormat(TOKENIZER, chat=True)
    messages = [{"role": "user", "content": "vowels:"}]
    first = client.chat.completions.create(model="m", messages=messages).choices[0].message
    second = client.chat.completions.create(model="m", messages=messages + [first, {"role": "user", "content": "1"}])
    edited = messages + [first, {"role": "user", "content": "2"}]  # turn 2 rewritten
    client.chat.completions.create(model="m", messages=edited, n=2)
    assert len(trace.trajectories) == 3 and [t.requests for t in trace.trajectories] == [2, 1, 1]
    first_end = len(fmt.prompt(messages)) + 3  # "ae" + EOS
    original, rewritten, sibling = trace.trajectories
    assert rewritten.prompt[:first_end] == original.full[:first_end]  # the served tokens, reused
    assert rewritten.prompt == original.full[:first_end] + fmt.continuation([edited[-1]], TOKENIZER.eos_token_id)
    assert sibling.prompt == rewritten.prompt and rewritten.model_mask == sibling.model_mask == [1, 1, 1]
    assert second.choices[0].message.content == "ae"
    # an unrelated conversation shares no model turn: encoded whole by the template
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "digits:"}])
    assert trace.trajectories[-1].prompt == fmt.prompt([{"role": "user", "content": "digits:"}])


def test_tool_calls_stop_strings_and_streaming(served):
    call = '<tool_call>{"name": "check", "arguments": {"text": "ae"}}</tool_call>'
    served.actor.script = lambda prompt: call if prompt.endswith("u:go\na:") else "done;tail"
    trace, base = served.open_test_run(limits=TraceLimits(6, 80, 400, 400))  # room for the call's text
    client = openai.OpenAI(base_url=base, api_key=served.token, max_retries=0)
    tools = [{"type": "function", "function": {"name": "check", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "go"}]
    response = client.chat.completions.create(model="m", messages=messages, tools=tools)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    tool_call, = choice.message.tool_calls
    assert tool_call.function.name == "check" and json.loads(tool_call.function.arguments) == {"text": "ae"}
    messages += [choice.message, {"role": "tool", "tool_call_id": tool_call.id, "content": "0.5"}]
    # a one-token stop string stops the engine; the served text ends before it, its token is kept
    done = client.chat.completions.create(model="m", messages=messages, tools=tools, stop=[";"])
    assert done.choices[0].message.content == "done" and done.choices[0].finish_reason == "stop"
    assert served.actor.calls[-1][1].stop_token_ids == tuple(sorted({2, encode(";")[0]}))
    sequence, = trace.sequences()  # the tool message extended the same trajectory
    assert [t for t, m in zip(sequence.tokens, sequence.model_mask) if m][-5:] == encode("done;")
    # a multi-token stop string: generated past it, cut at its end
    streamed = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stop="e;",
                                              stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "don"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop" and chunks[-1].usage
    assert trace.trajectories[-1].tokens == encode("done;")
    # a request's temperature and top_p reach the engine's sampling (rollout.endpoint.sampling=request); absent,
    # the rollout's own (here 1.0 / 1.0)
    other = openai.OpenAI(base_url=served.open_test_run()[1], api_key=served.token, max_retries=0)
    other.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}], temperature=0.3, top_p=0.25)
    asked = served.actor.calls[-1][1]
    other.chat.completions.create(model="m", messages=[{"role": "user", "content": "z"}])
    default = served.actor.calls[-1][1]
    assert (asked.temperature, asked.top_p, default.temperature, default.top_p) == (0.3, 0.25, 1.0, 1.0)
    # completions: token ids in, text out; a later prompt extending the text continues the trajectory
    served.actor.script = lambda prompt: "ou"
    completion = client.completions.create(model="m", prompt=[5, 6, 7], logprobs=0, max_tokens=2)
    assert completion.choices[0].text == "ou" and completion.choices[0].logprobs.token_logprobs == f32([-0.01, -0.02])
    first = client.completions.create(model="m", prompt="vowels:", max_tokens=3)
    client.completions.create(model="m", prompt="vowels:" + first.choices[0].text + " more:", max_tokens=3)
    text_trajectory = trace.trajectories[-1]
    assert text_trajectory.requests == 2 and text_trajectory.prompt == TOKENIZER("vowels:")["input_ids"]
    assert text_trajectory.tokens == encode("ou") + [2] + encode(" more:") + encode("ou") + [2]
    assert text_trajectory.model_mask == [1, 1, 1] + [0] * 6 + [1, 1, 1]


def _prompts(texts: list[str]):
    return collate_prompts([PromptRow(i, [1], text, {"row": i}) for i, text in enumerate(texts)], 0)


def _runner(agent: str, concurrency: int = 64, timeout_s: float = 30.0, failure_reward=None, scored=False):
    settings = AgentSettings(concurrency, timeout_s, failure_reward, EndpointConfig(batch_window_ms=200),
                             scored_elsewhere=scored)
    return AgentRunner(agent, settings, TOKENIZER, True, LIMITS, "tiny")


async def one_request_agent(client, row):
    response = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}],
                                                    temperature=row.get("temperature"))
    return float(len(response.choices[0].message.content))


async def misbehaving_agent(client, row):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
    if row["prompt"] == "raise":
        raise RuntimeError("the agent broke")
    if row["prompt"] == "hang":
        await asyncio.sleep(60)
    return {"reward": 1.0, "tools_used": 2}


IN_FLIGHT = {"now": 0, "peak": 0}


async def counted_agent(client, row):
    """Counts the runs in flight at once (the runner's slots bound them)."""
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["peak"] = max(IN_FLIGHT["peak"], IN_FLIGHT["now"])
    try:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
        await asyncio.sleep(0.05)  # its tools: the other runs get their turn
        return 1.0
    finally:
        IN_FLIGHT["now"] -= 1


async def rewardless_agent(client, row):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])


def test_concurrent_agents_are_batched_into_few_generate_calls():
    actor = ScriptedActor(lambda prompt: "ae", n=2)
    runner = _runner("test_agent_endpoint:one_request_agent")
    try:
        out, = runner.run(actor, _prompts([f"vowels: {'q' * i}" for i in range(1, 17)]), [{"seed": 3}], version=4)
        assert len(out) == 32 and list(out.sequences.non_tensors["group_index"]) == [g for g in range(16)
                                                                                     for _ in range(2)]
        sizes = [len(ids) for ids, _ in actor.calls]
        assert sum(sizes) == 32 and len(sizes) <= 3, sizes  # 32 concurrent agents: batched, not one by one
        assert out.sequences["policy_versions"][out.sequences["response_mask"].bool()].unique().tolist() == [4]
        assert out.sequences.non_tensors["episode_rewards"].astype(float).tolist() == [2.0] * 32
        # requests that sample differently go into separate calls
        actor.calls.clear()
        hot = collate_prompts([PromptRow(i, [1], "vowels:", {"temperature": 0.5 + (i % 2) / 2}) for i in range(8)], 0)
        runner.run(actor, hot, [{"seed": 4}])
        temperatures = sorted({params.temperature for _, params in actor.calls})
        assert temperatures == [0.5, 1.0] and sum(len(ids) for ids, _ in actor.calls) == 16
        # a prompt near the end of the context gets a shorter allowance and a call of its own: every row of a
        # call fits the context with the call's token allowance (the engine would refuse the call otherwise)
        actor.calls.clear()
        long = "a" * (LIMITS.max_model_len - 20)
        room = LIMITS.max_model_len - len(ConversationFormat(TOKENIZER, chat=True).first(long))
        runner.run(actor, _prompts(["vowels:", long, "digits:"]), [{"seed": 5}])
        assert room < LIMITS.max_new_tokens
        assert sorted(params.max_new_tokens for _, params in actor.calls) == [room, LIMITS.max_new_tokens]
        assert all(len(ids) + params.max_new_tokens <= LIMITS.max_model_len for rows, params in actor.calls
                   for ids in rows)
    finally:
        runner.close()


def test_agent_concurrency_bounds_the_runs_in_flight():
    """rollout.agent_concurrency=3: 8 runs, never more than 3 at once (and 3 do run together)."""
    runner = _runner("test_agent_endpoint:counted_agent", concurrency=3)
    try:
        out, = runner.run(ScriptedActor(lambda prompt: "ae", n=1), _prompts([f"vowels: {i}" for i in range(8)]),
                          [{"seed": 1}])
    finally:
        runner.close()
    assert len(out) == 8 and IN_FLIGHT == {"now": 0, "peak": 3}


def test_timeouts_errors_and_rewards_of_agent_runs():
    from hybridrl.protocol import Batch

    Batch({"x": torch.zeros(1)})  # tensordict loads on first use (seconds on a busy machine), not in a 1 s run
    actor = ScriptedActor(lambda prompt: "ae", n=1)
    prompts = _prompts(["ok", "raise", "hang", "ok"])
    runner = _runner("test_agent_endpoint:misbehaving_agent", timeout_s=1.0)
    try:
        out, = runner.run(actor, prompts, [{"seed": 1}])
        assert list(out.sequences.non_tensors["group_index"]) == [0, 3]  # the failed runs dropped
        metrics = out.sequences.meta["agent"]
        assert metrics["errors"] == 1 and metrics["timeouts"] == 1 and metrics["tools_used"] == 2.0
        assert metrics["requests_mean"] == 1.0
        with pytest.raises(AgentError, match="no agent run of the batch.*the agent broke"):
            runner.run(actor, _prompts(["raise", "raise"]), [{"seed": 1}])
    finally:
        runner.close()
    runner = _runner("test_agent_endpoint:misbehaving_agent", timeout_s=1.0, failure_reward=-1.0)
    try:
        out, = runner.run(actor, prompts, [{"seed": 1}])  # kept, scored with rollout.agent_failure_reward
        assert out.sequences.non_tensors["episode_rewards"].astype(float).tolist() == [1.0, -1.0, -1.0, 1.0]
    finally:
        runner.close()
    runner = _runner("test_agent_endpoint:rewardless_agent")
    try:
        with pytest.raises(AgentError, match="returned no reward.*reward.fn"):
            runner.run(actor, _prompts(["ok"]), [{"seed": 1}])
    finally:
        runner.close()
    scored = _runner("test_agent_endpoint:rewardless_agent", scored=True)  # reward.fn scores: 0 from the agent
    try:
        out, = scored.run(actor, _prompts(["ok"]), [{"seed": 1}, {"greedy": True, "seed": 1}])[:1]
        assert out.sequences.non_tensors["episode_rewards"].tolist() == [0.0] and out.texts == ["ae"]
        assert actor.calls[-1][1].greedy != actor.calls[-2][1].greedy  # the greedy setting's runs sample greedily
    finally:
        scored.close()


def test_group_index_and_baseline_of_agent_rows():
    """Rows without their own groups: n per prompt and the greedy row's score repeated, exactly as before; agent
    rows (runs split or dropped): their own groups, the baseline the mean of the greedy rows of the group."""
    from hybridrl.algorithms.advantages import grpo_outcome
    from hybridrl.protocol import Batch
    from hybridrl.rollout.types import group_baseline, group_index

    plain = Batch({"x": torch.zeros(6)})
    assert group_index(plain, 3, 2).tolist() == [0, 0, 1, 1, 2, 2]
    greedy_scores = torch.tensor([0.1, 0.7, 0.3])
    assert torch.equal(group_baseline(greedy_scores, Batch({"x": torch.zeros(3)}), plain, 3, 2),
                       greedy_scores.repeat_interleave(2))
    agent_rows = Batch({"x": torch.zeros(5)}, {"group_index": [0, 0, 0, 2, 2]})  # group 1's runs were dropped
    greedy_rows = Batch({"x": torch.zeros(4)}, {"group_index": [0, 1, 2, 2]})  # group 2's greedy run split in two
    baseline = group_baseline(torch.tensor([0.5, 0.9, 0.2, 0.4]), greedy_rows, agent_rows, 3, 2)
    assert baseline.tolist() == pytest.approx([0.5, 0.5, 0.5, 0.3, 0.3])
    scores, mask = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.4]), torch.ones(5, 3)
    advantages, _ = grpo_outcome(scores, mask, group_index(agent_rows, 3, 2), norm_by_std=False)
    assert advantages[:, 0].tolist() == pytest.approx([0.5, -0.5, 0.0, -0.1, 0.1])
