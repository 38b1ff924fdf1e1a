"""Fully sharded data parallel: resident parameter + gradient + optimizer bytes per rank, measured (CPU, gloo).

For dp = 2 and 4 (tp = 1, one process per rank) a Llama-shaped model (fp32, Adam) takes one optimizer step at
each parallel.fsdp setting, in the same processes one after another; then every tensor storage reachable from
the rank's model and optimizer (parameters, gradients, Megatron's buffers, Adam's moments; a sharded tensor's
local piece; each storage once) is summed (hybridrl/workers/sharding.py resident_bytes). The baseline is the
unsharded run: Megatron DDP with the plain optimizer (use_distributed_optimizer=false: every rank holds the
parameters, gradients and both Adam moments, 16 bytes per parameter); no_shard with the distributed optimizer
(the default, ZeRO-1) is listed too. ratio = bytes / unsharded bytes; full_shard should be ~1/dp. After a
forward-only pass (log-probs), shard_grad_op's gathered parameters are released again (after_forward_MB).

    python benchmarks/fsdp_memory.py [--size 16m] [--out benchmarks/results]

Writes fsdp_memory.json and fsdp_memory.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._results import default_meta, write_results  # noqa: E402

# Llama-shaped sizes (fp32 parameters); tiny_hf_config arguments
SIZES = {"4m": dict(vocab_size=4096, hidden=256, layers=2, heads=8, kv_heads=4, ffn_hidden=704),
         "16m": dict(vocab_size=8192, hidden=512, layers=4, heads=8, kv_heads=4, ffn_hidden=1408)}
# (label, parallel.fsdp, optim.use_distributed_optimizer)
SETTINGS = [("no_shard (DDP, plain Adam)", "no_shard", False), ("no_shard (DDP, distributed Adam)", "no_shard", True),
            ("shard_grad_op", "shard_grad_op", False), ("full_shard", "full_shard", False)]


def _batch(rows: int, vocab: int):
    import torch

    from hybridrl.protocol import Batch

    gen = torch.Generator().manual_seed(0)
    prompts, responses = torch.randint(3, vocab, (rows, 16), generator=gen), torch.randint(3, vocab, (rows, 16),
                                                                                          generator=gen)
    mask = torch.ones(rows, 32, dtype=torch.long)
    return Batch({"prompts": prompts, "responses": responses, "attention_mask": mask,
                  "response_mask": mask[:, 16:].clone(), "advantages": torch.randn(rows, 16, generator=gen)})


def _measure(model_dir: str, world: int, fsdp: str, distributed: bool, vocab: int) -> dict:
    import torch

    from hybridrl.config import OptimConfig
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.workers.megatron_model import MegatronModel
    from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms, response_log_probs
    from hybridrl.workers.sharding import resident_bytes

    layout = ParallelLayout(dp=world, fsdp=fsdp)
    initialize_model_parallel(layout)
    model = MegatronModel(model_dir, optim=OptimConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=distributed),
                          fsdp=fsdp, micro_batch_size=2)
    params = sum(p.numel() for p in model.inner.parameters()) if fsdp == "no_shard" else None
    data = _batch(2 * world, vocab).chunk(world)[torch.distributed.get_rank()]
    model.train_epochs(data, lambda mb, out: actor_loss_terms(mb, out, model.vocab_size, None, PolicyLossConfig()),
                       ["response_mask", "advantages"])
    after_step = resident_bytes(model.model, model.optimizer)
    model.forward(data, lambda mb, out: response_log_probs(mb, out, model.vocab_size, None)[0],
                  {"response_mask": data["response_mask"]})
    after_forward = resident_bytes(model.model, model.optimizer)
    return {"params": params, "after_step": after_step, "after_forward": after_forward}


def _rank_main(rank: int, world: int, port: int, model_dir: str, vocab: int, queue) -> None:
    import torch

    torch.set_num_threads(1)
    from hybridrl.parallel.distributed import init_distributed

    init_distributed(rank, world, "127.0.0.1", port)
    results = {label: _measure(model_dir, world, fsdp, distributed, vocab)
               for label, fsdp, distributed in SETTINGS}
    torch.distributed.barrier()
    queue.put((rank, results))
    torch.distributed.destroy_process_group()


def run_world(world: int, model_dir: str, vocab: int) -> dict[int, dict]:
    from hybridrl.parallel.distributed import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, model_dir, vocab, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="16m")
    parser.add_argument("--dp", default="2,4", help="comma-separated data-parallel sizes")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    from hybridrl.models.tiny import create_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(create_tiny_model(Path(tmp) / "model", "llama", seed=0, **SIZES[args.size]))
        for world in (int(d) for d in args.dp.split(",")):
            results = run_world(world, model_dir, SIZES[args.size]["vocab_size"])
            params = results[0][SETTINGS[0][0]]["params"]
            base = max(r[SETTINGS[0][0]]["after_step"] for r in results.values())
            for label, fsdp, _ in SETTINGS:
                held = max(r[label]["after_step"] for r in results.values())  # the most-loaded rank
                after_forward = max(r[label]["after_forward"] for r in results.values())
                rows.append({"dp": world, "setting": label, "params": params, "MB_per_rank": held / 2**20,
                             "ratio_to_unsharded": held / base, "one_over_dp": 1 / world,
                             "after_forward_MB": after_forward / 2**20, "bytes_per_param": held / params})
                print(f"dp={world} {label:34s} {held / 2**20:8.2f} MB/rank  ratio {held / base:.3f} "
                      f"(1/dp = {1 / world:.3f})  after a forward-only pass {after_forward / 2**20:8.2f} MB")
    meta = {**default_meta(), "model": f"llama {args.size} fp32 ({SIZES[args.size]})", "tp": 1,
            "optimizer": "adam", "measured": "tensor storages reachable from the rank's model and optimizer, after "
                                            "one step (max over ranks)"}
    json_path, md_path = write_results("fsdp_memory", rows, meta, out_dir=args.out,
                                       columns=["dp", "setting", "MB_per_rank", "ratio_to_unsharded", "one_over_dp",
                                                "after_forward_MB", "bytes_per_param"])
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
