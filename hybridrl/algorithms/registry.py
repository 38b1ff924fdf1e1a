"""What each RL algorithm needs, so the trainer can validate a config before any worker starts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    advantage: str  # the estimator in hybridrl.algorithms.advantages
    needs_critic: bool  # a value model trained alongside the actor
    needs_greedy_baseline: bool  # a greedy response per prompt, generated every step
    min_samples_per_prompt: int  # rollout.n must be at least this (group baselines need >= 2)
    needs_cost_model: bool  # a cost model or cost function (cost_model.model / reward.cost_fn)
    uses_reference: bool = True  # KL to the reference policy (penalty or loss)
    default_kl_mode: str = "reward"  # reward: per-token penalty; loss: a loss term
    default_kl_estimator: str = "k1"  # k1 | k2 | k3 (algorithm.kl.estimator when unset)
    description: str = ""


ALGORITHMS: dict[str, AlgorithmSpec] = {
    spec.name: spec
    for spec in (
        AlgorithmSpec("remax", "remax", needs_critic=False, needs_greedy_baseline=True, min_samples_per_prompt=1,
                      needs_cost_model=False,
                      description="REINFORCE with the greedy response's reward as baseline (Li et al. 2023)"),
        AlgorithmSpec("ppo", "gae", needs_critic=True, needs_greedy_baseline=False, min_samples_per_prompt=1,
                      needs_cost_model=False, description="PPO with a critic and GAE (Ouyang et al. 2022)"),
        AlgorithmSpec("grpo", "grpo_outcome", needs_critic=False, needs_greedy_baseline=False,
                      min_samples_per_prompt=2, needs_cost_model=False, default_kl_mode="loss",
                      default_kl_estimator="k3",
                      description="group-normalised outcome advantage (Shao et al. 2024)"),
        AlgorithmSpec("rloo", "rloo", needs_critic=False, needs_greedy_baseline=False, min_samples_per_prompt=2,
                      needs_cost_model=False, description="REINFORCE leave-one-out (Ahmadian et al. 2024)"),
        AlgorithmSpec("reinforce_pp", "reinforce_plus_plus", needs_critic=False, needs_greedy_baseline=False,
                      min_samples_per_prompt=1, needs_cost_model=False,
                      description="REINFORCE++: KL-penalised returns, global batch whitening (Hu 2025)"),
        AlgorithmSpec("safe_rlhf", "gae", needs_critic=True, needs_greedy_baseline=False, min_samples_per_prompt=1,
                      needs_cost_model=True,
                      description="PPO-Lagrangian with reward and cost critics (Dai et al. 2023)"),
    )
}


def get_algorithm(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm.name={name!r} is unknown; choose one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


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
