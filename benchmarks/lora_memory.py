"""LoRA memory benchmark: gradient + optimizer bytes per rank, LoRA against full fine-tuning of the same model.

Two gloo ranks (DP=2, Megatron DDP + distributed optimizer, as the actor trains), one Llama-shaped model per row
(random weights, a 32k vocabulary, created once), fp32 and bf16 (Megatron's mixed precision: fp32 main params in the optimizer).
Each rank builds the actor's MegatronModel twice, full fine-tuning and LoRA (rank r on every decoder linear),
runs one real update (so Adam's states exist), and counts what it holds for training:
- gradient bytes: Megatron DDP's gradient buffers (fp32: grad_reduce_in_fp32);
- optimizer bytes: Adam's exp_avg / exp_avg_sq shards plus, in bf16, the fp32 main-parameter shards.
The ratio LoRA / full is printed beside adapter params / all params (the expectation).

    python benchmarks/lora_memory.py [--sizes 56m,125m] [--rank 16] [--out benchmarks/results]

Writes lora_memory.json and lora_memory.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._results import default_meta, write_results  # noqa: E402

WORLD = 2
SIZES = {"56m": dict(hidden=512, layers=8, heads=8, kv_heads=4, ffn_hidden=1408),
         "125m": dict(hidden=768, layers=12, heads=12, kv_heads=4, ffn_hidden=2048)}


def _training_bytes(model) -> dict[str, int]:
    """Gradient-buffer and optimizer-state bytes this rank holds (after a step)."""
    ddp = model.model
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers + ddp.expert_parallel_buffers)
    state = 0
    for opt in getattr(model.optimizer, "chained_optimizers", [model.optimizer]):
        for per_param in opt.optimizer.state.values():
            state += sum(t.numel() * t.element_size() for t in per_param.values() if hasattr(t, "numel"))
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            state += sum(p.numel() * p.element_size() for p in group)
    params = sum(p.numel() for p in model.inner.parameters())
    trained = sum(p.numel() for p in model.inner.parameters() if p.requires_grad)
    return {"grad_bytes": grads, "optim_bytes": state, "params": params, "trained_params": trained}


def _worker(rank: int, port: int, path: str, dtype: str, rank_r: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from hybridrl.config import LoraConfig, OptimConfig
    from hybridrl.parallel.distributed import init_distributed, initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.protocol import Batch
    from hybridrl.workers.megatron_model import MegatronModel
    from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms

    init_distributed(rank, WORLD, "127.0.0.1", port)
    initialize_model_parallel(ParallelLayout(dp=WORLD))
    g = torch.Generator().manual_seed(rank)
    data = Batch({"prompts": torch.randint(1, 60, (2, 8), generator=g), "responses": torch.randint(1, 60, (2, 8), generator=g),
                  "attention_mask": torch.ones(2, 16, dtype=torch.long), "response_mask": torch.ones(2, 8, dtype=torch.long),
                  "advantages": torch.randn(2, 8, generator=g)})
    result = {}
    for label, lora in (("full", None), ("lora", LoraConfig(rank=rank_r, alpha=2 * rank_r))):
        model = MegatronModel(path, dtype=dtype, optim=OptimConfig(lr=1e-4), lora=lora)
        cfg = PolicyLossConfig()
        model.train_step(data, lambda mb, o: actor_loss_terms(mb, o, model.vocab_size, None, cfg),
                         {k: data[k] for k in ("response_mask", "advantages")})
        result[label] = _training_bytes(model)
        del model
    if rank == 0:
        torch.save(result, out)
    torch.distributed.destroy_process_group()


def measure(size: str, dtype: str, rank_r: int, root: Path) -> dict:
    import torch
    import torch.multiprocessing as mp

    from hybridrl.models.tiny import create_tiny_model
    from hybridrl.parallel.distributed import free_port

    spec = dict(SIZES[size])
    folder = root / size
    if not (folder / "config.json").is_file():
        create_tiny_model(folder, vocab_size=32000, hidden=spec.pop("hidden"), layers=spec.pop("layers"),
                          heads=spec.pop("heads"), kv_heads=spec.pop("kv_heads"), **spec)
    out = root / f"{size}-{dtype}.pt"
    mp.spawn(_worker, args=(free_port(), str(folder), dtype, rank_r, str(out)), nprocs=WORLD, join=True)
    got = torch.load(out)
    full, lora = got["full"], got["lora"]
    full_total = full["grad_bytes"] + full["optim_bytes"]
    lora_total = lora["grad_bytes"] + lora["optim_bytes"]
    return {"model": size, "dtype": dtype, "params": full["params"], "adapter_params": lora["trained_params"],
            "full_grad_MB": full["grad_bytes"] / 2**20, "full_optim_MB": full["optim_bytes"] / 2**20,
            "lora_grad_MB": lora["grad_bytes"] / 2**20, "lora_optim_MB": lora["optim_bytes"] / 2**20,
            "ratio": lora_total / full_total, "adapter_share": lora["trained_params"] / full["params"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="56m,125m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="lora-memory-") as tmp:
        for size in args.sizes.split(","):
            for dtype in ("float32", "bfloat16"):
                row = measure(size, dtype, args.rank, Path(tmp))
                rows.append(row)
                print(f"{size} {dtype}: grad+optimizer per rank {row['full_grad_MB'] + row['full_optim_MB']:.1f} MB "
                      f"full -> {row['lora_grad_MB'] + row['lora_optim_MB']:.2f} MB LoRA r={args.rank}: ratio "
                      f"{row['ratio']:.4f} (adapter params / all params {row['adapter_share']:.4f})", flush=True)
    meta = {**default_meta(), "world": WORLD, "layout": "dp=2, distributed optimizer", "lora_rank": args.rank,
            "targets": "all decoder linears"}
    write_results("lora_memory", rows, meta, out_dir=args.out)


if __name__ == "__main__":
    main()
