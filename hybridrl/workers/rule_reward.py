"""Rule-based rewards: a Python function given by dotted path (or a callable), run on the driver or spread
over a pool of CPU Ray tasks.

The function's signature is the house's: `fn(prompt: str, response: str, **row_metadata) -> float`; the
prompt row's extra columns (e.g. a reference answer) arrive as keyword arguments.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from hybridrl.registry import resolve_dotted


def load_reward_fn(path: str) -> Callable[..., float]:
    """"package.module:function" or "package.module.function" -> the function, or a clear error."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError("reward.fn must be a dotted path like 'my_pkg.rewards:score'")
    fn = resolve_dotted(path, "reward.fn")
    if not callable(fn):
        raise ValueError(f"reward.fn={path!r}: its module has no function of that name")
    return fn


class RewardFunctionError(ValueError):
    """The user's reward function raised or returned something that is not a number, on a named row."""


def _score_rows(fn: Callable, label: str, prompts: Sequence[str], responses: Sequence[str],
                metadata: Sequence[dict], first_row: int = 0) -> list[float]:
    # non-finite scores are passed through: the trainer applies trainer.on_nan to them
    scores = []
    for row, (prompt, response, meta) in enumerate(zip(prompts, responses, metadata), start=first_row):
        where = f"row {row} (prompt {prompt[:60]!r}, response {response[:60]!r})"
        try:
            value = fn(prompt, response, **meta)
        except Exception as exc:  # noqa: BLE001 - user code: name it and the row, keep the cause chained
            raise RewardFunctionError(f"reward function {label} raised {type(exc).__name__}: {exc} on {where}") \
                from exc
        try:
            scores.append(float(value))
        except (TypeError, ValueError):
            raise RewardFunctionError(f"reward function {label} returned {type(value).__name__} {value!r:.60} on "
                                      f"{where}; it must return a number") from None
    return scores


class RuleReward:
    """Scores with a reward function; num_workers > 0 spreads rows over that many CPU Ray tasks."""

    def __init__(self, fn: Callable | str, num_workers: int = 0) -> None:
        self.fn = load_reward_fn(fn) if isinstance(fn, str) else fn
        self.label = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
        if not callable(self.fn):
            raise ValueError(f"RewardModel(fn=...) must be callable or a dotted path, got {fn!r}")
        if num_workers < 0:
            raise ValueError(f"reward num_workers={num_workers} must be >= 0")
        self.num_workers = num_workers

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              metadata: Sequence[dict] | None = None) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        metadata = list(metadata) if metadata is not None else [{} for _ in responses]
        if len(metadata) != len(responses):
            raise ValueError(f"{len(metadata)} metadata rows for {len(responses)} responses")
        if self.num_workers == 0 or len(responses) < 2:
            return torch.tensor(_score_rows(self.fn, self.label, prompts, responses, metadata), dtype=torch.float32)
        import ray

        task = ray.remote(num_cpus=0)(_score_rows)
        fn_ref = ray.put(self.fn)
        parts = min(self.num_workers, len(responses))
        bounds = [round(i * len(responses) / parts) for i in range(parts + 1)]
        refs = [task.remote(fn_ref, self.label, prompts[a:b], responses[a:b], metadata[a:b], a)
                for a, b in zip(bounds, bounds[1:])]
        return torch.tensor([v for part in ray.get(refs) for v in part], dtype=torch.float32)

    def close(self) -> None:
        pass
