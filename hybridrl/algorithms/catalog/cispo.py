"""CISPO (MiniMax-M1, 2025): GRPO's group-normalised advantage on a REINFORCE loss whose importance weight
is clipped and stop-gradient, so tokens outside the clip range still get a gradient (PPO's clip drops them).
Token-level aggregation. The loss is policy_losses.cispo_token_loss."""
from hybridrl.algorithms.catalog.grpo import grpo
from hybridrl.algorithms.registry import register_algorithm

register_algorithm("cispo", min_samples_per_prompt=2, policy_loss="cispo", default_kl_mode="loss",
                   default_kl_estimator="k3")(grpo)
