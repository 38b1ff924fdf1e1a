"""KL coefficient controllers: fixed, adaptive (target KL) and scheduled (linear / cosine decay).

Every controller has `value` (the coefficient to use this step), `update(current_kl, n_steps)` (called
once per policy step with the measured KL to the reference), and `state_dict()` / `load_state_dict()`
so a checkpoint restores the exact coefficient and schedule position.
"""
from __future__ import annotations

import math
from typing import Any

KL_CONTROLLER_TYPES = ("fixed", "adaptive", "linear", "cosine")


class KLController:
    value: float

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, **{k: v for k, v in vars(self).items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != type(self).__name__:
            raise ValueError(f"KL controller state is for {state.get('type')!r}, not {type(self).__name__!r} "
                             "(algorithm.kl.type differs from the checkpoint's)")
        for key, val in state.items():
            if key != "type":
                setattr(self, key, val)


class FixedKL(KLController):
    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        return self.value


class AdaptiveKL(KLController):
    """Ziegler et al. (2019): beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon)."""

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0 (got target={target}, "
                             f"horizon={horizon}; set algorithm.kl.target / algorithm.kl.horizon)")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


class ScheduledKL(KLController):
    """beta moves from `init_coef` to `final_coef` over `total_steps` policy steps, then stays.

    schedule "linear": straight line; "cosine": half cosine (slow start and end).
    """

    def __init__(self, init_coef: float, final_coef: float, total_steps: int, schedule: str = "linear") -> None:
        if total_steps <= 0:
            raise ValueError(f"a KL schedule needs total_steps > 0 (got {total_steps}; set trainer.steps)")
        if schedule not in ("linear", "cosine"):
            raise ValueError(f"KL schedule {schedule!r} is unknown; choose linear or cosine")
        self.init_coef = float(init_coef)
        self.final_coef = float(final_coef)
        self.total_steps = int(total_steps)
        self.schedule = schedule
        self.step = 0
        self.value = self._coef_at(0)

    def _coef_at(self, step: int) -> float:
        progress = min(step / self.total_steps, 1.0)
        if self.schedule == "cosine":
            progress = 0.5 * (1.0 - math.cos(math.pi * progress))
        return self.init_coef + (self.final_coef - self.init_coef) * progress

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        self.step += n_steps
        self.value = self._coef_at(self.step)
        return self.value


def LinearDecayKL(init_coef: float, final_coef: float, total_steps: int) -> ScheduledKL:  # noqa: N802
    """A linear decay of the KL coefficient over training."""
    return ScheduledKL(init_coef, final_coef, total_steps, schedule="linear")


def build_kl_controller(type: str = "fixed", coef: float = 0.01, target: float = 6.0, horizon: int = 10000,
                        final_coef: float = 0.0, total_steps: int = 1, **_: Any) -> KLController:
    """From the `algorithm.kl` config fields (plus the run's total steps for schedules)."""
    if type == "fixed":
        return FixedKL(coef)
    if type == "adaptive":
        return AdaptiveKL(coef, target, horizon)
    if type in ("linear", "cosine"):
        return ScheduledKL(coef, final_coef, total_steps, schedule=type)
    raise ValueError(f"algorithm.kl.type={type!r} is unknown; choose one of {KL_CONTROLLER_TYPES}")
