"""Expert parallelism in training (ep > 1) -> generation without it (e_g = 1) for the colocated hybrid engine.

A training rank holds num_experts / ep experts of each MoE layer (its expert-parallel rank's share, at its TP
shard); every generation rank needs all of them (at its t_g shard). Before each reshard the ranks of an
expert-parallel group all-gather their experts into buffers (one per expert this rank does not hold, named
with the global expert number), so the reshard that follows sees, on every rank, a training shard of an
EP=1 model and plans it like one. The buffers have storage only during a transition: to_training() frees
them again, so training holds no extra memory; the gather itself packs the local experts into buckets (one
all-gather each, at most bucket_mb received per bucket). Bytes: each rank receives (ep - 1) / ep of its TP shard of the
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

    def __init__(self, params: list[ShardedParam], num_experts: int, ep_group: Any,
                 bucket_bytes: int = 32 << 20) -> None:
        self.group, self.bucket_bytes = ep_group, max(1, bucket_bytes)
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
        self.buckets = self._buckets()
        self.collectives = len(self.buckets)  # all-gathers per transition

    def params(self, params: list[ShardedParam]) -> list[ShardedParam]:
        """The rank's training shards plus every remote expert's buffer: an EP=1 model's shard."""
        return params + self.remote

    @torch.no_grad()
    def gather(self) -> int:
        """Fill the buffers with the other ranks' current experts; returns the bytes received. The local experts
        go out packed, one all-gather per bucket of at most bucket_bytes received (not one per tensor: a
        Qwen3-30B-A3B rank at ep=8 holds 48 x 16 x 2 expert tensors)."""
        for _, slots in self.pairs:
            for slot in slots:
                if slot is not None:
                    slot.untyped_storage().resize_(slot.numel() * slot.element_size())
        received = 0
        for bucket in self.buckets:
            flat = torch.cat([param.tensor.detach().reshape(-1) for param, _ in bucket])
            gathered = torch.empty(self.ep * flat.numel(), dtype=flat.dtype, device=flat.device)
            dist.all_gather_into_tensor(gathered, flat, group=self.group)
            for rank, part in enumerate(gathered.split(flat.numel())):
                if rank == self.me:
                    continue
                offset = 0
                for param, slots in bucket:
                    numel = param.tensor.numel()
                    slots[rank].copy_(part[offset:offset + numel].view_as(slots[rank]))
                    offset += numel
                received += part.numel() * part.element_size()
        return received

    def _buckets(self) -> list[list[tuple[ShardedParam, list[torch.Tensor | None]]]]:
        buckets: list[list] = [[]]
        size = 0
        for pair in self.pairs:
            nbytes = self.ep * pair[0].tensor.numel() * pair[0].tensor.element_size()
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(pair)
            size += nbytes
        return [bucket for bucket in buckets if bucket]

    def release(self) -> None:
        """Drop the buffers' storage (after the transition back to training)."""
        for param in self.remote:
            param.tensor.untyped_storage().resize_(0)
