"""The built-in algorithms, one module each; importing this package registers them."""
from hybridrl.algorithms.catalog import dr_grpo, grpo, ppo, reinforce_pp, remax, rloo, safe_rlhf  # noqa: F401
