"""What a mixture-of-experts model's routers did in an update: the load-balancing and z-losses Megatron tracks,
and how many tokens each expert received.

    tracker = RoutingTracker(model)       # hooks every router of this rank's stage
    tracker.start()                       # before the update's forward/backward passes
    ... passes ...
    metrics = tracker.finish()            # collective over the role's ranks

Metrics (means over the MoE layers and the passes of the update):
    moe/load_balancing_loss, moe/z_loss   the routers' auxiliary losses, unscaled (when their coefficients are set)
    moe/expert_tokens/e<k>                tokens routed to expert k, summed over layers, DP replicas and passes
    moe/load_imbalance                    max over experts / mean over experts of the tokens, averaged over layers
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridrl.models.routing_replay import layer_pattern
from hybridrl.parallel.distributed import device


class RoutingTracker:
    def __init__(self, model: Any) -> None:
        from megatron.core import parallel_state

        config = model.config
        self.num_experts, self.num_layers = config.num_moe_experts, config.num_layers
        # on the device, in a dtype NCCL reduces: the hooks add to it without a copy to the host, and finish()
        # all-reduces it over the role's (NCCL, on GPUs) group
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=device())
        self.moe_layers = [i for i, moe in enumerate(layer_pattern(config)) if moe]
        # with sequence parallelism each TP rank routes its own slice of the tokens; without, all see the same
        self.tp_copies = 1 if config.sequence_parallel else parallel_state.get_tensor_model_parallel_world_size()
        self.active = False
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.register_forward_hook(self._hook(layer.layer_number - 1))

    def _hook(self, number: int):
        def count(module, args, output) -> None:
            if self.active:
                self.counts[number] += output[1].detach().sum(dim=0).to(self.counts.device, torch.float64)
        return count

    def start(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        clear_aux_losses_tracker()
        self.active = True

    def finish(self, passes: int) -> dict[str, float]:
        """Collective over every rank of the role (all stages and replicas)."""
        from megatron.core.transformer.moe.moe_utils import (get_moe_layer_wise_logging_tracker,
                                                             reduce_aux_losses_tracker_across_ranks)

        self.active = False
        metrics: dict[str, float] = {}
        tracker = get_moe_layer_wise_logging_tracker()
        if tracker:
            reduce_aux_losses_tracker_across_ranks()
            for name, entry in sorted(tracker.items()):
                values = entry["values"].float()
                metrics[f"moe/{name}"] = float(values[self.moe_layers].mean()) / max(passes, 1)
        counts = self.counts.clone()
        dist.all_reduce(counts)  # layers live on their stages; replicas (and TP ranks) routed their own tokens
        counts = counts[self.moe_layers].cpu() / self.tp_copies  # one copy to the host, after the collective
        for expert, total in enumerate(counts.sum(dim=0).tolist()):
            metrics[f"moe/expert_tokens/e{expert}"] = total
        per_layer_mean = counts.mean(dim=1).clamp(min=1.0)
        metrics["moe/load_imbalance"] = float((counts.max(dim=1).values / per_layer_mean).mean())
        return metrics
