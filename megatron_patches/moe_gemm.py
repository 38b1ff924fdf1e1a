"""MoE routers without Transformer Engine (CPU, or a GPU without TE).

Upstream: megatron/core/transformer/moe/moe_utils.py imports `te_general_gemm` only inside its
`try: import transformer_engine` block, yet `RouterGatingLinearFunction.forward/backward` test
`te_general_gemm is not None`; without TE that raises "NameError: name 'te_general_gemm' is not
defined" on the first MoE router forward.
Fix: define it as None when it is missing (the router then uses torch.matmul).
Checked on megatron-core 0.16.1.
"""
from __future__ import annotations

from packaging.specifiers import SpecifierSet

from hybridrl.versions import MEGATRON_CORE, MEGATRON_CORE_CHECKED

VERSIONS = SpecifierSet(MEGATRON_CORE)
CHECKED_ON = MEGATRON_CORE_CHECKED
UPSTREAM = "megatron/core/transformer/moe/moe_utils.py: te_general_gemm (RouterGatingLinearFunction)"


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
