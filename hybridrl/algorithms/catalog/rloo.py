"""RLOO (Ahmadian et al. 2024): REINFORCE with the mean of the prompt's other samples as the baseline."""
from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.registry import register_algorithm


@register_algorithm("rloo", min_samples_per_prompt=2)
def rloo(x: AdvantageInputs) -> AdvantageResult:
    group = x.need("index", "the prompt group of each sample (rollout.n >= 2)")
    a, r = adv.rloo(x.sequence_scores, x.mask, group)
    return AdvantageResult(a, r, x.token_rewards)
