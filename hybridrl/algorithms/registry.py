"""The algorithm registry: an algorithm is one registered unit.

A module in hybridrl/algorithms/catalog/ (or a user's module, named by `algorithm.module`) decorates its
advantage estimator with `@register_algorithm(name, ...)`, declaring in the same place the inputs the
algorithm needs (critic, greedy baseline, cost, reference) and its config defaults. The trainer reads only
the spec: it starts the roles the spec asks for and calls the estimator; it never branches on a name.
Its per-token policy loss is named by policy_loss: a loss registered the same way (@register_policy_loss,
policy_losses.py), in the package or earlier in the user's module.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.loss_agg import LOSS_AGG_MODES
from hybridrl.algorithms.policy_losses import POLICY_LOSS_REGISTRY, policy_loss_names
from hybridrl.registry import Registry, import_user_module

Estimator = Callable[[AdvantageInputs], AdvantageResult]


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    estimator: Estimator  # AdvantageInputs -> AdvantageResult
    needs_critic: bool = False  # a value model trained alongside the actor (and a cost critic with a cost)
    needs_greedy_baseline: bool = False  # a greedy response per prompt, generated every step
    min_samples_per_prompt: int = 1  # rollout.n must be at least this (group baselines need >= 2)
    needs_cost_model: bool = False  # a cost model or cost function (cost_model.model / reward.cost_fn)
    uses_reference: bool = True  # KL to the reference policy (penalty or loss) when a KL coefficient is set
    needs_teacher: bool = False  # distils from a teacher: algorithm.distill.teacher must be set (opd)
    default_kl_mode: str = "reward"  # algorithm.kl.mode when unset: reward (per-token penalty) | loss
    default_kl_estimator: str = "k1"  # algorithm.kl.estimator when unset: k1 | k2 | k3
    default_loss_agg: str = "token_mean"  # algorithm.loss_agg when unset (algorithms/loss_agg.py)
    policy_loss: str = "ppo"  # a registered per-token policy loss: ppo, gspo, cispo or a user's (policy_losses.py)
    config_defaults: dict = field(default_factory=dict)  # algorithm.<key> values used when the config leaves None


ALGORITHMS = Registry("algorithm", "@register_algorithm in a module named by algorithm.module")


def register_algorithm(name: str, **declared) -> Callable[[Estimator], Estimator]:
    """Decorator: register the decorated advantage estimator as algorithm `name` with the declared needs and
    defaults (AlgorithmSpec's fields). A name registered twice by different code is refused."""
    def decorate(estimator: Estimator) -> Estimator:
        spec = AlgorithmSpec(name, estimator, **declared)
        if spec.default_kl_mode not in ("reward", "loss"):
            raise ValueError(f"algorithm {name!r}: default_kl_mode must be reward or loss")
        if spec.policy_loss not in POLICY_LOSS_REGISTRY:  # a user's loss: registered above, in the same module
            raise ValueError(f"algorithm {name!r}: policy_loss={spec.policy_loss!r} is not registered; registered: "
                             f"{', '.join(policy_loss_names())} (@register_policy_loss it before the algorithm)")
        if spec.default_loss_agg not in LOSS_AGG_MODES:
            raise ValueError(f"algorithm {name!r}: default_loss_agg must be one of {LOSS_AGG_MODES}")
        ALGORITHMS.add(name, spec, estimator)
        return estimator
    return decorate


def import_algorithm_module(module: str) -> None:
    """Import a user's module so that its @register_algorithm runs (algorithm.module)."""
    import_user_module(module, "algorithm.module")


def get_algorithm(name: str) -> AlgorithmSpec:
    return ALGORITHMS.lookup(name, subject=f"algorithm.name={name!r}")


def validate_algorithm(name: str, samples_per_prompt: int = 1, has_cost: bool = False,
                       kl_mode: str = "reward") -> AlgorithmSpec:
    """Refuse settings an algorithm cannot run with; the error names the option and the fix."""
    spec = get_algorithm(name)
    if samples_per_prompt < spec.min_samples_per_prompt:
        raise ValueError(f"algorithm {name!r} compares samples of the same prompt: set rollout.n >= "
                         f"{spec.min_samples_per_prompt} (got rollout.n={samples_per_prompt})")
    if spec.needs_cost_model and not has_cost:
        raise ValueError(f"algorithm {name!r} needs a cost signal: set cost_model.model or reward.cost_fn")
    if kl_mode not in ("reward", "loss"):
        raise ValueError(f"algorithm.kl.mode={kl_mode!r} is unknown; choose reward or loss")
    return spec
