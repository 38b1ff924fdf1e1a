"""The built-in algorithms, one module each; importing this package registers them."""
from hybridrl.algorithms.catalog import (cispo, dapo, dr_grpo, grpo, gspo, ppo, reinforce_pp, remax, rloo,  # noqa: F401
                                       safe_rlhf)
