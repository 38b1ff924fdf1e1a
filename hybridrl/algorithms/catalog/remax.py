"""ReMax (Li et al. 2023): REINFORCE with the greedy response's reward as the baseline."""
from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.registry import register_algorithm


@register_algorithm("remax", needs_greedy_baseline=True)
def remax(x: AdvantageInputs) -> AdvantageResult:
    baseline = x.need("baseline_scores", "the greedy responses' rewards")
    a, r = adv.remax(x.token_rewards, baseline, x.mask)
    return AdvantageResult(a, r, x.token_rewards)
