"""Expert parallelism in training (ep > 1) -> generation without it (e_g = 1) for the colocated hybrid engine.

A training rank holds num_experts / ep experts of each MoE layer (its expert-parallel rank's share, at its TP
shard); every generation rank needs all of them (at its t_g shard). Before each reshard the ranks of an
expert-parallel group all-gather their experts into buffers (one per expert this rank does not hold, named
with the global expert number), so the reshard that follows sees, on every rank, a training shard of an
EP=1 model and plans it like one. The buffers have storage only during a transition: to_training() frees
them again, so training holds no extra memory. Bytes: each rank receives (ep - 1) / ep of its TP shard of the
expert weights (counted in ReshardStats.extra["expert_recv_bytes"] and in recv_payload_bytes).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridrl.hybrid_engine.reshard import ShardedParam
from hybridrl.models.families import expert_number, renumber_expert


class ExpertGather:
    """The experts of the other ranks of this rank's expert-parallel group, gathered for the reshard."""

    def __init__(self, params: list[ShardedParam], num_experts: int, ep_group: Any) -> None:
        self.group = ep_group
        self.ep, self.me = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        per_rank = num_experts // self.ep
        self.pairs: list[tuple[ShardedParam, list[torch.Tensor | None]]] = []
        self.remote: list[ShardedParam] = []
        for param in params:
            expert = expert_number(param.name)
            if expert is None:
                continue
            local = expert - self.me * per_rank
            slots: list[torch.Tensor | None] = []
            for rank in range(self.ep):
                if rank == self.me:
                    slots.append(None)
                    continue
                buffer = torch.empty_like(param.tensor.detach())
                buffer.untyped_storage().resize_(0)  # storage only during a transition
                self.remote.append(ShardedParam(renumber_expert(param.name, rank * per_rank + local), buffer,
                                                param.partition_dim, param.stage, param.regroup))
                slots.append(buffer)
            self.pairs.append((param, slots))

    def params(self, params: list[ShardedParam]) -> list[ShardedParam]:
        """The rank's training shards plus every remote expert's buffer: an EP=1 model's shard."""
        return params + self.remote

    @torch.no_grad()
    def gather(self) -> int:
        """Fill the buffers with the other ranks' current experts; returns the bytes received."""
        received = 0
        for param, slots in self.pairs:
            local = param.tensor.detach()
            mine = torch.empty_like(local)
            outs = []
            for slot in slots:
                if slot is None:
                    outs.append(mine)
                    continue
                slot.untyped_storage().resize_(local.numel() * local.element_size())
                outs.append(slot)
                received += local.numel() * local.element_size()
            dist.all_gather(outs, local.contiguous(), group=self.group)
        return received

    def release(self) -> None:
        """Drop the buffers' storage (after the transition back to training)."""
        for param in self.remote:
            param.tensor.untyped_storage().resize_(0)
