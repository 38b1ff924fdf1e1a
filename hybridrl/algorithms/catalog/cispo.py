"""CISPO (MiniMax-M1, 2025): GRPO's group-normalised advantage on a REINFORCE loss whose importance weight
is clipped and stop-gradient, so tokens outside the clip range still get a gradient (PPO's clip drops them).
Token-level aggregation. The loss is policy_losses.cispo_token_loss."""
from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.registry import register_algorithm


@register_algorithm("cispo", min_samples_per_prompt=2, policy_loss="cispo", default_kl_mode="loss",
                    default_kl_estimator="k3")
def cispo(x: AdvantageInputs) -> AdvantageResult:
    group = x.need("index", "the prompt group of each sample (rollout.n >= 2)")
    a, r = adv.grpo_outcome(x.sequence_scores, x.mask, group, norm_by_std=x.norm_by_std)
    return AdvantageResult(a, r, x.token_rewards)
