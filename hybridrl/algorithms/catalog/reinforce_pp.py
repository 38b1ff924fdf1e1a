"""REINFORCE++ (Hu 2025): KL-penalised returns-to-go, whitened over the whole batch; no critic."""
from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.registry import register_algorithm


@register_algorithm("reinforce_pp")
def reinforce_pp(x: AdvantageInputs) -> AdvantageResult:
    a, r = adv.reinforce_plus_plus(x.token_rewards, x.mask, x.gamma)
    return AdvantageResult(a, r, x.token_rewards)
