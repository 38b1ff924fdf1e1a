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
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrl.hybrid_engine.plan import ParamSpec, generation_shard_from_training
from hybridrl.hybrid_engine.reshard import ShardMeta
from hybridrl.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class Transfer:
    sender: int  # training rank (= its bridge rank)
    receiver: int  # rollout rank (its bridge rank is A + receiver)
    replicated: bool  # whether the message also carries the replicated tensors


def bridge_plan(train: ParallelLayout, gen_tp: int, rollout_ranks: int) -> list[Transfer]:
    """Every (training rank -> rollout rank) message of one sync, in a fixed order."""
    if train.tp % gen_tp:
        raise ValueError(f"rollout.tp={gen_tp} must divide actor.parallel.tp={train.tp}: a generation shard is "
                         f"regrouped from whole training shards")
    if rollout_ranks % gen_tp:
        raise ValueError(f"the rollout pool's {rollout_ranks} devices do not split into replicas of "
                         f"rollout.tp={gen_tp}")
    gen = ParallelLayout(tp=gen_tp, dp=rollout_ranks // gen_tp)
    k = train.tp // gen_tp
    out = []
    for receiver in range(rollout_ranks):
        g = gen.coords(receiver).tp
        for stage in range(train.pp):
            for tp in range(g * k, (g + 1) * k):
                out.append(Transfer(train.rank(pp=stage, dp=0, tp=tp), receiver, replicated=tp == g * k))
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
    store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("hybridrl-bridge", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    return Bridge(pg, store, device)


def _message_metas(metas: list[ShardMeta], replicated: bool) -> list[ShardMeta]:
    return [m for m in metas if replicated or m.partition_dim is not None]


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
        chosen = _message_metas(metas, transfer.replicated)
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
            numel = sum(m.numel for m in _message_metas(metas[transfer.sender], transfer.replicated))
            self.buffers[transfer.sender] = torch.empty(numel, dtype=dtype, device=bridge.device)
            self.works.append(bridge.pg.recv([self.buffers[transfer.sender]], transfer.sender, transfer.sender))

    def assemble(self) -> tuple[dict[str, torch.Tensor], int]:
        for work in self.works:
            work.wait()
        return _assemble(self.mine, self.metas, self.train, self.buffers)


def _assemble(mine: list[Transfer], metas: dict[int, list[ShardMeta]], train: ParallelLayout,
              buffers: dict[int, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """{global name: generation shard} from the received buffers, and the payload bytes."""
    pieces: dict[int, dict[str, torch.Tensor]] = {}
    received = 0
    for transfer in mine:
        offset, views = 0, {}
        for m in _message_metas(metas[transfer.sender], transfer.replicated):
            views[m.name] = buffers[transfer.sender][offset:offset + m.numel].view(m.shape)
            offset += m.numel
        pieces[transfer.sender] = views
        received += buffers[transfer.sender].numel() * buffers[transfer.sender].element_size()
    out: dict[str, torch.Tensor] = {}
    by_stage: dict[int, list[Transfer]] = {}
    for transfer in mine:
        by_stage.setdefault(train.coords(transfer.sender).pp, []).append(transfer)
    for stage, transfers in sorted(by_stage.items()):
        transfers.sort(key=lambda t: train.coords(t.sender).tp)
        first = transfers[0]
        for m in metas[first.sender]:
            if m.name in out:  # a tied embedding's copy on the last stage
                continue
            if m.partition_dim is None:
                out[m.name] = pieces[first.sender][m.name]
                continue
            spec = ParamSpec(m.name, m.shape, m.partition_dim, None, "layer", m.regroup)
            out[m.name] = generation_shard_from_training([pieces[t.sender][m.name] for t in transfers], spec)
    return out, received
