"""Shard-to-shard weight sync from the actor's training ranks to a rollout pool of its own (disaggregated).

The rollout pool's ranks hold a generation-layout model (t_g, p_g = 1; dp replicas). After an update, one
training replica (dp rank 0) sends each rollout rank exactly the training shards its generation shard is made
of: for generation TP index g, the shards of training TP ranks g*k .. g*k+k-1 (k = t / t_g) of every pipeline
stage, one packed message per (sender, receiver) pair; replicated tensors (norms) come from the first of those
only. The transport is a process group spanning both pools (the "bridge": training ranks 0..A-1, rollout ranks
A..A+B-1), opened once next to each pool's own group: gloo on CPU, NCCL when the models live on GPUs (NCCL's
point-to-point calls use one communicator per pair of ranks, so the per-sender order of the plan cannot
deadlock; not run here: no GPU). Each receiver assembles its shards exactly as the colocated hybrid engine does
(plan.generation_shard_from_training) and copies them into its model in place.

Mixture-of-experts actors: with training expert parallelism (ep > 1, expert TP = TP) DP rank b of a stage holds
expert block b, so a generation rank's experts (all of them, or the ep / e_g blocks of its generation expert
block when the pool runs expert parallelism e_g) come from the DP ranks holding them: one more message per
(block, training TP shard) beside dp rank 0's dense one, carrying only experts.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrl.hybrid_engine.plan import ParamSpec, generation_shard_from_training
from hybridrl.hybrid_engine.reshard import ShardMeta
from hybridrl.models.families import expert_number
from hybridrl.parallel.distributed import bound_listener
from hybridrl.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class Transfer:
    sender: int  # training rank (= its bridge rank)
    receiver: int  # rollout rank (its bridge rank is A + receiver)
    replicated: bool  # whether the message also carries the replicated tensors
    dense: bool = True  # whether it carries the TP-partitioned tensors other than experts
    experts: bool = True  # whether it carries the sender's experts


def bridge_plan(train: ParallelLayout, gen_tp: int, rollout_ranks: int, gen_ep: int = 1) -> list[Transfer]:
    """Every (training rank -> rollout rank) message of one sync, in a fixed order."""
    if train.tp % gen_tp:
        raise ValueError(f"rollout.tp={gen_tp} must divide actor.parallel.tp={train.tp}: a generation shard is "
                         f"regrouped from whole training shards")
    if rollout_ranks % gen_tp:
        raise ValueError(f"the rollout pool's {rollout_ranks} devices do not split into replicas of "
                         f"rollout.tp={gen_tp}")
    if train.expert_tp != train.tp:
        raise ValueError(f"a rollout pool of its own takes the experts at the training TP layout; "
                         f"actor.parallel.expert_tp={train.expert_tp} differs from tp={train.tp}: leave it unset")
    if train.ep % gen_ep:
        raise ValueError(f"rollout.ep={gen_ep} must divide actor.parallel.ep={train.ep} (a generation expert block "
                         f"is made of whole training blocks)")
    gen = ParallelLayout(tp=gen_tp, dp=rollout_ranks // gen_tp, ep=gen_ep)
    k, per_block = train.tp // gen_tp, train.ep // gen_ep
    out = []
    for receiver in range(rollout_ranks):
        g, block = gen.coords(receiver).tp, gen.expert_coords(receiver).ep
        # the training expert blocks this rank generates with (all of them at ep = 1: dp rank 0 holds them)
        needed = range(block * per_block, (block + 1) * per_block) if train.ep > 1 else range(1)
        for stage in range(train.pp):
            for tp in range(g * k, (g + 1) * k):
                for b in sorted({0, *needed}):  # expert block b lives on DP rank b (expert TP = TP)
                    out.append(Transfer(train.rank(pp=stage, dp=b, tp=tp), receiver, replicated=b == 0 and tp == g * k,
                                        dense=b == 0, experts=b in needed))
    return out


@dataclass
class Bridge:
    """The process group spanning both pools, and a counter of the syncs sent in its rendezvous store: a rollout
    rank generating a partial rollout reads it between decode steps to learn of new weights at once (its
    receive calls are queued behind the generation)."""

    pg: object
    store: object
    device: torch.device  # where messages are packed and received

    def announce(self) -> None:
        """One more sync's messages are posted (training bridge rank 0, after its sends)."""
        self.store.add(_SYNCS_SENT, 1)

    def announced(self) -> int:
        """Syncs sent so far (a non-blocking read of the counter)."""
        return int(self.store.add(_SYNCS_SENT, 0))


_SYNCS_SENT = "hybridrl-bridge-syncs-sent"


def open_bridge(host: str, port: int, rank: int, size: int, timeout_s: float = 600.0,
                device: torch.device = torch.device("cpu")) -> Bridge:
    """The bridge between both pools (bridge rank 0 hosts the rendezvous store); `device`: where this rank's
    model lives (every rank of both pools must be on the same kind)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # rank 0 serves the store on `host` alone (loopback in a one-node cluster), not on every interface
    listen_fd = bound_listener(host, port).detach() if rank == 0 else None
    store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout, master_listen_fd=listen_fd)
    prefixed = dist.PrefixStore("hybridrl-bridge", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    return Bridge(pg, store, device)


def _message_metas(metas: list[ShardMeta], transfer: Transfer) -> list[ShardMeta]:
    return [m for m in metas if (transfer.experts if expert_number(m.name) is not None else
                                 transfer.dense and (transfer.replicated or m.partition_dim is not None))]


class PendingSends:
    """One sync's outgoing messages, in flight on gloo's threads. The buffers are copies packed at send time, so
    the training weights may change right away; `wait()` before sending the next version."""

    def __init__(self, works: list, buffers: list[torch.Tensor]) -> None:
        self.works, self.buffers = works, buffers

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.buffers = [], []


def send_shards(bridge: Bridge, plan: list[Transfer], rank: int, params: dict[str, torch.Tensor],
                metas: list[ShardMeta], receiver_offset: int) -> tuple[PendingSends, int]:
    """Start this training rank's messages (a receiver's bridge rank is receiver_offset + its rank); returns them
    in flight and the payload bytes."""
    works, buffers, sent = [], [], 0
    for transfer in plan:
        if transfer.sender != rank:
            continue
        chosen = _message_metas(metas, transfer)
        buffer = (torch.cat([params[m.name].detach().reshape(-1) for m in chosen]) if chosen
                  else torch.empty(0, device=bridge.device))
        works.append(bridge.pg.send([buffer], receiver_offset + transfer.receiver, rank))
        buffers.append(buffer)
        sent += buffer.numel() * buffer.element_size()
    return PendingSends(works, buffers), sent


class PendingReceive:
    """One sync's incoming messages, posted; `assemble()` waits for them and forms the generation shard."""

    def __init__(self, plan: list[Transfer], receiver: int, metas: dict[int, list[ShardMeta]],
                 train: ParallelLayout, bridge: Bridge, dtype: torch.dtype) -> None:
        self.mine = [t for t in plan if t.receiver == receiver]
        self.metas, self.train = metas, train
        self.buffers, self.works = {}, []
        for transfer in self.mine:
            numel = sum(m.numel for m in _message_metas(metas[transfer.sender], transfer))
            self.buffers[transfer.sender] = torch.empty(numel, dtype=dtype, device=bridge.device)
            self.works.append(bridge.pg.recv([self.buffers[transfer.sender]], transfer.sender, transfer.sender))

    def assemble(self) -> tuple[dict[str, torch.Tensor], int]:
        for work in self.works:
            work.wait()
        return _assemble(self.mine, self.metas, self.train, self.buffers)


def _assemble(mine: list[Transfer], metas: dict[int, list[ShardMeta]], train: ParallelLayout,
              buffers: dict[int, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """{global name: generation shard} from the received buffers, and the payload bytes."""
    received = 0
    out: dict[str, torch.Tensor] = {}
    by_stage: dict[int, dict[str, list[tuple[int, ShardMeta, torch.Tensor]]]] = {}
    for transfer in mine:
        buffer, offset = buffers[transfer.sender], 0
        c = train.coords(transfer.sender)
        for m in _message_metas(metas[transfer.sender], transfer):
            by_stage.setdefault(c.pp, {}).setdefault(m.name, []).append(
                (c.tp, m, buffer[offset:offset + m.numel].view(m.shape)))
            offset += m.numel
        received += buffer.numel() * buffer.element_size()
    for stage, by_name in sorted(by_stage.items()):
        for name, pieces in by_name.items():
            if name in out:  # a tied embedding's copy on the last stage
                continue
            pieces.sort(key=lambda piece: piece[0])  # training TP order
            m = pieces[0][1]
            if m.partition_dim is None:
                out[name] = pieces[0][2]
                continue
            spec = ParamSpec(m.name, m.shape, m.partition_dim, None, "layer", m.regroup)
            out[name] = generation_shard_from_training([piece[2] for piece in pieces], spec)
    return out, received
