"""RNG tracker on the CPU generator.

Upstream: megatron/core/tensor_parallel/random.py -- `CudaRNGStatesTracker.add` calls
`torch.cuda.get_rng_state` / `torch.cuda.manual_seed`; `_get_cuda_rng_state` / `_set_cuda_rng_state`
(used by `CudaRNGStatesTracker.fork`, which attention enters even with dropout 0, and by activation
checkpointing) read `torch.cuda.default_generators`; `model_parallel_cuda_manual_seed` seeds only the
CUDA generator. Without CUDA, building the tracker fails with
"AssertionError: Torch not compiled with CUDA enabled".
Fix: the tracker keeps CPU generator states (the CPU generator plays the device generator's role),
the get/set helpers read/write the CPU generator, and `model_parallel_cuda_manual_seed` also seeds
the CPU generator with the data-parallel seed (the "default state" that must agree across a model
parallel group).
Checked on megatron-core 0.16.1.
"""
from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from hybridrl.versions import MEGATRON_CORE, MEGATRON_CORE_CHECKED
from megatron_patches._base import replace, wraps

VERSIONS = SpecifierSet(MEGATRON_CORE)
CHECKED_ON = MEGATRON_CORE_CHECKED
UPSTREAM = ("megatron/core/tensor_parallel/random.py: CudaRNGStatesTracker.add, _get_cuda_rng_state, "
            "_set_cuda_rng_state, initialize_rng_tracker, model_parallel_cuda_manual_seed")


def _get_cpu_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()  # always a fresh copy


def _set_cpu_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def apply() -> None:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    upstream_tracker = getattr(mrandom.CudaRNGStatesTracker, "_hybridrl_original", None) or mrandom.CudaRNGStatesTracker

    class CpuRNGStatesTracker(upstream_tracker):
        """CudaRNGStatesTracker whose named states are CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            if self.use_cudagraphable_rng:
                raise RuntimeError("use_cudagraphable_rng needs CUDA graphs; turn it off on CPU")
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig_state = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig_state)

    # fork() and the checkpoint helpers look these names up in the module at call time.
    replace(mrandom, "_get_cuda_rng_state", _get_cpu_rng_state)
    replace(mrandom, "_set_cuda_rng_state", _set_cpu_rng_state)
    # initialize_rng_tracker instantiates the module-global class name.
    replace(mrandom, "CudaRNGStatesTracker", CpuRNGStatesTracker)

    upstream_seed = mrandom.model_parallel_cuda_manual_seed

    @wraps(upstream_seed)
    def model_parallel_cuda_manual_seed(seed: int, *args, **kwargs):
        result = upstream_seed(seed, *args, **kwargs)
        torch.manual_seed(seed)  # the CPU generator is this process's device generator
        return result

    replace(mrandom, "model_parallel_cuda_manual_seed", model_parallel_cuda_manual_seed)
    tensor_parallel.model_parallel_cuda_manual_seed = mrandom.model_parallel_cuda_manual_seed
    # A tracker built before apply() holds CUDA states: drop it so the next use builds a CPU one.
    if mrandom._CUDA_RNG_STATE_TRACKER is not None and not isinstance(
            mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
