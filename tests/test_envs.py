"""Environments, tool calls and the Python sandbox (hybridrl/envs): what the model sees for every kind of call,
and every limit of the sandbox enforced with a clear observation."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from hybridrl.envs import (Environment, StepResult, Tool, ToolCall, ToolCallError, ToolRegistry, env_class, make_env,
                           parse_tool_calls, python_tool, register_env, run_python)


# ---- the in-process guard (rollout.tool_sandbox=guard; bubblewrap, the default, is tests/test_sandbox.py) --------
def _scratch_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("hybridrl-tool-*")}


def test_guard_returns_stdout_and_keeps_files_in_its_scratch_dir():
    before = _scratch_dirs()
    result = run_python("open('notes.txt', 'w').write('kept here')\nprint(open('notes.txt').read(), 2 ** 10)",
                        sandbox="guard", timeout_s=60)
    assert result.ok and result.observation() == "kept here 1024\n"
    assert _scratch_dirs() == before  # the scratch dir is removed


@pytest.mark.parametrize("code, expected", [
    ("while True:\n    pass", "error: time limit exceeded"),
    ("import os\nwhile True:\n    os.fork()", "error: RuntimeError: sandbox: starting or signalling processes is not allowed"),
    ("import subprocess\nsubprocess.run(['true'])", "error: RuntimeError: sandbox: starting or signalling processes"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "error: RuntimeError: sandbox: network access is not allowed"),
    ("x = bytearray(4 << 30)", "error: MemoryError"),
    ("import ctypes", "error: RuntimeError: sandbox: importing ctypes is not allowed"),
    ("import os\nos.remove('/etc/hostname')", "error: PermissionError: sandbox: changing files outside the scratch"),
    ("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", "error: PermissionError: sandbox: reading other processes"),
])
def test_guard_stops_misbehaviour_with_a_clear_observation(code, expected):
    # a generous limit except for the runaway loop: a loaded CI machine starts Python slowly
    result = run_python(code, sandbox="guard", timeout_s=3 if "while True" in code and "fork" not in code else 60)
    assert not result.ok
    assert result.observation().startswith(expected), result.observation()


def test_guard_refuses_writes_outside_its_scratch_dir(tmp_path):
    target = tmp_path / "escape.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", sandbox="guard", timeout_s=60)
    assert result.observation().startswith("error: PermissionError: sandbox: writing outside the scratch directory")
    assert not target.exists()
    fd_escape = run_python(f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)", sandbox="guard",
                           timeout_s=60)
    assert "writing outside the scratch directory" in fd_escape.observation() and not target.exists()


def test_guard_child_sees_no_parent_environment():
    os.environ["HYBRIDRL_SECRET_FOR_TEST"] = "leaked"
    try:
        result = run_python("import os\nprint(os.environ.get('HYBRIDRL_SECRET_FOR_TEST'))", sandbox="guard",
                            timeout_s=60)
    finally:
        del os.environ["HYBRIDRL_SECRET_FOR_TEST"]
    assert result.observation() == "None\n"


# ---- tool calls ----------------------------------------------------------------------------------------------
def test_parse_tool_calls():
    text = ('I will compute. <tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call> and '
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": </tool_call><tool_call>[1, 2]</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1]}</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("python", {"code": "print(1)"})
    assert calls[1] == ToolCall("add", {"a": 1, "b": 2})  # JSON-encoded arguments are decoded
    assert isinstance(calls[2], ToolCallError) and "not valid JSON" in calls[2].message
    assert isinstance(calls[3], ToolCallError) and '{"name": ..., "arguments": {...}}' in calls[3].message
    assert isinstance(calls[4], ToolCallError) and "must be a JSON object" in calls[4].message
    assert parse_tool_calls("no call here") == []


def _registry() -> ToolRegistry:
    tools = ToolRegistry()
    tools.register(python_tool(timeout_s=60))
    tools.register(Tool("add", "add two integers", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                      "b": {"type": "integer"}},
                                                   "required": ["a", "b"]}, lambda a, b: str(a + b)))
    tools.register(Tool("div", "divide", {"type": "object", "properties": {"a": {"type": "number"},
                                                                            "b": {"type": "number"}}},
                        lambda a, b: str(a / b)))
    return tools


@pytest.mark.parametrize("call, observation, ok", [
    ('{"name": "add", "arguments": {"a": 2, "b": 3}}', "5", True),
    ('{"name": "python", "arguments": {"code": "print(6 * 7)"}}', "42\n", True),
    ('{"name": "mul", "arguments": {}}', "error: unknown tool 'mul'; available: ['add', 'div', 'python']", False),
    ('{"name": "add", "arguments": {"a": 2}}', "error: add: missing argument(s) ['b']", False),
    ('{"name": "add", "arguments": {"a": 2, "b": 3, "c": 4}}', "error: add: unexpected argument(s) ['c']; add takes "
                                                             "['a', 'b']", False),
    ('{"name": "add", "arguments": {"a": "2", "b": 3}}', "error: add: argument 'a' must be a integer, got str", False),
    ('{"name": "add", "arguments": {"a": true, "b": 3}}', "error: add: argument 'a' must be a integer, got bool", False),
    ('{"name": "div", "arguments": {"a": 1, "b": 0}}', "error: div raised ZeroDivisionError: division by zero", False),
    ('{"name": "add", "arguments": {"a": 2, "b": ', "error: the tool call is not valid JSON", False),
])
def test_every_bad_call_is_an_observation_never_a_crash(call, observation, ok):
    [(text, was_ok)] = _registry().respond(f"<tool_call>{call}</tool_call>")
    assert was_ok is ok and text.startswith(observation), text


def test_registry_refuses_duplicates_and_renders_specs():
    tools = _registry()
    with pytest.raises(ValueError, match="registered already"):
        tools.register(python_tool())
    assert [s["function"]["name"] for s in tools.specs()] == ["python", "add", "div"]
    assert tools.specs()[1]["function"]["parameters"]["required"] == ["a", "b"]


# ---- environments --------------------------------------------------------------------------------------------
def test_charset_turns_episode():
    env = make_env("charset_turns", turns=3)
    assert env.reset({"prompt": "digits: qzk"}) == "digits:"
    first = env.step("1234")
    assert first == StepResult("vowels:", pytest.approx(1 / 3), False)
    second = env.step("zzzz")
    assert second.observation == "digits:" and second.reward == 0.0 and not second.done
    last = env.step("12ab")
    assert last.done and last.observation == "" and last.reward == pytest.approx(0.5 / 3)
    assert make_env("charset_turns").reset({"prompt": "x", "turn_sets": ["vowels", "vowels"]}) == "vowels:"
    same = make_env("charset_turns", turns=2, alternate=False)
    assert same.reset({"prompt": "digits: qzk"}) == "digits:" and same.step("7").observation == "digits:"


def test_tool_answer_episode_counts_calls_and_errors():
    tools = ToolRegistry()
    tools.register(python_tool(timeout_s=60))
    env = make_env("tool_answer", tools=tools)
    assert [spec["function"]["name"] for spec in env.tool_specs()] == ["python"]  # for the chat template's tools=
    assert env.reset({"prompt": "What is 2**20?", "answer": 1048576}) == "What is 2**20?"
    step = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(2**20)"}}</tool_call>'
                    '<tool_call>{"name": "calc", "arguments": {}}</tool_call>')
    assert not step.done and step.reward == 0.0 and step.info == {"tool_calls": 2, "tool_errors": 1}
    assert step.observation.startswith("<tool_response>\n1048576\n</tool_response>\n<tool_response>\nerror: "
                                       "unknown tool 'calc'")
    final = env.step("The answer is 1048576.")
    assert final.done and final.reward == 1.0
    with pytest.raises(ValueError, match="'answer' column"):
        env.reset({"prompt": "no answer"})


class CountingEnv(Environment):  # found by dotted path, not registered
    def reset(self, row):
        return "go"

    def step(self, action):
        return StepResult("", float(len(action)), True)


def test_env_lookup_by_name_and_dotted_path_with_clear_errors():
    assert env_class("test_envs:CountingEnv") is CountingEnv
    assert env_class("test_envs.CountingEnv") is CountingEnv
    with pytest.raises(ValueError, match="not a registered environment"):
        env_class("nope")
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg'"):
        env_class("no_such_pkg:Env")
    with pytest.raises(ValueError, match="is not an Environment subclass"):
        env_class("test_envs:pytest")
    with pytest.raises(TypeError, match="not an Environment subclass"):
        register_env("bad")(dict)
    with pytest.raises(ValueError, match="registered already"):
        register_env("charset_turns")(CountingEnv)
