"""Sequence parallel with the plain-torch norm (no Transformer Engine / Apex).

Upstream: megatron/core/transformer/torch_norm.py `WrappedTorchNorm.__new__` asserts
`not config.sequence_parallel` ("AssertionError: sequence parallel not supported by torch LayerNorm"),
so `get_gpt_layer_local_spec` models cannot use sequence parallel without TE/Apex. The norm itself is
per token and works on a sequence shard; what sequence parallel needs is that the norm's params are
tagged `sequence_parallel=True`, so `finalize_model_grads` (distributed/finalize_model_grads.py)
all-reduces their grads over the TP group.
Fix: build the torch norm with sequence_parallel temporarily off, then tag its params.
`mark_sequence_parallel_params(model)` tags the norms of a model built any other way.
Checked on megatron-core 0.16.1.
"""
from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from hybridrl.versions import MEGATRON_CORE, MEGATRON_CORE_CHECKED
from megatron_patches._base import replace

VERSIONS = SpecifierSet(MEGATRON_CORE)
CHECKED_ON = MEGATRON_CORE_CHECKED
UPSTREAM = "megatron/core/transformer/torch_norm.py: WrappedTorchNorm.__new__"

NORM_TYPES = (torch.nn.LayerNorm, torch.nn.RMSNorm)


def mark_sequence_parallel_params(model: torch.nn.Module) -> int:
    """Tag every norm parameter of `model` with sequence_parallel=True; return how many were tagged.

    Call it on a model whose config has sequence_parallel=True but whose norms were not built through
    the patched WrappedTorchNorm (idempotent; norms built through it are tagged already).
    """
    count = 0
    for module in model.modules():
        if isinstance(module, NORM_TYPES):
            for param in module.parameters(recurse=False):
                param.sequence_parallel = True
                count += 1
    return count


def apply() -> None:
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    upstream_new = cls.__new__

    def __new__(klass, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if not config.sequence_parallel:
            return upstream_new(klass, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                                normalization)
        config.sequence_parallel = False  # only to pass the assert; restored right after
        try:
            norm = upstream_new(klass, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                                normalization)
        finally:
            config.sequence_parallel = True
        mark_sequence_parallel_params(norm)
        return norm

    replace(cls, "__new__", staticmethod(__new__))
