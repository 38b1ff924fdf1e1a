"""The built-in algorithms, one module each; importing this package registers them."""
from hybridrl.algorithms.catalog import (cispo, dapo, dr_grpo, grpo, gspo, opd, ppo, reinforce_pp, remax,  # noqa: F401
                                       rloo, safe_rlhf)
