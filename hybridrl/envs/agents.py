"""Agent programs hybridrl ships (rollout.agent): plain async functions written against the official `openai`
client, as an agent moved from another framework would be. The trainer hands each one an `openai.AsyncOpenAI`
client pointed at the policy and one data row; nothing here imports hybridrl's training code.

- "charset_agent" (configs/grpo_agent_tiny.yaml): the bundled character-set task as a two-request agent. It
  asks the model for a draft, runs a checker tool on the draft itself (the share of characters in the set the
  prompt names), shows the model the result and asks again; the reward is the mean of both answers' charset
  scores. Where the model itself calls the checker (a `<tool_call>`, which the tiny model never learns to
  write), the agent runs that call and answers it as a tool message.
"""
from __future__ import annotations

import json
from typing import Any

from hybridrl.data.tasks import charset_reward

CHECK_TOOL = {"type": "function", "function": {
    "name": "check", "description": "The share of the text's characters that are in the character set asked for.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


def check(prompt: str, text: str) -> str:
    """The checker tool: e.g. "check 0.5" (characters only from the tiny tokenizer's alphabet)."""
    return f"check {charset_reward(prompt, text):.1f}"


async def charset_agent(client: Any, row: dict) -> dict:
    prompt = row["prompt"]
    target = prompt.split(":", 1)[0]  # "vowels" / "digits"
    messages: list[Any] = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[CHECK_TOOL])
    draft = first.choices[0].message
    messages.append(draft)  # the message object as served: the endpoint matches it to the tokens it generated
    if draft.tool_calls:  # the model asked for the tool: run it, answer as a tool message
        call = draft.tool_calls[0]
        text = json.loads(call.function.arguments or "{}").get("text", "")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": check(prompt, str(text))})
    else:  # the agent checks the draft itself and tells the model
        messages.append({"role": "user", "content": f"{check(prompt, draft.content or '')} {target}:"})
    # the same tools as before: a conversation rendered with other tools would be another prompt
    final = await client.chat.completions.create(model="policy", messages=messages, tools=[CHECK_TOOL])
    answer = final.choices[0].message.content or ""
    scores = [charset_reward(prompt, draft.content or ""), charset_reward(prompt, answer)]
    return {"reward": sum(scores) / 2, "final_score": scores[1]}
