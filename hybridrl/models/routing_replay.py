"""Routing replay for mixture-of-experts models: the experts the rollout routed each token to, reused by the
trainer's forwards.

The rollout engine (other kernels, another precision, an older policy in asynchronous RL) can route a token to
other experts than the trainer's forward of the same sequence does. At a near-tie one swapped expert changes
the token's log-prob, so the importance ratio pi_trainer / pi_rollout moves away from 1 for reasons that have
nothing to do with learning. Recording the rollout's top-k choices per token and MoE layer and replaying them
in the trainer's forwards removes that part of the mismatch; the gate weights stay the trainer's own (the
router's scores at the replayed experts), so the router still learns.

Megatron-Core's TopKRouter asks `router.router_replay.get_replay_topk(...)` for its top-k when that attribute
is set. `ExpertRouting.of(model)` puts one LayerRouting there per MoE layer of the model: our own objects, not
Megatron's process-wide RouterReplay list, so several models in one process (training, generation, reference)
stay apart. Modes (one per model at a time):
  record   keep the experts each forward chose (the rollout engine reads them after every forward);
  measure  route as usual, count the tokens whose choice differs from the loaded targets;
  replay   count as in measure, then route every token with a target to the target's experts.
Routing tensors are [..., tokens, moe_layers, topk] int16 with -1 where nothing was recorded (padding, a
sequence's last token): such tokens route as usual in every mode.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

MODES = ("record", "measure", "replay")
ROUTING_DTYPE = torch.int16  # expert numbers (DeepSeek-V3: 256 experts)


class LayerRouting:
    """The routing hook of one MoE layer's router."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.target: torch.Tensor | None = None   # [tokens, topk] long, -1 unknown
        self.recorded: torch.Tensor | None = None  # [tokens, topk] of the last forward (record)
        self.compared = 0     # tokens with a target seen (measure / replay)
        self.mismatched = 0   # of those, tokens whose own top-k set differs from the target

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode == "record":
            self.recorded = own.detach()
        elif self.mode in ("measure", "replay") and self.target is not None:
            target = self.target.to(own.device)
            if target.shape != own.shape:
                raise ValueError(f"routing replay: {tuple(target.shape)} recorded experts for a router that sees "
                                 f"{tuple(own.shape)} (tokens x top-k); the batch's routed_experts do not match "
                                 f"its tokens")
            known = target[:, 0] >= 0
            differs = (own.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1) & known
            self.compared += int(known.sum())
            self.mismatched += int(differs.sum())
            if self.mode == "replay":
                index = torch.where(known.unsqueeze(-1), target, own)
                return scores.gather(1, index), index
        return probs, own


class ExpertRouting:
    """Every MoE router of one model (this rank's pipeline stage), by its index among the model's MoE layers."""

    def __init__(self, gpt: Any) -> None:
        pattern = layer_pattern(gpt.config)
        moe_index = {number: i for i, number in enumerate(n + 1 for n, moe in enumerate(pattern) if moe)}
        self.num_moe_layers = len(moe_index)
        self.topk = gpt.config.moe_router_topk
        self.sequence_parallel = bool(gpt.config.sequence_parallel)
        self.device = next(gpt.parameters()).device
        self.layers: list[tuple[int, LayerRouting]] = []
        for layer in gpt.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                hook = LayerRouting()
                router.router_replay = hook
                self.layers.append((moe_index[layer.layer_number], hook))
        self.mode: str | None = None

    @staticmethod
    def of(model: Any) -> "ExpertRouting | None":
        """The model's routing hooks (installed on first use); None for a dense model."""
        gpt = model
        while hasattr(gpt, "module") and not hasattr(gpt, "decoder"):
            gpt = gpt.module
        if not getattr(gpt.config, "num_moe_experts", None):
            return None
        if getattr(gpt, "_hybridrl_routing", None) is None:
            gpt._hybridrl_routing = ExpertRouting(gpt)
        return gpt._hybridrl_routing

    def set_mode(self, mode: str | None) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"routing mode {mode!r}; choose one of {', '.join(MODES)} (or None)")
        self.mode = mode
        for _, hook in self.layers:
            hook.mode, hook.target, hook.recorded = mode, None, None

    # ---- rollout: what the last forward chose -------------------------------------------------------------
    def take_recorded(self) -> torch.Tensor:
        """[tokens, moe_layers, topk] of the last forward (record mode; the whole model on this rank)."""
        if len(self.layers) != self.num_moe_layers:
            raise RuntimeError("recording routing needs every MoE layer on this rank (generation p_g = 1)")
        out = torch.stack([hook.recorded for _, hook in sorted(self.layers, key=lambda x: x[0])], dim=1)
        return out.to(ROUTING_DTYPE)

    # ---- training: targets of one micro-batch -----------------------------------------------------------
    def load_targets(self, routed: torch.Tensor | None) -> None:
        """routed [rows, width, moe_layers, topk] of the micro-batch about to run (None: route as usual). The
        routers see tokens sequence-major ([width, rows] flattened), with sequence parallelism only this TP
        rank's slice of the sequence."""
        for index, hook in self.layers:
            if routed is None:
                hook.target = None
                continue
            target = routed[:, :, index, :].transpose(0, 1)
            if self.sequence_parallel:
                from megatron.core import parallel_state

                tp = parallel_state.get_tensor_model_parallel_world_size()
                rank = parallel_state.get_tensor_model_parallel_rank()
                target = target.chunk(tp, dim=0)[rank]
            hook.target = target.reshape(-1, target.shape[-1]).long()

    def reset_counts(self) -> None:
        for _, hook in self.layers:
            hook.compared = hook.mismatched = 0

    def mismatch(self, group: Any = None) -> float:
        """Share of (token, MoE layer) pairs with a recorded choice whose own top-k set differs from it, over
        every rank of `group` (a collective; TP copies count on both sides of the ratio alike)."""
        counts = torch.tensor([sum(h.mismatched for _, h in self.layers), sum(h.compared for _, h in self.layers)],
                              dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(counts, group=group)
        return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0


def layer_pattern(config: Any) -> list[bool]:
    """Per decoder layer of a Megatron config: a MoE layer (True) or a dense MLP."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(x) for x in freq]
