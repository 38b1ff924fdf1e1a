"""Point-to-point execution of the in-place schedule, for gloo (CPU) micro-DP groups.

The schedule's collectives (inplace.InPlaceSchedule.ops) say which member's piece lands where; in every kind
each piece goes from the member holding it to every other member. gloo runs an all-gather as a ring of d-1
sequential steps into a staging tensor of the whole output, copied into place afterwards; its point-to-point
messages instead go straight into the destination memory and all run at once (measured on the 2-core box:
an 8 MiB all-gather over 4 ranks 54 ms, the same pieces as messages 20 ms). So on gloo the same schedule runs
as messages:
  - an in-place piece (contiguous destination) is sent by its holder to each other member and received
    directly into the generation buffer; a strided one (dim-1 column block) is received into scratch and
    copied into place;
  - a packed collective becomes one message per sender: the sender packs its pieces once and sends that
    buffer to every other member, each receiver unpacks it into place (the small-tensor coalescing stays);
  - consecutive collectives share one wave of messages while their scratch fits in one bucket, so a small
    model moves in one wave; the members compute the same waves, so nobody waits on a message not yet posted.
Same pieces, same bytes received as the collectives (the plan's accounting); NCCL keeps the collectives (its
all-gather writes in place).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrl.hybrid_engine.inplace import InPlaceSchedule, Op, Part


def _senders(op: Op) -> dict[int, list[Part]]:
    """A packed op's parts by the member sending them (each member's in schedule order)."""
    by_sender: dict[int, list[Part]] = {}
    for part in op.parts:
        by_sender.setdefault(part.member, []).append(part)
    return by_sender


def _scratch_numel(sched: InPlaceSchedule, op: Op, views: dict[str, torch.Tensor]) -> int:
    """Scratch one op needs (the same on every member): packed ops all their pieces, in-place ops their strided
    destinations."""
    if op.packed:
        return sum(sched.piece_numel(p) for p in op.parts)
    return sum(d.numel() for d in (sched.dst_view(views, p) for p in op.parts) if not d.is_contiguous())


def waves(sched: InPlaceSchedule, views: dict[str, torch.Tensor], budget: int) -> list[tuple[list[int], int]]:
    """Consecutive op indices grouped while their scratch stays within `budget` (an op alone always forms a
    wave), with each wave's scratch."""
    out: list[tuple[list[int], int]] = []
    for index, op in enumerate(sched.ops):
        need = _scratch_numel(sched, op, views)
        if out and out[-1][1] + need <= budget:
            out[-1][0].append(index)
            out[-1] = (out[-1][0], out[-1][1] + need)
        else:
            out.append(([index], need))
    return out


def run_point_to_point(sched: InPlaceSchedule, me: int, members: list[int], group, own: dict[str, torch.Tensor],
                       buffer: torch.Tensor, views: dict[str, torch.Tensor], budget: int, stats) -> None:
    """Fill the generation buffer (its views) with the schedule's pieces by messages; updates stats (bytes,
    copies, scratch, messages received)."""
    itemsize = buffer.element_size()
    plan = waves(sched, views, budget)
    scratch = buffer.new_empty(max((need for _, need in plan), default=0))
    stats.scratch_bytes = scratch.numel() * itemsize
    peers = [m for m in range(len(members)) if m != me]
    tag = 0  # one per message, counted identically on every member
    for indices, _ in plan:
        ops, unpack, cursor = [], [], 0
        for index in indices:
            op = sched.ops[index]
            groups = list(_senders(op).items()) if op.packed else [(p.member, [p]) for p in op.parts]
            for sender, parts in groups:
                sizes = [sched.piece_numel(p) for p in parts]
                dsts = [sched.dst_view(views, p) for p in parts]
                direct = not op.packed and dsts[0].is_contiguous()
                if sender == me:
                    srcs = [own[p.src].narrow(0, p.row, p.rows) for p in parts]
                    for dst, src in zip(dsts, srcs):
                        dst.copy_(src)  # the own slot: the one copy of this rank's training shard
                    stats.own_copy_bytes += sum(sizes) * itemsize
                    if op.packed:
                        send = scratch[cursor:cursor + sum(sizes)]
                        cursor += sum(sizes)
                        torch.cat([s.reshape(-1) for s in srcs], out=send)
                        stats.regroup_copy_bytes += sum(sizes) * itemsize
                    else:
                        send = srcs[0]
                    ops += [dist.P2POp(dist.isend, send, members[peer], group, tag) for peer in peers]
                else:
                    if direct:
                        recv = dsts[0]
                    else:
                        recv = scratch[cursor:cursor + sum(sizes)]
                        cursor += sum(sizes)
                        unpack.append((dsts, sizes, recv))
                    ops.append(dist.P2POp(dist.irecv, recv, members[sender], group, tag))
                    stats.recv_payload_bytes += sum(sizes) * itemsize
                    stats.messages += 1
                tag += 1
        # one batch per wave: NCCL runs it as one group (no per-pair ordering to deadlock on)
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for dsts, sizes, recv in unpack:
            offset = 0
            for dst, size in zip(dsts, sizes):
                dst.copy_(recv[offset:offset + size].view(dst.shape))
                offset += size
            stats.regroup_copy_bytes += sum(sizes) * itemsize
