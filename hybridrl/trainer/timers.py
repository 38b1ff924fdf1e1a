"""Per-stage wall-clock timers for one training step.

The loop wraps each stage of a step in ``with timer("generation"): ...`` and, once the step is done,
calls ``timer.pop()`` to get ``{"time/generation": s, ..., "time/step": total}`` ready to log. Repeated
entries of a stage within a step add up. Stages may nest (``transition`` inside ``generation``): each
stage measures its own interval, so the outer one includes the inner one. A stage re-entered while
it is already open is counted once (its outermost interval), so recursion does not double count.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STAGE_PREFIX = "time/"
STEP_KEY = "time/step"


class StageTimer:
    """Accumulates wall seconds per stage for one step; ``pop()`` returns them and starts a new step.

    ``clock`` returns seconds (monotonic); tests inject a fake one. The step's total ("time/step")
    runs from ``start_step()`` -- or, if the loop never calls it, from the first stage entered since the
    last ``pop()`` -- to ``pop()``.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._totals: dict[str, float] = {}
        self._open: dict[str, int] = {}  # stage -> nesting depth of re-entries currently open
        self._step_start: float | None = None

    def start_step(self) -> None:
        """Mark the beginning of a step (otherwise the first stage entered marks it)."""
        if self._open:
            raise RuntimeError(f"start_step() called while stages are open: {sorted(self._open)}")
        self._step_start = self._clock()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        name = _check_stage(stage)
        now = self._clock()
        if self._step_start is None:
            self._step_start = now
        depth = self._open.get(name, 0)
        self._open[name] = depth + 1
        try:
            yield
        finally:
            end = self._clock()
            if depth == 0:  # only the outermost interval of a re-entered stage counts
                self._totals[name] = self._totals.get(name, 0.0) + (end - now)
                del self._open[name]
            else:
                self._open[name] = depth

    def add(self, stage: str, seconds: float) -> None:
        """Add seconds measured elsewhere (e.g. a worker timing its own transition) to a stage."""
        name = _check_stage(stage)
        if not seconds >= 0:  # also refuses NaN
            raise ValueError(f"StageTimer.add({stage!r}, {seconds!r}): seconds must be a number >= 0")
        self._totals[name] = self._totals.get(name, 0.0) + float(seconds)

    def peek(self) -> dict[str, float]:
        """The stage totals so far in this step, without "time/step" and without resetting."""
        return {STAGE_PREFIX + name: total for name, total in self._totals.items()}

    def pop(self) -> dict[str, float]:
        """Return ``{"time/<stage>": seconds, ..., "time/step": total}`` and reset for the next step.

        "time/step" is present only if the step started (a stage was entered or start_step() called).
        """
        if self._open:
            raise RuntimeError(f"StageTimer.pop() while stages are still open: {sorted(self._open)}")
        out = self.peek()
        if self._step_start is not None:
            out[STEP_KEY] = self._clock() - self._step_start
        self._totals = {}
        self._step_start = None
        return out


def _check_stage(stage: str) -> str:
    if not isinstance(stage, str) or not stage:
        raise ValueError(f"stage name must be a non-empty string, got {stage!r}")
    name = stage.removeprefix(STAGE_PREFIX)
    if name == "step":
        raise ValueError('stage name "step" is reserved: "time/step" is the whole step, set by pop()')
    return name
