"""Weight sync to a rollout pool of its own: LoRA's adapter-only sync against a full sync of the same model.

A local Ray cluster of 4 CPU devices: the actor trains on 2 (TP=2), generation replicas run on the other 2
(rollout.tp=1: 2 replicas). The same model, one run each way, in this process:
- full: a full fine-tuning actor; every sync sends each rollout rank its generation shard (hybrid_engine/bridge.py);
- lora: a LoRA actor (rank r on every decoder linear); the replicas keep their frozen base and each sync sends the
  adapters only (hybrid_engine/lora_sync.py).
Per run: one update, then `sync()` a few times; the bytes each rollout rank received (its `sync_stats`) and the
bytes sent, the sync's wall time, and the ratio lora / full. Also the same ratio for real model shapes from
`hybridrl plan --lora-rank` (no weights).

    python benchmarks/lora_sync.py [--size 56m] [--rank 16] [--syncs 3] [--out benchmarks/results]

Writes lora_sync.json and lora_sync.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._results import default_meta, write_results  # noqa: E402

SIZES = {"small": dict(hidden=128, layers=2, heads=4, kv_heads=2),
         "56m": dict(hidden=512, layers=8, heads=8, kv_heads=4, ffn_hidden=1408)}
PROMPTS = ["vowels: qzkt", "vowels: bcdf", "vowels: rkjm", "vowels: lfkp"]


def run(model: str, lora: dict | None, syncs: int) -> dict:
    import torch

    import hybridrl
    from hybridrl.roles import RolloutReplicas

    train_pool = hybridrl.ResourcePool(devices=2, name="train")
    gen_pool = hybridrl.ResourcePool(devices=2, name="gen")
    try:
        actor = hybridrl.Actor(model=model, parallel={"tp": 2}, rollout={"tp": 1, "max_new_tokens": 4},
                               resource_pool=train_pool, optim={"lr": 1e-3}, lora=lora)
        replicas = RolloutReplicas(actor, gen_pool)
        out = replicas.generate_sequences(PROMPTS, seed=1)
        seconds, sent = [], 0.0
        for i in range(syncs):
            actor.update(actions=out, advantages=torch.randn(len(out), generator=torch.Generator().manual_seed(i)))
            start = time.perf_counter()
            sent = replicas.sync()["sent_bytes"]
            stats = replicas.sync_stats()  # waits for the replicas to take the sync
            seconds.append(time.perf_counter() - start)
        return {"received_bytes_per_rank": max(stats["received_bytes"]), "sent_bytes": sent,
                "shard_bytes": max(stats["shard_bytes"]), "sync_s": statistics.median(seconds)}
    finally:
        train_pool.shutdown()
        gen_pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="56m", choices=sorted(SIZES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from hybridrl.controller import init_local_ray, shutdown_ray
    from hybridrl.hybrid_engine.lora_sync import lora_plan_report
    from hybridrl.models.tiny import create_tiny_model
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    with tempfile.TemporaryDirectory(prefix="lora-sync-") as tmp:
        model = str(create_tiny_model(Path(tmp) / args.size, vocab_size=32000, **SIZES[args.size]))
        shutdown_ray()
        init_local_ray(4)
        try:
            full = run(model, None, args.syncs)
            lora = run(model, {"rank": args.rank, "alpha": 2 * args.rank}, args.syncs)
        finally:
            shutdown_ray()
    ratio = lora["received_bytes_per_rank"] / full["received_bytes_per_rank"]
    rows = [{"model": args.size, "sync": "full", **full}, {"model": args.size, "sync": f"lora r={args.rank}", **lora}]
    print(f"{args.size}: bytes per rollout rank per sync {full['received_bytes_per_rank'] / 2**20:.2f} MiB full -> "
          f"{lora['received_bytes_per_rank'] / 2**20:.3f} MiB adapters only: ratio {ratio:.4f}; sync "
          f"{full['sync_s']:.3f} s -> {lora['sync_s']:.3f} s (CPU, gloo)")
    for preset in ("llama-7b", "llama3-70b"):  # real shapes, rollout TP = training TP = 8, bf16
        report = lora_plan_report(preset, args.rank, None, ParallelLayout(tp=8), GenerationLayout(tp=8), 2)
        projected = report["sync_bytes_per_rollout_rank"] / report["full_sync_bytes_per_rollout_rank"]
        rows.append({"model": preset, "sync": f"lora r={args.rank} (planned, bf16, t_g=8)",
                     "received_bytes_per_rank": report["sync_bytes_per_rollout_rank"],
                     "shard_bytes": report["full_sync_bytes_per_rollout_rank"], "ratio": projected})
        print(f"{preset} (plan, bf16, t_g=8): {report['sync_bytes_per_rollout_rank'] / 2**30:.3f} GiB adapters vs "
              f"{report['full_sync_bytes_per_rollout_rank'] / 2**30:.2f} GiB full per rank: ratio {projected:.4f}")
    rows[1]["ratio"] = ratio
    meta = {**default_meta(), "actor": "tp=2 on 2 CPU devices", "rollout": "2 replicas (tp=1) on 2 CPU devices",
            "dtype": "float32", "lora": f"r={args.rank} on all decoder linears"}
    write_results("lora_sync", rows, meta, out_dir=args.out)


if __name__ == "__main__":
    main()
