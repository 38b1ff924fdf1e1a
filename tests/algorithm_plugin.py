"""An algorithm registered outside the package, as a user would: one module, named by algorithm.module.

Group-mean baseline REINFORCE: each response's return minus its prompt group's mean (no std division)."""
from hybridrl.algorithms import AdvantageInputs, AdvantageResult, grpo_outcome, register_algorithm


@register_algorithm("plugin_mean_baseline", min_samples_per_prompt=2)
def mean_baseline(x: AdvantageInputs) -> AdvantageResult:
    group = x.need("index", "the prompt group of each sample")
    advantages, returns = grpo_outcome(x.sequence_scores, x.mask, group, norm_by_std=False)
    return AdvantageResult(advantages, returns, x.token_rewards)
