"""PPO (Ouyang et al. 2022): a critic and GAE, advantages whitened over the batch."""
from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.registry import register_algorithm


@register_algorithm("ppo", needs_critic=True)
def ppo(x: AdvantageInputs) -> AdvantageResult:
    values = x.need("values", "the critic's values of the response tokens")
    a, r = adv.gae(x.token_rewards, values, x.mask, gamma=x.gamma, lam=x.lam, whiten=True)
    return AdvantageResult(a, r, x.token_rewards)
