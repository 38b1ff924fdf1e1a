"""What one step of an algorithm runs, decided once from its registry entry and the algorithm settings.

The trainer's run plan holds it (trainer/plan.py) and the trainer loop and the automatic mapping's workload
(automap/apply.py) read it; nothing re-derives these decisions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.algorithms.registry import AlgorithmSpec


@dataclass(frozen=True)
class StepNeeds:
    reference: bool  # reference log-probs: some step's KL coefficient is non-zero (a linear schedule may rise)
    kl_mode: str  # reward (per-token penalty on the rewards) | loss (a term of the actor's loss)
    mini_batches: int  # optimizer steps per epoch
    epochs: int
    greedy_baseline: bool  # a greedy response per prompt (ReMax)
    critic: bool
    cost: bool  # a cost signal and its critic (Safe-RLHF)
    # the reference log-probs come from the actor's own model with its LoRA adapters off (no reference model built:
    # a LoRA actor whose reference is its base model); set by the run plan
    reference_from_actor: bool = False
    teacher: bool = False  # a teacher's log-probs of the samples (on-policy distillation, algorithm.distill)

    @property
    def on_policy(self) -> bool:
        """One update over the whole batch: the update's own forward gives pi_old (detached), ratio 1."""
        return self.epochs == 1 and self.mini_batches == 1

    @property
    def old_log_probs(self) -> bool:
        """A separate pass for pi_old: off-policy updates, a KL penalty in the reward or a teacher's term (they
        need pi_old's log-probs before the advantages)."""
        return not self.on_policy or (self.reference and self.kl_mode == "reward") or self.teacher

    @property
    def kl_loss(self) -> bool:
        return self.reference and self.kl_mode == "loss"


def step_needs(spec: AlgorithmSpec, alg: Any, rows_per_step: int) -> StepNeeds:
    """The step of algorithm `spec` with settings `alg` (config.AlgorithmConfig: config/loading.py reads this
    package to fill in an algorithm's defaults, so no import back) on `rows_per_step` sampled sequences (the plan
    checks first that algorithm.mini_batch_size divides it)."""
    kl_ever = alg.kl.coef > 0 or (alg.kl.type == "linear" and alg.kl.final_coef > 0)
    mini_batches = rows_per_step // alg.mini_batch_size if alg.mini_batch_size else 1
    distill = getattr(alg, "distill", None)
    return StepNeeds(reference=spec.uses_reference and kl_ever, kl_mode=alg.kl.mode or spec.default_kl_mode,
                     mini_batches=mini_batches, epochs=alg.ppo_epochs, greedy_baseline=spec.needs_greedy_baseline,
                     critic=spec.needs_critic, cost=spec.needs_cost_model,
                     teacher=bool(distill is not None and distill.teacher))
