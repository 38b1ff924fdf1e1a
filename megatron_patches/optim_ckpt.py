"""Distributed-optimizer checkpoints with torch's own Adam (no Transformer Engine / Apex optimizer).

Upstream: megatron/core/optimizer/distrib_optimizer.py
1. `DistributedOptimizer.sharded_state_dict(..., is_loading=True)` calls `state_dict()`, which (without
   TE/Apex) reads each parameter's "step" from torch's Adam state; a fresh optimizer has no state until its
   first step, so building the loading request fails (`assert len(steps) == 1`).
2. `DistributedOptimizer._set_main_param_and_optimizer_states` (fully_reshardable load) copies every key of
   the torch per-parameter state from the loaded tensors; torch's Adam keeps "step" there, which the
   checkpoint does not carry (the step travels in param_groups and `load_state_dict` has already set it):
   KeyError: 'step'.
3. `DistributedOptimizer.load_state_dict` gives every parameter's state the SAME "step" tensor; torch's
   Adam increments each parameter's step in place, so after a resume one optimizer step adds the number of
   parameters to the shared step (wrong bias correction: the resumed run diverges from an uninterrupted one).
Fix: 1. before a loading request on a never-stepped optimizer, give its parameters the state Adam's first
step would create (zeros; the loaded values overwrite them). 2. copy only the keys the checkpoint provides.
3. after load_state_dict, give each parameter its own copy of the step.
Checked on megatron-core 0.16.1.
"""
from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from hybridrl.versions import MEGATRON_CORE, MEGATRON_CORE_CHECKED
from megatron_patches._base import replace, wraps

VERSIONS = SpecifierSet(MEGATRON_CORE)
CHECKED_ON = MEGATRON_CORE_CHECKED
UPSTREAM = ("megatron/core/optimizer/distrib_optimizer.py: DistributedOptimizer.sharded_state_dict, "
            "_set_main_param_and_optimizer_states, load_state_dict")


def _init_empty_state(inner: torch.optim.Optimizer) -> None:
    if len(inner.state) or not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in inner.param_groups:
        for param in group["params"]:
            inner.state[param].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param.data),
                                      exp_avg_sq=torch.zeros_like(param.data))


def apply() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    upstream_sharded = DistributedOptimizer.sharded_state_dict

    @wraps(upstream_sharded)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False, *args, **kwargs):
        if is_loading and self.optimizer is not None:
            _init_empty_state(self.optimizer)
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        return upstream_sharded(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    upstream_set = DistributedOptimizer._set_main_param_and_optimizer_states

    @wraps(upstream_set)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            absent = {key: value for key, value in state.items() if key not in tensors}
            if absent:  # keep this optimizer's own value (e.g. "step", already loaded from param_groups)
                tensors = {**tensors, **absent}
        return upstream_set(self, model_param, tensors)

    upstream_load = DistributedOptimizer.load_state_dict

    @wraps(upstream_load)
    def load_state_dict(self, state_dict):
        result = upstream_load(self, state_dict)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()
        return result

    replace(DistributedOptimizer, "sharded_state_dict", sharded_state_dict)
    replace(DistributedOptimizer, "load_state_dict", load_state_dict)
    replace(DistributedOptimizer, "_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states)
