"""Safe-RLHF's Lagrange multiplier for the cost constraint E[cost] <= cost_limit.

The policy maximises E[reward] - lambda (E[cost] - cost_limit); lambda does gradient ascent on the same
Lagrangian, whose derivative in lambda is (mean cost - cost_limit): it grows while the constraint is
violated and shrinks (never below 0) once it holds.
"""
from __future__ import annotations

import math
from typing import Any

PARAMETRIZATIONS = ("log", "clamp")


class LagrangeMultiplier:
    """lambda >= 0, kept either as log(lambda) ("log", Safe-RLHF's choice) or clamped at 0 ("clamp").

    "log": log_lambda <- log_lambda + lr * lambda * (mean_cost - cost_limit)  (chain rule through exp).
    "clamp": lambda <- max(0, lambda + lr * (mean_cost - cost_limit)).
    `max_value` optionally caps lambda.
    """

    def __init__(self, init: float = 1.0, lr: float = 0.05, cost_limit: float = 0.0,
                 parametrization: str = "log", max_value: float | None = None) -> None:
        if parametrization not in PARAMETRIZATIONS:
            raise ValueError(f"parametrization={parametrization!r}; choose one of {PARAMETRIZATIONS}")
        if init < 0 or (parametrization == "log" and init <= 0):
            raise ValueError(f"algorithm.lagrangian_init={init} must be > 0 for the log parametrization "
                             "(>= 0 for clamp)")
        if lr <= 0:
            raise ValueError(f"algorithm.lagrangian_lr={lr} must be > 0")
        self.lr = float(lr)
        self.cost_limit = float(cost_limit)
        self.parametrization = parametrization
        self.max_value = max_value
        self._param = math.log(init) if parametrization == "log" else float(init)

    @property
    def value(self) -> float:
        value = math.exp(self._param) if self.parametrization == "log" else self._param
        return value if self.max_value is None else min(value, self.max_value)

    def update(self, mean_cost: float) -> float:
        """One ascent step from this batch's mean episode cost; returns the new lambda."""
        violation = float(mean_cost) - self.cost_limit
        if self.parametrization == "log":
            self._param += self.lr * self.value * violation
        else:
            self._param = max(0.0, self._param + self.lr * violation)
        if self.max_value is not None:
            cap = math.log(self.max_value) if self.parametrization == "log" else self.max_value
            self._param = min(self._param, cap)
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"param": self._param, "lr": self.lr, "cost_limit": self.cost_limit,
                "parametrization": self.parametrization, "max_value": self.max_value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["parametrization"] != self.parametrization:
            raise ValueError(f"checkpoint multiplier uses {state['parametrization']!r}, this run "
                             f"{self.parametrization!r}")
        self._param = float(state["param"])
        self.lr = float(state["lr"])
        self.cost_limit = float(state["cost_limit"])
        self.max_value = state["max_value"]
