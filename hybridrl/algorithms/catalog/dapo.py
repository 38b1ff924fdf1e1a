"""DAPO (Yu et al. 2025, Decoupled Clip and Dynamic sAmpling Policy Optimization): GRPO's group-normalised
advantage with
  - clip-higher: the ratio's upper clip decoupled from the lower (clip_ratio 0.2, clip_ratio_high 0.28),
  - token-level loss aggregation (token_mean),
  - dynamic sampling: groups whose rewards are all equal are dropped and the batch refilled with new prompts,
    up to max_refill_rounds (trainer; algorithms/shaping.py),
  - overlong reward shaping: a linear penalty over the last overlong_buffer tokens of max_new_tokens,
  - no KL to the reference (set algorithm.kl.coef > 0 to add one)."""
from hybridrl.algorithms.catalog.grpo import grpo
from hybridrl.algorithms.registry import register_algorithm

register_algorithm("dapo", min_samples_per_prompt=2, default_loss_agg="token_mean", default_kl_mode="loss",
                   default_kl_estimator="k3",
                   config_defaults={"clip_ratio_high": 0.28, "max_refill_rounds": 3, "overlong_buffer": 4,
                                    "overlong_penalty": 1.0})(grpo)
