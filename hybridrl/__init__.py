"""hybridrl: RL post-training for large language models on Megatron-Core (HybridFlow-style).

The public API is imported lazily, so `import hybridrl` stays cheap (Slurm node helpers import it):

    from hybridrl import ResourcePool, WorkerGroup, ParallelLayout, Batch, SamplingParams
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ParallelLayout": "hybridrl.parallel",
    "Batch": "hybridrl.protocol",
    "ResourcePool": "hybridrl.controller",
    "WorkerGroup": "hybridrl.controller",
    "Worker": "hybridrl.controller",
    "register": "hybridrl.controller",
    "Dispatch": "hybridrl.controller",
    "create_colocated_worker_group": "hybridrl.controller",
    "SamplingParams": "hybridrl.rollout",
    "Actor": "hybridrl.roles",
    "ReferencePolicy": "hybridrl.roles",
    "Critic": "hybridrl.roles",
    "RewardModel": "hybridrl.roles",
    "Judge": "hybridrl.roles",
    "RolloutReplicas": "hybridrl.roles",
    "Rollout": "hybridrl.rollout.types",
    "algorithms": "hybridrl.algorithms",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybridrl' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    return module if name == "algorithms" else getattr(module, name)
