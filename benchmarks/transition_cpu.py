"""Transition benchmark, part (a): measured training -> generation reshard on CPU gloo, 4 processes.

For several (t, p, d) -> (t_g, p_g) layouts and synthetic Llama-shaped models of a few sizes (fp32, random
shards shaped by hybrid_engine/model_shapes.py), every strategy (hybrid / ds_chat / hybridflow_v, plus
hybrid_collective: hybrid's schedule run as gloo collectives, the transport NCCL uses, where hybrid itself
runs it as point-to-point messages on gloo) runs in the same processes, interleaved repeat by repeat so
machine load hits them alike. Per repeat: barrier, then each rank times its own `Resharder.to_generation()`
and, after another barrier, `to_training()` (hybrid: restores the released training storage; baselines: drop
the buffer); a repeat's time is the span from the last rank's start to the last rank's end (one monotonic
clock on the machine: a rank descheduled before it leaves the barrier does not count against the strategy), in
an order rotated each repeat; the reported times are medians over repeats (after one warm-up). Bytes received
per rank come from `last_stats` and are printed next to the plan's accounting (hybrid_engine/accounting.py),
with a match flag.

Memory, measured from the tensors the reshard allocates and frees (`last_stats`): held_MB is the extra held
per rank while generating (hybrid in place: generation buffer + kept tensors - released training storage;
baselines: gathered model + assembled tensors, training kept); table2_held_MB is what HybridFlow Table 2 says
(hybrid: M/(t_g p_g) - M/(t p), with the replicated norms counted per TP rank, plus the norms a rank holds
but does not own; baselines: M); peak_MB is the most extra alive during the transition.

    python benchmarks/transition_cpu.py [--repeats 25] [--sizes 8m,32m] [--out benchmarks/results]

Writes transition_cpu.json, transition_cpu.md and transition_cpu.png. Timings are gloo over loopback on a
shared CPU machine: the ratios, not the absolute times, are the point.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._results import default_meta, write_results  # noqa: E402

logger = logging.getLogger("benchmarks.transition_cpu")

WORLD = 4
STRATEGIES = ("hybrid", "ds_chat", "hybridflow_v", "hybrid_collective")
# hybrid_collective: the hybrid schedule run as gloo collectives (NCCL's transport) instead of messages, to show
# what the gloo transport (hybrid_engine/p2p.py) contributes; the accounting is hybrid's


def _resharder_args(label: str) -> tuple[str, dict]:
    """Resharder strategy and options of a row label."""
    return ("hybrid", {"transport": "collective"}) if label == "hybrid_collective" else (label, {})


def _in_place(label: str) -> bool:
    return _resharder_args(label)[0] == "hybrid"
# (t, p, d) -> (t_g, p_g)
LAYOUTS = [((4, 1, 1), (2, 1)), ((4, 1, 1), (1, 1)), ((2, 2, 1), (1, 1)), ((2, 1, 2), (1, 1))]
# Llama-shaped synthetic models: name -> tiny_hf_config kwargs (sizes in fp32 parameters)
SIZES = {
    "8m": dict(vocab_size=8192, hidden=256, layers=4, heads=8, kv_heads=4, ffn_hidden=768),
    "32m": dict(vocab_size=8192, hidden=512, layers=8, heads=8, kv_heads=4, ffn_hidden=1536),
    "64m": dict(vocab_size=8192, hidden=768, layers=8, heads=8, kv_heads=4, ffn_hidden=2048),
}


def build_shapes(size: str, tmp: Path):
    """ModelShapes of a synthetic Llama config (built on the meta device; no weights)."""
    from hybridrl.hybrid_engine.model_shapes import model_shapes
    from hybridrl.models.tiny import tiny_hf_config

    folder = tmp / size
    tiny_hf_config("llama", **SIZES[size]).save_pretrained(folder)
    return model_shapes(str(folder))


def _local_params(plan, rank: int, seed: int):
    """This rank's training shards (random fp32 values, Megatron shard shapes)."""
    import torch

    from hybridrl.hybrid_engine.reshard import ShardedParam

    c = plan.train.coords(rank)
    gen = torch.Generator().manual_seed(seed + rank)
    params = []
    for spec in plan.shapes.params:
        stage = plan.train_stage_of(spec)
        if stage != c.pp:
            continue
        shape = list(spec.shape)
        if spec.partition_dim is not None:
            if shape[spec.partition_dim] % plan.train.tp:
                raise ValueError(f"{spec.name}: dim {spec.partition_dim} of {spec.shape} not divisible by "
                                 f"tp={plan.train.tp}; pick sizes divisible by 4")
            shape[spec.partition_dim] //= plan.train.tp
        params.append(ShardedParam(spec.name, torch.randn(shape, generator=gen), spec.partition_dim, stage,
                                   spec.regroup))
    return params


def _worker(rank: int, port: int, cases: list, repeats: int, bucket_bytes: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.hybrid_engine.reshard import Resharder
    from hybridrl.parallel.distributed import init_distributed
    from hybridrl.parallel.generation import GenerationGroups, GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    torch.set_num_threads(1)
    init_distributed(rank, WORLD, "127.0.0.1", port)
    results = []
    for size, shapes, (t, p, d), (tg, pg) in cases:
        train, genl = ParallelLayout(tp=t, pp=p, dp=d), GenerationLayout(tp=tg, pp=pg)
        plan = HybridEnginePlan(train, genl, shapes, dtype_bytes=4)
        params = _local_params(plan, rank, seed=1000)
        groups = GenerationGroups(train, genl)
        resharders = {s: Resharder(groups, params, _resharder_args(s)[0], bucket_bytes=bucket_bytes,
                                   **_resharder_args(s)[1]) for s in STRATEGIES}
        times: dict[str, list[tuple[float, float]]] = {s: [] for s in STRATEGIES}
        back: dict[str, list[tuple[float, float]]] = {s: [] for s in STRATEGIES}
        stats = {}
        for rep in range(repeats + 1):  # repeat 0 is the warm-up
            # interleaved, in an order rotated each repeat: load drift and cache state hit every strategy alike
            for s in STRATEGIES[rep % len(STRATEGIES):] + STRATEGIES[:rep % len(STRATEGIES)]:
                dist.barrier()
                start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine
                out = resharders[s].to_generation()
                end = time.monotonic()
                stats[s] = resharders[s].last_stats
                del out
                dist.barrier()
                start_back = time.monotonic()
                resharders[s].to_training()
                end_back = time.monotonic()
                if rep:
                    times[s].append((start, end))
                    back[s].append((start_back, end_back))
        mine = {s: {"times": times[s], "back": back[s], "recv_payload": stats[s].recv_payload_bytes,
                    "recv_wire": stats[s].recv_wire_bytes, "buffer": stats[s].buffer_bytes,
                    "generation": stats[s].generation_bytes, "held": stats[s].held_bytes,
                    "peak": stats[s].peak_extra_bytes, "scratch": stats[s].scratch_bytes,
                    "collectives": stats[s].collectives, "messages": stats[s].messages} for s in STRATEGIES}
        gathered: list = [None] * WORLD
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            results.append(gathered)
        del resharders, params
    dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def run_cases(cases: list, repeats: int, bucket_bytes: int) -> list:
    import torch.multiprocessing as mp

    from hybridrl.parallel.distributed import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, cases, repeats, bucket_bytes, queue)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=1800)
    for proc in procs:
        proc.join(timeout=120)
        if proc.exitcode != 0:
            raise RuntimeError(f"worker pid {proc.pid} exited with {proc.exitcode}")
    return results


def _spans(per_rank: list, strategy: str, key: str) -> list[float]:
    """Per repeat, the transition's span over the group: latest start to latest end (no collective can finish
    before the last rank starts, so the time a rank waited for a late one to leave the barrier is left out)."""
    pairs = [r[strategy][key] for r in per_rank]
    return [max(p[i][1] for p in pairs) - max(p[i][0] for p in pairs) for i in range(len(pairs[0]))]


def make_rows(cases: list, results: list) -> list[dict]:
    from hybridrl.hybrid_engine.accounting import account
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    rows = []
    for (size, shapes, (t, p, d), (tg, pg)), per_rank in zip(cases, results):
        plan = HybridEnginePlan(ParallelLayout(tp=t, pp=p, dp=d), GenerationLayout(tp=tg, pp=pg), shapes, 4)
        base: dict = {}
        for s in STRATEGIES:
            costs = account(plan, _resharder_args(s)[0]).ranks
            # per repeat: from the last rank's start to the last rank's end; then median over repeats
            per_repeat, per_repeat_back = _spans(per_rank, s, "times"), _spans(per_rank, s, "back")
            held = [r[s]["held"] for r in per_rank]
            if _in_place(s):  # accounting per rank: generation shard - training shard + norms held, not owned
                plan_held = [c.buffer_payload - plan.training_bytes(c.rank) + c.redundant for c in costs]
            else:  # the gathered model (Table 2: M) + padding; assembled tensors come on top
                plan_held = [c.buffer_payload + c.buffer_padding for c in costs]
            table2 = table2_held(plan, s)
            recv = [r[s]["recv_payload"] for r in per_rank]
            wire = [r[s]["recv_wire"] for r in per_rank]
            plan_recv = [c.recv_payload for c in costs]
            plan_wire = [c.recv_payload + c.recv_padding for c in costs]
            row = {"model": size, "params_m": round(shapes.numel / 1e6, 2),
                   "layout": f"({t},{p},{d})->({tg},{pg})", "strategy": s,
                   "time_ms": round(1e3 * statistics.median(per_repeat), 2),
                   "time_ms_all": [round(1e3 * x, 2) for x in per_repeat],
                   "recv_MB_max": round(max(recv) / 1e6, 3), "recv_MB_mean": round(sum(recv) / len(recv) / 1e6, 3),
                   "plan_recv_MB_max": round(max(plan_recv) / 1e6, 3),
                   "wire_MB_max": round(max(wire) / 1e6, 3),
                   "recv_bytes_per_rank": recv, "plan_recv_bytes_per_rank": plan_recv,
                   "wire_bytes_per_rank": wire, "plan_wire_bytes_per_rank": plan_wire,
                   "buffer_MB_max": round(max(r[s]["buffer"] for r in per_rank) / 1e6, 3),
                   "back_ms": round(1e3 * statistics.median(per_repeat_back), 2),
                   "held_MB_mean": round(sum(held) / len(held) / 1e6, 3), "held_MB_max": round(max(held) / 1e6, 3),
                   "table2_held_MB": round(float(table2) / 1e6, 3),
                   "peak_MB_max": round(max(r[s]["peak"] for r in per_rank) / 1e6, 3),
                   "scratch_MB_max": round(max(r[s]["scratch"] for r in per_rank) / 1e6, 3),
                   "collectives": per_rank[0][s]["collectives"], "messages": per_rank[0][s]["messages"],
                   "held_bytes_per_rank": held, "plan_held_bytes_per_rank": plan_held,
                   "held_match_plan": held == plan_held if _in_place(s) else all(
                       h >= q for h, q in zip(held, plan_held)),
                   "bytes_match_plan": recv == plan_recv and (wire == recv if _in_place(s) else wire == plan_wire)}
            base[s] = row
            rows.append(row)
        for s in STRATEGIES:
            base[s]["ratio_vs_hybrid"] = round(base[s]["time_ms"] / base["hybrid"]["time_ms"], 2)
    return rows


def table2_held(plan, strategy: str):
    """Table 2's extra memory while generating, mean per rank: hybrid M_g/(t_g p_g) - M_t/(t p) (+ the norms a
    rank holds but does not own), where M_g / M_t count replicated norms once per generation / training TP
    rank (both are M when every tensor is partitioned); baselines M."""
    from fractions import Fraction

    from hybridrl.hybrid_engine.accounting import account

    if not _in_place(strategy):
        return Fraction(plan.model_bytes)
    (t, p), (tg, pg) = (plan.train.tp, plan.train.pp), (plan.gen.tp, plan.gen.pp)
    part = sum(sum(row) for row in plan.table.partitioned) * plan.dtype_bytes
    repl = sum(plan.table.replicated) * plan.dtype_bytes
    ranks = account(plan, "hybrid").ranks
    return (Fraction(part + tg * repl, tg * pg) - Fraction(part + t * repl, t * p)
            + Fraction(sum(r.redundant for r in ranks), len(ranks)))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["model"], r["layout"]) for r in rows))
    by = {(r["model"], r["layout"], r["strategy"]): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(cases)), 8), sharex=True)
    width = 0.8 / len(STRATEGIES)
    for ax, key, label in ((axes[0], "time_ms", "to_generation, ms (median span over ranks)"),
                           (axes[1], "held_MB_mean", "extra MB held per rank while generating")):
        for i, s in enumerate(STRATEGIES):
            xs = [k + (i - (len(STRATEGIES) - 1) / 2) * width for k in range(len(cases))]
            ax.bar(xs, [by[(m, lay, s)][key] for m, lay in cases], width, label=s)
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.legend()
    axes[1].set_xticks(range(len(cases)))
    axes[1].set_xticklabels([f"{m}\n{lay}" for m, lay in cases], fontsize=7)
    axes[0].set_title("Training -> generation transition, CPU gloo, 4 processes, fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=25, help="timed repeats after one warm-up (>= 1)")
    parser.add_argument("--sizes", default="8m,32m",
                        help=f"comma list from {list(SIZES)} (default 8m,32m: ~3 min on a loaded 2-core box)")
    parser.add_argument("--bucket-mb", type=float, default=32.0,
                        help="hybrid reshard bucket: most MiB one collective outputs (> 0)")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad or not sizes:
        parser.error(f"--sizes: unknown {bad}; choose from {list(SIZES)}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if not args.bucket_mb > 0:
        parser.error("--bucket-mb must be > 0 (e.g. 32)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        shapes = {s: build_shapes(s, Path(tmp)) for s in sizes}
    cases = [(s, shapes[s], train, gen) for s in sizes for train, gen in LAYOUTS]
    meta = default_meta()
    meta.update({"world_size": WORLD, "backend": "gloo (CPU, loopback)", "dtype": "fp32",
                 "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "repeats": args.repeats,
                 "warmup": 1, "timing": "per repeat, to_generation() from the last rank's start to the last "
                                        "rank's end (barrier before); median over repeats; strategies "
                                        "interleaved in an order rotated each repeat",
                 "models": {s: {**SIZES[s], "params": shapes[s].numel} for s in sizes}})
    start = time.perf_counter()
    meta["bucket_mb"] = args.bucket_mb
    results = run_cases(cases, args.repeats, int(args.bucket_mb * (1 << 20)))
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    if hasattr(os, "getloadavg"):
        meta["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    rows = make_rows(cases, results)
    columns = ["model", "params_m", "layout", "strategy", "time_ms", "ratio_vs_hybrid", "back_ms", "recv_MB_max",
               "plan_recv_MB_max", "wire_MB_max", "held_MB_mean", "table2_held_MB", "held_MB_max", "peak_MB_max",
               "scratch_MB_max", "collectives", "messages", "bytes_match_plan", "held_match_plan"]
    json_path, md_path = write_results("transition_cpu", rows, meta, columns, out_dir=args.out)
    png = json_path.with_suffix(".png")
    plot(rows, png)
    for r in rows:
        print(f"{r['model']:>4} {r['layout']:<16} {r['strategy']:<17} {r['time_ms']:9.2f} ms "
              f"x{r['ratio_vs_hybrid']:<5} recv max {r['recv_MB_max']:8.3f} MB (plan {r['plan_recv_MB_max']:8.3f})"
              f" match={r['bytes_match_plan']} held mean {r['held_MB_mean']:8.3f} MB (Table 2 "
              f"{r['table2_held_MB']:8.3f}) match={r['held_match_plan']}")
    print(f"wrote {json_path}, {md_path}, {png}")
    return 0 if all(r["bytes_match_plan"] and r["held_match_plan"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
