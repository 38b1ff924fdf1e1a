"""RL algorithms as pure torch functions: advantage estimators, losses, KL control, Safe-RLHF multiplier."""
from hybridrl.algorithms.advantages import (apply_kl_penalty, discounted_returns, gae, grpo_outcome,
                                            last_token_index, place_sequence_rewards, reinforce_plus_plus, remax,
                                            rloo, safe_rlhf_combine)
from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.compute import compute_advantages
from hybridrl.algorithms.kl_control import (AdaptiveKL, FixedKL, KLController, LinearDecayKL, ScheduledKL,
                                            build_kl_controller)
from hybridrl.algorithms.lagrangian import LagrangeMultiplier
from hybridrl.algorithms.losses import (aggregate_loss, entropy_from_logits, entropy_loss, kl_loss, kl_penalty,
                                        log_probs_from_logits, masked_mean, masked_sum, masked_var, masked_whiten,
                                        ppo_policy_loss, value_loss)
from hybridrl.algorithms.policy_losses import (get_policy_loss, policy_loss_names, policy_token_loss,
                                               register_policy_loss)
from hybridrl.algorithms.registry import (ALGORITHMS, AlgorithmSpec, get_algorithm, import_algorithm_module,
                                          register_algorithm, validate_algorithm)
from hybridrl.algorithms import catalog  # noqa: E402,F401  registers the built-in algorithms

__all__ = [
    "ALGORITHMS", "AdaptiveKL", "AdvantageInputs", "AdvantageResult", "AlgorithmSpec", "FixedKL", "KLController",
    "LagrangeMultiplier", "LinearDecayKL", "ScheduledKL", "aggregate_loss", "apply_kl_penalty", "build_kl_controller",
    "compute_advantages", "discounted_returns", "entropy_from_logits", "entropy_loss", "gae", "get_algorithm",
    "get_policy_loss", "grpo_outcome", "import_algorithm_module", "kl_loss", "kl_penalty", "last_token_index",
    "log_probs_from_logits", "masked_mean", "masked_sum", "masked_var", "masked_whiten", "place_sequence_rewards",
    "policy_loss_names", "policy_token_loss", "ppo_policy_loss", "register_algorithm", "register_policy_loss",
    "reinforce_plus_plus", "remax", "rloo", "safe_rlhf_combine", "validate_algorithm", "value_loss",
]
