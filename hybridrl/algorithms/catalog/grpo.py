"""GRPO (Shao et al. 2024): each response's return against its prompt group's mean, over the group's std.
The KL to the reference is a loss term (k3) unless the config says otherwise."""
from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.registry import register_algorithm


@register_algorithm("grpo", min_samples_per_prompt=2, default_kl_mode="loss", default_kl_estimator="k3")
def grpo(x: AdvantageInputs) -> AdvantageResult:
    group = x.need("index", "the prompt group of each sample (rollout.n >= 2)")
    a, r = adv.grpo_outcome(x.sequence_scores, x.mask, group, norm_by_std=x.norm_by_std)
    return AdvantageResult(a, r, x.token_rewards)
