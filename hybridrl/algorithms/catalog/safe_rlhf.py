"""Safe-RLHF (Dai et al. 2023): PPO-Lagrangian with a reward critic and a cost critic.

(A_reward - lambda A_cost) / (1 + lambda), each side from GAE with its own critic, then whitened. The KL
penalty is charged once, to the reward side."""
from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.losses import masked_whiten
from hybridrl.algorithms.registry import register_algorithm


@register_algorithm("safe_rlhf", needs_critic=True, needs_cost_model=True)
def safe_rlhf(x: AdvantageInputs) -> AdvantageResult:
    values = x.need("values", "the reward critic's values")
    costs = x.need("cost_scores", "the cost model's (or cost_fn's) scores")
    cost_values = x.need("cost_values", "the cost critic's values")
    multiplier = x.need("lagrange_multiplier", "LagrangeMultiplier.value")
    reward_adv, r = adv.gae(x.token_rewards, values, x.mask, gamma=x.gamma, lam=x.lam, whiten=False)
    cost_adv, cost_r = adv.gae(adv.place_sequence_rewards(costs, x.mask), cost_values, x.mask, gamma=x.gamma,
                               lam=x.lam, whiten=False)
    combined = adv.safe_rlhf_combine(reward_adv, cost_adv, float(multiplier), x.mask)
    return AdvantageResult(masked_whiten(combined, x.mask), r, x.token_rewards, cost_r)
