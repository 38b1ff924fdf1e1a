"""Agent programs the tests train (rollout.agent=agent_programs:<name>), written with the official openai client as
a user would write them; they record what the endpoint served them in SERVED."""
from __future__ import annotations

from typing import Any

from hybridrl.data.tasks import charset_reward

SERVED: list[dict] = []  # per finished run: its row's prompt and every response (token ids, log-probs, prompt ids)
OBSERVATIONS = ("digits:", "vowels:")


async def three_requests(client: Any, row: dict) -> float:
    """Three chat requests, each after the model's answer and an observation; with row["edit"] the third request
    rewrites the second observation (history edited: the run splits into two trajectories)."""
    messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
    responses = []
    for turn in range(3):
        if turn == 2 and row.get("edit"):
            messages = messages[:2] + [{"role": "user", "content": "edited:"}]
        response = await client.chat.completions.create(model="policy", messages=messages, logprobs=True,
                                                        extra_body={"return_token_ids": True})
        choice = response.choices[0]
        responses.append({"prompt_ids": response.model_extra["prompt_token_ids"],
                          "token_ids": choice.model_extra["token_ids"],
                          "log_probs": [t.logprob for t in choice.logprobs.content],
                          "version": response.model_extra["policy_version"]})
        messages += [choice.message, {"role": "user", "content": OBSERVATIONS[turn % 2]}]
    SERVED.append({"prompt": row["prompt"], "edit": bool(row.get("edit")), "responses": responses})
    return charset_reward(row["prompt"], choice.message.content or "")


async def edits_history(client: Any, row: dict) -> float:
    """three_requests on every row with its history edit: three requests, the third rewriting the second
    observation (each run splits into two trajectories)."""
    return await three_requests(client, {**row, "edit": True})


async def turns_like_the_env(client: Any, row: dict) -> float:
    """The conversation tests/test_agent.py's TurnsEnv makes: the model answers, sees "digits:" / "vowels:",
    three turns."""
    messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
    for turn in range(3):
        response = await client.chat.completions.create(model="policy", messages=messages)
        messages.append(response.choices[0].message)
        if turn < 2:
            messages.append({"role": "user", "content": OBSERVATIONS[turn % 2]})
    return 0.0


async def splitting(client: Any, row: dict) -> float:
    """Two requests; every other row rewrites its first message for the second request (two trajectories)."""
    first = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    answer = first.choices[0].message.content or ""
    opening = row["prompt"] if row.get("id", 0) % 2 else "vowels:"
    second = await client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": opening}, first.choices[0].message, {"role": "user", "content": "vowels:"}])
    return (charset_reward(row["prompt"], answer) + charset_reward(row["prompt"], second.choices[0].message.content
                                                                   or "")) / 2
