"""Generation with LoRA adapters in the native engine: merged weights against adapters in the decode forward.

One process, Megatron on gloo, the native engine's lean forward (rollout/fast_decode.py). Per model: a Llama-shaped
model with rank-r adapters on every decoder linear (B random, so the adapters change the outputs), and three ways
to generate the same greedy tokens (checked equal), interleaved repeat by repeat:
- base: the model without adapters (what either mode is measured against);
- merged: W + BA written into the weights for the transition (models/lora.py MergedWeights: the base kept aside,
  put back bit for bit after; the merge and the restore are timed apart, per transition);
- forward: the adapters applied in every decode step (two small matmuls per adapted projection).

    python benchmarks/lora_generation.py [--sizes small,25m] [--rank 16] [--repeats 5] [--out benchmarks/results]

Writes lora_generation.json and lora_generation.md. Tokens/s are medians over repeats; the ratios, not the
absolute numbers (a shared 2-core CPU), are the point.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._results import default_meta, write_results  # noqa: E402

SIZES = {"small": dict(hidden=128, layers=2, heads=4, kv_heads=2), "25m": dict(hidden=512, layers=8, heads=8, kv_heads=4)}
PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 16, 32


def _model(folder: Path, rank: int):
    import torch

    from hybridrl.config import LoraConfig
    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.models.lora import adapters_of
    from hybridrl.models.lora_io import add_adapters

    hf = load_hf_config(folder)
    model = build_gpt_model(hf, local_spec=True)
    load_hf_weights(model, str(folder), hf)
    add_adapters(model, LoraConfig(rank=rank, alpha=2 * rank), seed=0)
    with torch.no_grad():
        for adapter in adapters_of(model):
            for b in adapter.b:
                b.normal_(0, 0.02)
    return model.eval(), int(hf.vocab_size)


def _generate(engine, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    return time.perf_counter() - start, out["responses"].tolist()


def measure(size: str, rank: int, repeats: int, root: Path) -> dict:
    import torch

    from hybridrl.models.lora import MergedWeights, adapters_disabled
    from hybridrl.models.tiny import create_tiny_model
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.native import NativeRolloutEngine

    folder = root / size
    create_tiny_model(folder, vocab_size=256, **SIZES[size])
    model, vocab = _model(folder, rank)
    engine = NativeRolloutEngine(model, max_model_len=PROMPT_LEN + NEW_TOKENS, vocab_size=vocab, max_batch_size=PROMPTS)
    prompts = torch.randint(3, vocab, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    times: dict[str, list[float]] = {"base": [], "merged": [], "forward": [], "merge_s": []}
    tokens = {}
    for _ in range(repeats + 1):  # the first round warms up
        with adapters_disabled(model):
            seconds, tokens["base"] = _generate(engine, prompts, params)
        times["base"].append(seconds)
        start = time.perf_counter()
        merged = MergedWeights(model)
        merge_s = time.perf_counter() - start
        seconds, tokens["merged"] = _generate(engine, prompts, params)
        start = time.perf_counter()
        merged.restore()
        times["merge_s"].append(merge_s + time.perf_counter() - start)
        times["merged"].append(seconds)
        seconds, tokens["forward"] = _generate(engine, prompts, params)
        times["forward"].append(seconds)
    assert tokens["merged"] == tokens["forward"], "merged and forward generations differ"
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    count = PROMPTS * NEW_TOKENS
    return {"model": size, "rank": rank, "base_tok_s": count / med["base"], "merged_tok_s": count / med["merged"],
            "forward_tok_s": count / med["forward"], "merge_restore_s": med["merge_s"],
            "forward_vs_merged": med["merged"] / med["forward"], "merged_vs_base": med["base"] / med["merged"],
            "same_tokens_as_base": tokens["base"] == tokens["merged"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="small,25m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from hybridrl.parallel.distributed import free_port, init_distributed, initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout

    init_distributed(0, 1, "127.0.0.1", free_port())
    initialize_model_parallel(ParallelLayout())
    rows = []
    with tempfile.TemporaryDirectory(prefix="lora-generation-") as tmp:
        for size in args.sizes.split(","):
            row = measure(size, args.rank, args.repeats, Path(tmp))
            rows.append(row)
            print(f"{size} r={args.rank}: base {row['base_tok_s']:.0f} tok/s, merged {row['merged_tok_s']:.0f} "
                  f"(+{row['merge_restore_s'] * 1e3:.1f} ms merge+restore per transition), forward "
                  f"{row['forward_tok_s']:.0f}: forward / merged speed {row['forward_vs_merged']:.2f}", flush=True)
    meta = {**default_meta(), "prompts": PROMPTS, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
            "threads": os.environ["OMP_NUM_THREADS"], "targets": "all decoder linears", "decoding": "greedy"}
    write_results("lora_generation", rows, meta, out_dir=args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
