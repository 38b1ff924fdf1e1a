"""Tools a model can call: JSON-schema specs, the `<tool_call>` parser, and calls that never crash a rollout.

The call syntax is the one Qwen's chat template teaches (and Hermes-style templates share):

    <tool_call>
    {"name": "python", "arguments": {"code": "print(2 ** 10)"}}
    </tool_call>

`ToolRegistry.respond(text)` finds every call in a model turn, runs each, and returns one observation per call:
the tool's output, or an `error: ...` line for unparsable JSON, an unknown tool, missing / unexpected /
mistyped arguments, or an exception inside the tool. The model sees its mistake; the rollout goes on.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

from hybridrl.envs.sandbox import Sandbox, run_python

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCallError:
    message: str  # why the text between the tags is not a call


@dataclass
class Tool:
    """A function the model may call: `fn(**arguments) -> str`, described by a JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict  # {"type": "object", "properties": {...}, "required": [...]}
    fn: Callable[..., str]
    runs_code: bool = False  # executes model-written code: the run checks that a sandbox can start (plan)

    def spec(self) -> dict:
        """The OpenAI-style function spec chat templates render into the system prompt."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def check_arguments(self, arguments: dict) -> str | None:
        """Why `arguments` do not fit the schema (None: they do)."""
        properties = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"missing argument(s) {missing}"
        unexpected = [k for k in arguments if k not in properties]
        if unexpected:
            return f"unexpected argument(s) {unexpected}; {self.name} takes {sorted(properties)}"
        for key, value in arguments.items():
            wanted = _JSON_TYPES.get(properties[key].get("type"))
            if wanted is not None and (not isinstance(value, wanted) or
                                       (isinstance(value, bool) and properties[key].get("type") != "boolean")):
                return f"argument {key!r} must be a {properties[key]['type']}, got {type(value).__name__}"
        return None


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every `<tool_call>...</tool_call>` in `text`, in order, as a call or the reason it is not one."""
    calls: list[ToolCall | ToolCallError] = []
    for body in CALL.findall(text):
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCallError(f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            calls.append(ToolCallError('a tool call is {"name": ..., "arguments": {...}}'))
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some templates send the arguments JSON-encoded
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCallError(f"the arguments of {payload['name']!r} must be a JSON object"))
            continue
        calls.append(ToolCall(payload["name"], arguments))
    return calls


@dataclass
class ToolRegistry:
    tools: dict[str, Tool] = field(default_factory=dict)

    def register(self, tool: Tool) -> Tool:
        if tool.name in self.tools:
            raise ValueError(f"a tool named {tool.name!r} is registered already")
        self.tools[tool.name] = tool
        return tool

    def specs(self) -> list[dict]:
        return [tool.spec() for tool in self.tools.values()]

    def call(self, call: ToolCall | ToolCallError) -> tuple[str, bool]:
        """(observation, ok) for one parsed call; never raises for the model's mistakes or the tool's."""
        if isinstance(call, ToolCallError):
            return f"error: {call.message}", False
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; available: {sorted(self.tools)}", False
        problem = tool.check_arguments(call.arguments)
        if problem is not None:
            return f"error: {call.name}: {problem}", False
        try:
            return str(tool.fn(**call.arguments)), True
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation, not a crash
            return f"error: {call.name} raised {type(exc).__name__}: {exc}", False

    def respond(self, text: str) -> list[tuple[str, bool]]:
        """(observation, ok) for every call in a model turn (empty: the turn made no call)."""
        return [self.call(call) for call in parse_tool_calls(text)]

    def runs_code(self) -> bool:
        """Whether any tool executes model-written code (and so needs a sandbox)."""
        return any(tool.runs_code for tool in self.tools.values())


def python_tool(timeout_s: float = 5.0, memory_mb: int = 512, sandbox: Sandbox | str | None = None) -> Tool:
    """Run Python code in a sandbox (hybridrl/envs/sandbox.py; None: the run's rollout.tool_sandbox, else the
    strongest available) and return what it printed."""
    return Tool(
        name="python",
        description="Run Python 3 code and return its standard output (print the values you need). No network, "
                    f"{timeout_s:g} s and {memory_mb} MiB at most; files only in the working folder.",
        parameters={"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                    "required": ["code"]},
        fn=lambda code: run_python(code, sandbox=sandbox, timeout_s=timeout_s, memory_mb=memory_mb).observation(),
        runs_code=True)
