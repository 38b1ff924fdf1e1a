"""The bundled learnable tasks: deterministic prompt sets and their rule rewards.

A task is chosen so that a randomly initialised tiny model scores low, a model that learnt it scores 1,
and a policy gradient gets there in a few dozen steps (dense partial credit: every response character
counts). Rewards follow the house signature `fn(prompt: str, response: str, **row_metadata) -> float`
in [0, 1]; the trainer passes each prompt row's extra columns as keyword arguments.

Both bundled tasks use one reward, `charset_reward`: each prompt names a character set followed by a
few random consonants, e.g. ``"vowels: qzkt"``, and the reward is the fraction of response characters
that belong to the named set, divided by at least 4 (so an empty or very short answer earns little).

- "vowels" (the default of `hybridrl train`): every prompt asks for vowels. A uniform random policy
  over the 64-token character vocabulary scores ~0.08; a tiny random Llama (hidden 64, 2-4 layers)
  trained with ReMax (Adam lr 1e-2, temperature 1, 16 new tokens, 16 prompts a step, KL coefficient
  <= 0.001) passes 0.8 mean sampled reward within 16-26 steps and ends near 1.0 by step 40. A k1
  per-token KL penalty of 0.01 slows this markedly (summed over 16 tokens it rivals the reward).
- "charset": half the prompts ask for vowels, half for digits (random policy ~0.12). The policy must
  read the prompt; the same recipe plateaus near 0.5 for a while (one set learnt first), so it needs
  more steps. It is there to exercise prompt-dependent rewards and row metadata.

Safe-RLHF also needs a cost (a "harm" the policy must keep under `algorithm.cost_limit`):
`digit_cost` is the fraction of response characters that are digits, over max(len(response), 4) like
the reward. A uniform random policy over the 64-token vocabulary pays ~0.15; on the "vowels" task the
reward pulls away from digits too, so the Lagrange multiplier first rises (cost above the limit) and then
decays once the policy keeps the cost under it. Use it as `reward.cost_fn: hybridrl.data.tasks:digit_cost`.
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any, Callable

TASKS_DIR = Path(__file__).resolve().parent.parent / "assets" / "tasks"
DEFAULT_TASK = "vowels"

CHARACTER_SETS: dict[str, str] = {
    "vowels": "aeiou",
    "digits": string.digits,
}


def charset_reward(prompt: str, response: str, target_set: str | None = None, min_length: int = 4,
                   **_: Any) -> float:
    """Fraction of response characters in the set the prompt asks for, over max(len(response), min_length).

    `target_set` (a row metadata column of the bundled prompt files) gives the allowed characters; without
    it the set is read from the prompt's first word ("vowels: ..." / "digits: ..."). Dividing by at least
    `min_length` gives stopping right away (an empty or one-character answer) little credit, so the policy
    does not learn to end every answer early, where one wrong character costs everything.
    """
    allowed = target_set if target_set is not None else _charset_from_prompt(prompt)
    hits = sum(1 for char in response if char in allowed)
    return hits / max(len(response), min_length, 1)


def _charset_from_prompt(prompt: str) -> str:
    name = prompt.split(":", 1)[0].strip().split()[-1] if ":" in prompt else ""
    if name not in CHARACTER_SETS:
        raise ValueError(
            f"prompt {prompt!r} does not start with one of {sorted(CHARACTER_SETS)} followed by ':' "
            "(give the allowed characters as the row column 'target_set' instead)"
        )
    return CHARACTER_SETS[name]


def digit_cost(prompt: str, response: str, min_length: int = 4, **_: Any) -> float:
    """Safe-RLHF cost: fraction of response characters that are digits, over max(len(response), min_length).

    Same shape as `charset_reward` (in [0, 1], short answers divided by at least `min_length`), so the
    Lagrangian trades like with like. The prompt and row metadata are accepted and ignored.
    """
    digits = sum(1 for char in response if char in CHARACTER_SETS["digits"])
    return digits / max(len(response), min_length, 1)


def charset_oracle(prompt: str, target_set: str | None = None, min_length: int = 4, **_: Any) -> str:
    """A response that scores 1.0 (used by tests): the allowed characters, repeated up to `min_length`."""
    allowed = target_set if target_set is not None else _charset_from_prompt(prompt)
    return (allowed * min_length)[: max(len(allowed), min_length)]


def make_charset_rows(num_rows: int = 400, seed: int = 0,
                      set_names: tuple[str, ...] = ("digits", "vowels")) -> list[dict[str, Any]]:
    """Deterministic prompt rows cycling over `set_names`, each with 3-8 random consonants."""
    rng = random.Random(seed)
    consonants = [c for c in string.ascii_lowercase if c not in CHARACTER_SETS["vowels"]]
    names = list(set_names)
    rows = []
    for index in range(num_rows):
        name = names[index % len(names)]
        letters = "".join(rng.choice(consonants) for _ in range(rng.randint(3, 8)))
        rows.append({"prompt": f"{name}: {letters}", "target_set": CHARACTER_SETS[name], "id": index})
    rng.shuffle(rows)
    return rows


def make_vowels_rows(num_rows: int = 400, seed: int = 0) -> list[dict[str, Any]]:
    return make_charset_rows(num_rows=num_rows, seed=seed, set_names=("vowels",))


TASK_REWARDS: dict[str, Callable[..., float]] = {"vowels": charset_reward, "charset": charset_reward}
TASK_ROW_MAKERS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "vowels": make_vowels_rows,
    "charset": make_charset_rows,
}


def task_train_file(name: str = DEFAULT_TASK) -> Path:
    """Path of a bundled task's prompt file (hybridrl/assets/tasks/<name>/train.jsonl)."""
    if name not in TASK_REWARDS:
        raise ValueError(f"unknown task {name!r}; bundled tasks: {sorted(TASK_REWARDS)}")
    return TASKS_DIR / name / "train.jsonl"


def task_reward_path(name: str = DEFAULT_TASK) -> str:
    """Dotted path of a bundled task's reward function, as `reward.fn` takes it."""
    if name not in TASK_REWARDS:
        raise ValueError(f"unknown task {name!r}; bundled tasks: {sorted(TASK_REWARDS)}")
    fn = TASK_REWARDS[name]
    return f"{fn.__module__}:{fn.__name__}"


def write_task_file(name: str, out_file: str | Path, num_rows: int = 400, seed: int = 0) -> Path:
    """Write a task's rows as JSON lines (byte-identical for the same arguments)."""
    rows = TASK_ROW_MAKERS[name](num_rows=num_rows, seed=seed)
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    return out
