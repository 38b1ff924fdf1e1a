"""The OpenAI wire format of the agent endpoint (rollout/endpoint.py): request bodies checked and parsed into typed
requests, responses, stream events and error bodies built. Pure functions: no server, no engine.

Served: `POST /v1/chat/completions` (messages with text content, tools / tool_calls, n, temperature, top_p,
max_tokens / max_completion_tokens, stop, logprobs, stream) and `POST /v1/completions` (a prompt as text or
token ids, or a list of them; the same sampling fields; logprobs 0). vLLM's extensions `top_k`, `ignore_eos`,
`stop_token_ids` and `return_token_ids` are read too. Fields that would change the sampled distribution in a
way the engines cannot (penalties, logit_bias, top log-probs, JSON mode) are refused with a 400 naming the
field; other unknown fields (user, seed, metadata, ...) are ignored, as OpenAI-compatible servers do.

The model's text becomes `tool_calls` where the request offered tools: every `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` block (envs/tools.py's parser, the syntax Qwen/Hermes templates teach) is one
call; a block that does not parse leaves the whole text as the message content.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridrl.envs.tools import CALL, ToolCall, parse_tool_calls

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields whose only served value is the neutral one: (field, accepted values, why)
NEUTRAL = (("frequency_penalty", (None, 0, 0.0), "penalties"), ("presence_penalty", (None, 0, 0.0), "penalties"),
           ("repetition_penalty", (None, 1, 1.0), "penalties"), ("logit_bias", (None, {}), "logit_bias"),
           ("echo", (None, False), "echo"), ("suffix", (None, ""), "suffix"),
           ("top_logprobs", (None, 0), "top log-probs"),
           ("functions", (None, []), "legacy functions (use tools)"), ("min_p", (None, 0, 0.0), "min_p"))


class WireError(Exception):
    """A request the endpoint refuses: the HTTP status and OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.kind, self.param, self.code = message, status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Sampling:
    """What a request asks of the sampler (None: the run's default)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class WireRequest:
    """What chat and completion requests share."""
    n: int
    sampling: Sampling
    logprobs: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str


@dataclass(frozen=True)
class ChatRequest(WireRequest):
    messages: list[dict] = field(default_factory=list)  # normalised (normalise_message)
    tools: list[dict] | None = None
    tool_choice: Any = "auto"

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(frozen=True)
class CompletionRequest(WireRequest):
    prompts: list[str | list[int]] = field(default_factory=list)


@dataclass
class ServedChoice:
    """One generated choice as the endpoint serves it."""
    token_ids: list[int]
    log_probs: list[float]
    text: str  # decoded, special tokens and a matched stop string removed
    finish_reason: str  # stop | length | tool_calls
    tool_calls: list[dict] = field(default_factory=list)  # wire format, with ids
    content: str | None = None  # chat: the text outside tool calls (None: nothing)
    token_texts: list[str] = field(default_factory=list)


# ---- request parsing --------------------------------------------------------------------------------------
def _number(body: dict, key: str, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise WireError(f"{key} must be {'an integer' if integer else 'a number'}, got {value!r:.40}", param=key)
    if not low <= value <= high:
        raise WireError(f"{key}={value} must be in [{low}, {high}]", param=key)
    return value


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise WireError(f"{key} must be true or false, got {value!r:.40}", param=key)
    return value


def _check_neutral(body: dict) -> None:
    for key, accepted, what in NEUTRAL:
        if key in body and body[key] not in accepted:
            raise WireError(f"{key}={body[key]!r:.60} is not served: the rollout engines sample without {what}; "
                            f"leave it out", param=key)
    form = body.get("response_format")
    if form is not None and not (isinstance(form, dict) and form.get("type") == "text"):
        raise WireError("response_format other than text (JSON mode) is not served; leave it out",
                        param="response_format")


def _sampling(body: dict, max_n: int) -> tuple[int, Sampling]:
    _check_neutral(body)
    n = _number(body, "n", 1, max_n, integer=True) or 1
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number({key: max_tokens}, key, 1, 1 << 30, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise WireError("stop must be a non-empty string or a list of up to 4 of them", param="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and t >= 0 for t in stop_ids):
        raise WireError("stop_token_ids must be a list of token ids", param="stop_token_ids")
    top_k = _number(body, "top_k", -1, 1 << 30, integer=True)
    sampling = Sampling(temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 1e-9, 1.0),
                        top_k=top_k, max_tokens=max_tokens, stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                        ignore_eos=_flag(body, "ignore_eos"))
    return n, sampling


def _common(body: Any) -> tuple[str, bool, bool, bool]:
    if not isinstance(body, dict):
        raise WireError("the request body must be a JSON object")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise WireError("model must be a string", param="model")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise WireError("stream_options must be an object", param="stream_options")
    return model, _flag(body, "stream"), bool(options.get("include_usage")), _flag(body, "return_token_ids")


def _text_content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise WireError(f"{where}: only text content parts are served", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise WireError(f"{where}: content must be a string, a list of text parts or null", param="messages")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise WireError(f"{where}: tool_calls must be a list", param="messages")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise WireError(f"{where}: a tool call is {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                            param="messages")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as the text it is
        out.append({"id": call.get("id"), "name": function["name"], "arguments": arguments})
    return out


def normalise_message(message: Any, index: int = 0) -> dict:
    """A chat message as the endpoint keeps it: role (developer -> system), text content, tool calls with
    parsed arguments; tool_call_id and name when given."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise WireError(f"{where} must be an object", param="messages")
    role = message.get("role")
    if role not in ROLES:
        raise WireError(f"{where}: role {role!r:.30} is not one of {list(ROLES)}", param="messages")
    content = _text_content(message.get("content"), where)
    calls = _tool_calls(message.get("tool_calls"), where) if role == "assistant" else []
    if content is None and not calls:
        if role != "assistant":
            raise WireError(f"{where}: a {role} message needs content", param="messages")
        content = ""
    out = {"role": "system" if role == "developer" else role, "content": content or "", "tool_calls": calls}
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def message_key(message: dict) -> tuple:
    """What makes two normalised messages the same message (tool call ids excluded: an agent may rename them)."""
    calls = tuple((c["name"], json.dumps(c["arguments"], sort_keys=True)) for c in message["tool_calls"])
    return message["role"], message["content"], calls, message.get("tool_call_id"), message.get("name")


def template_message(message: dict) -> dict:
    """A normalised message as chat templates take it (tool call arguments as objects)."""
    out: dict[str, Any] = {"role": message["role"], "content": message["content"]}
    if message["tool_calls"]:
        out["tool_calls"] = [{"type": "function", "id": c["id"],
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in message["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if key in message:
            out[key] = message[key]
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise WireError("tools must be a list", param="tools")
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str)):
            raise WireError("a tool is {'type': 'function', 'function': {'name', 'description', 'parameters'}}",
                            param="tools")
    return tools


def parse_chat(body: Any, max_n: int) -> ChatRequest:
    model, stream, usage, token_ids = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise WireError("messages must be a non-empty list", param="messages")
    n, sampling = _sampling(body, max_n)
    logprobs = _flag(body, "logprobs")
    return ChatRequest(n, sampling, logprobs, stream, usage, token_ids, model,
                       messages=[normalise_message(m, i) for i, m in enumerate(messages)], tools=_tools(body),
                       tool_choice=body.get("tool_choice", "auto"))


def parse_completion(body: Any, max_n: int) -> CompletionRequest:
    model, stream, usage, token_ids = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)) for p in prompt):
        prompts = list(prompt)
    else:
        raise WireError("prompt must be a string, a list of token ids, or a non-empty list of either", param="prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise WireError("an empty prompt: every prompt needs at least one character", param="prompt")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise WireError("best_of other than n is not served", param="best_of")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) or isinstance(logprobs, bool):
        raise WireError("logprobs: only 0 is served (the sampled tokens' log-probs; the engines keep no top "
                        "log-probs)", param="logprobs")
    n, sampling = _sampling({k: v for k, v in body.items() if k != "logprobs"}, max_n)
    return CompletionRequest(n, sampling, logprobs == 0, stream, usage, token_ids, model, prompts=prompts)


# ---- what the model said ------------------------------------------------------------------------------------
def truncate_at_stop(tokens: list[int], decode: Callable[[list[int]], str], stops: tuple[str, ...]
                     ) -> tuple[int, str | None]:
    """(tokens to keep, the stop string met first or None): the shortest prefix whose text holds a stop string
    (its tokens are kept: the engine produced them; the served text ends before the string)."""
    if not stops or not any(stop in decode(tokens) for stop in stops):
        return len(tokens), None
    low, high = 1, len(tokens)
    while low < high:  # "a stop string is in the text of tokens[:k]" is monotone in k
        middle = (low + high) // 2
        if any(stop in decode(tokens[:middle]) for stop in stops):
            high = middle
        else:
            low = middle + 1
    text = decode(tokens[:low])
    first = min((text.index(stop), stop) for stop in stops if stop in text)
    return low, first[1]


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls in wire format) of a model turn; no calls when any block does not parse."""
    calls = parse_tool_calls(text)
    if not calls or not all(isinstance(c, ToolCall) for c in calls):
        return text, []
    content = CALL.sub("", text).strip() or None
    return content, [{"id": f"call_{secrets.token_hex(8)}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def served_message(choice: ServedChoice) -> dict:
    """The assistant message a choice serves, normalised like an incoming one (what the agent sends back)."""
    return normalise_message({"role": "assistant", "content": choice.content, "tool_calls": choice.tool_calls})


# ---- responses ---------------------------------------------------------------------------------------------
def _usage(prompt_tokens: int, choices: list[ServedChoice]) -> dict:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _chat_logprobs(choice: ServedChoice) -> dict:
    return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                        for text, lp in zip(choice.token_texts, choice.log_probs)], "refusal": None}


def chat_response(request: ChatRequest, rid: str, created: int, choices: list[ServedChoice], prompt_ids: list[int],
                  extra: dict) -> dict:
    out = []
    for i, c in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        item = {"index": i, "message": message, "finish_reason": c.finish_reason,
                "logprobs": _chat_logprobs(c) if request.logprobs else None}
        if request.return_token_ids:
            item["token_ids"] = c.token_ids
        out.append(item)
    body = {"id": rid, "object": "chat.completion", "created": created, "model": request.model, "choices": out,
            "usage": _usage(len(prompt_ids), choices), **extra}
    if request.return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def completion_response(request: CompletionRequest, rid: str, created: int, choices: list[ServedChoice],
                        prompt_tokens: int, extra: dict) -> dict:
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if request.logprobs:
            offsets, at = [], 0
            for text in c.token_texts:
                offsets.append(at)
                at += len(text)
            logprobs = {"tokens": c.token_texts, "token_logprobs": c.log_probs, "top_logprobs": None,
                        "text_offset": offsets}
        item = {"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": logprobs}
        if request.return_token_ids:
            item["token_ids"] = c.token_ids
        out.append(item)
    return {"id": rid, "object": "text_completion", "created": created, "model": request.model, "choices": out,
            "usage": _usage(prompt_tokens, choices), **extra}


def stream_events(body: dict, chat: bool, include_usage: bool) -> list[bytes]:
    """A finished response as server-sent events (one chunk with each choice's whole text, one with the finish
    reasons, usage when asked, [DONE]): the wire format of `stream=true`, sent once generation is done."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {k: body[k] for k in ("id", "created", "model")}
    first, last = [], []
    for c in body["choices"]:
        if chat:
            delta = {"role": "assistant", "content": c["message"]["content"]}
            if "tool_calls" in c["message"]:
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(c["message"]["tool_calls"])]
            first.append({"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": None})
            last.append({"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]})
        else:
            first.append({"index": c["index"], "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None})
            last.append({"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]})
    chunks = [{**head, "object": kind, "choices": first}, {**head, "object": kind, "choices": last}]
    if include_usage:
        chunks.append({**head, "object": kind, "choices": [], "usage": body["usage"]})
    return [f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks] + [b"data: [DONE]\n\n"]


def models_response(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "hybridrl"}]}
