"""Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): GRPO without its two biases.

The advantage is the response's return minus its prompt group's mean, not divided by the group's std (which
up-weights prompts that are almost always right or wrong); the loss sums each response's tokens and divides
by responses x a constant length (rollout.max_new_tokens), not by the response's own length (which favours
long wrong answers and short right ones)."""
from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.registry import register_algorithm


@register_algorithm("dr_grpo", min_samples_per_prompt=2, default_kl_mode="loss", default_kl_estimator="k3",
                    default_loss_agg="seq_mean_token_sum_norm")
def dr_grpo(x: AdvantageInputs) -> AdvantageResult:
    group = x.need("index", "the prompt group of each sample (rollout.n >= 2)")
    a, r = adv.grpo_outcome(x.sequence_scores, x.mask, group, norm_by_std=False)
    return AdvantageResult(a, r, x.token_rewards)
