"""The environments hybridrl ships: a multi-turn task the tiny CPU model can learn, and tool-using answers.

- "charset_turns": every turn the environment names a character set ("vowels:" or "digits:", fixed per
  episode by the row's `turn_sets` column, else starting from the set the row's prompt names and then
  alternating, or the same set every turn with alternate=False) and scores the model's turn with the bundled
  `charset_reward`; the episode reward is the mean over `turns` turns, so a policy must follow the
  instruction turn after turn.
- "tool_answer": a question row with an `answer` column; the model may call tools (the sandboxed Python
  tool by default) in `<tool_call>` blocks; a turn without a call is its final answer, rewarded 1 when
  it contains the expected answer. Tool calls and tool errors are counted in `info`.
"""
from __future__ import annotations

from typing import Any

from hybridrl.data.tasks import charset_reward
from hybridrl.envs.base import Environment, StepResult, register_env
from hybridrl.envs.tools import ToolRegistry, python_tool


@register_env("charset_turns")
class CharsetTurnsEnv(Environment):
    def __init__(self, turns: int = 2, alternate: bool = True) -> None:
        if turns < 1:
            raise ValueError(f"charset_turns: turns={turns} must be >= 1")
        self.turns, self.alternate = turns, alternate

    def reset(self, row: dict[str, Any]) -> str:
        sets = row.get("turn_sets")
        if sets is None:  # alternate, starting from the set the prompt names
            first = "digits" if str(row.get("prompt", "")).startswith("digits") else "vowels"
            other = ("vowels" if first == "digits" else "digits") if self.alternate else first
            sets = [first if i % 2 == 0 else other for i in range(self.turns)]
        self.sets, self.turn = list(sets)[:self.turns], 0
        return f"{self.sets[0]}:"

    def step(self, action: str) -> StepResult:
        reward = charset_reward(f"{self.sets[self.turn]}:", action) / self.turns
        self.turn += 1
        done = self.turn >= self.turns
        return StepResult("" if done else f"{self.sets[self.turn]}:", reward, done)


@register_env("tool_answer")
class ToolAnswerEnv(Environment):
    def __init__(self, tools: ToolRegistry | None = None) -> None:
        if tools is None:
            tools = ToolRegistry()
            tools.register(python_tool())
        self.tools = tools

    def tool_specs(self) -> list[dict]:
        return self.tools.specs()

    def reset(self, row: dict[str, Any]) -> str:
        if "answer" not in row:
            raise ValueError("tool_answer: the prompt rows need an 'answer' column")
        self.answer = str(row["answer"]).strip()
        return str(row["prompt"])

    def step(self, action: str) -> StepResult:
        results = self.tools.respond(action)
        if not results:  # no call: this is the final answer
            return StepResult("", float(self.answer in action), True)
        observation = "\n".join(f"<tool_response>\n{text.strip()}\n</tool_response>" for text, _ in results)
        return StepResult(observation, 0.0, False,
                          {"tool_calls": len(results), "tool_errors": sum(not ok for _, ok in results)})
