"""GSPO (Zheng et al. 2025, Group Sequence Policy Optimization): GRPO's group-normalised advantage with one
importance ratio per sequence, exp(mean over its tokens of log r), clipped per sequence; each response
weighs the same (seq_mean_token_mean). The loss is policy_losses.gspo_token_loss."""
from hybridrl.algorithms.catalog.grpo import grpo
from hybridrl.algorithms.registry import register_algorithm

register_algorithm("gspo", min_samples_per_prompt=2, policy_loss="gspo", default_loss_agg="seq_mean_token_mean",
                   default_kl_mode="loss", default_kl_estimator="k3")(grpo)
