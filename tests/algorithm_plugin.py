"""Algorithms registered outside the package, as a user would: one module, named by algorithm.module.

plugin_mean_baseline: group-mean baseline REINFORCE, each response's return minus its prompt group's mean
(no std division), with the default PPO loss.
plugin_capped_reinforce: GRPO's advantages with a policy loss of this module's own, REINFORCE weighted by a
truncated importance ratio. The loss runs in the actor's Ray workers, which import this module by name."""
import torch

from hybridrl.algorithms import (AdvantageInputs, AdvantageResult, grpo_outcome, masked_mean, register_algorithm,
                                 register_policy_loss)


@register_algorithm("plugin_mean_baseline", min_samples_per_prompt=2)
def mean_baseline(x: AdvantageInputs) -> AdvantageResult:
    group = x.need("index", "the prompt group of each sample")
    advantages, returns = grpo_outcome(x.sequence_scores, x.mask, group, norm_by_std=False)
    return AdvantageResult(advantages, returns, x.token_rewards)


@register_policy_loss("plugin_capped_reinforce")
def capped_reinforce(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, clip_ratio: float, clip_ratio_high: float | None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-sg(min(r, 1 + eps_high)) * A * log p per token: off-policy tokens are reweighted, the weight capped
    above only (truncated importance sampling), and every token keeps its gradient."""
    log_ratio = (log_prob - old_log_prob).detach().clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=1.0 + (clip_ratio if clip_ratio_high is None else clip_ratio_high))
    return -weight * advantages * log_prob, {
        "clipfrac": masked_mean((weight != ratio).float(), mask),
        "approx_kl": masked_mean(-log_ratio, mask),
        "plugin_is_weight": masked_mean(weight, mask),  # reaches the metrics as actor/plugin_is_weight
    }


@register_algorithm("plugin_capped_reinforce", min_samples_per_prompt=2, policy_loss="plugin_capped_reinforce")
def group_normalised(x: AdvantageInputs) -> AdvantageResult:
    group = x.need("index", "the prompt group of each sample")
    advantages, returns = grpo_outcome(x.sequence_scores, x.mask, group)
    return AdvantageResult(advantages, returns, x.token_rewards)
