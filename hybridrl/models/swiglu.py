"""Megatron's dense MLP with a SwiGLU whose backward writes both halves' gradients into one buffer.

Without the fused activation (CPU: `bias_activation_fusion` off), Megatron's MLP chunks fc1's output
[s, b, 2f] into gate and up halves; autograd's backward of that chunk concatenates the halves' gradients
into a fresh [s, b, 2f] tensor. On the peer job's 25M model (2 CPU cores) those concatenations took
~0.4 s of a 3.3 s update (torch.profiler: aten::cat). `SwiGLU` runs the same ops (silu(gate) * up forward;
the product's and silu's backward) and writes the two gradients straight into the halves of one tensor:
the same values bit for bit, no concatenation. Where Megatron fuses the activation (GPU), or the MLP
uses a clamp, an offset or per-token scales, Megatron's own forward runs.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up over [..., 2f] = [gate; up] (Megatron's fc1 layout) -> [..., f]."""

    @staticmethod
    def forward(ctx, fc1_out: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(fc1_out, 2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(gate, up, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        gate, up, activated = ctx.saved_tensors
        grad_in = grad.new_empty((*grad.shape[:-1], 2 * grad.shape[-1]))
        grad_gate, grad_up = torch.chunk(grad_in, 2, dim=-1)
        torch.mul(grad, activated, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_in


def plain_swiglu(config: Any) -> bool:
    """The MLP is silu(gate) * up with nothing fused, clamped or offset: SwiGLU computes exactly that."""
    return (config.gated_linear_unit and config.activation_func is F.silu and not config.bias_activation_fusion
            and not config.use_te_activation_func and config.activation_func_clamp_value is None
            and config.glu_linear_offset == 0.0)


class SwiGLUMLP(MLP):
    """Megatron's MLP (same parameters, checkpoint layout and sharding) with `SwiGLU` as its activation."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not plain_swiglu(self.config):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        fc1_out, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            fc1_out = fc1_out + bias
        return self.linear_fc2(SwiGLU.apply(fc1_out))


def use_swiglu_mlp(model: torch.nn.Module) -> None:
    """Run the model's dense MLPs as SwiGLUMLP (experts and shared experts keep theirs). The class is swapped on
    the built modules rather than in the layer spec: Megatron passes an MLP its TP group only when the spec
    names MLP itself."""
    for name, module in model.named_modules():
        if type(module) is MLP and ".experts." not in f".{name}." and plain_swiglu(module.config):
            module.__class__ = SwiGLUMLP
