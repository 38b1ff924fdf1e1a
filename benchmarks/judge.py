"""The cost of a judge step against a scalar reward model on the same batch, measured in the same run.

One pool of one device holds, colocated, a scalar reward model (a *ForSequenceClassification head) and judges of
the same shape (the same layers, a causal-LM head): each scores the same batch of (prompt, response) pairs from
the bundled task, the judge through the template "{prompt}|{response}=".
  scalar        the reward model's forward (the score at the last token)
  choice        judge, parser choice_logprob over the ten digits: one forward, the LM head at the last position
  regex (k)     judge, parser regex: a verdict of up to k tokens generated (native engine: prefill + k decode
                steps), then parsed on the driver
  regex vllm    the same with vLLM (--vllm; the judge loaded by vLLM itself, on a pool of its own)
Random weights (the shapes are what costs); each case's median seconds over --repeats after a warm-up, and its
ratio to the scalar model's. Writes benchmarks/results/judge.{json,md} (judge_<shape>.* for other shapes).

    python benchmarks/judge.py [--shape tiny|25m] [--batch 64] [--repeats 5] [--vllm]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from benchmarks._results import default_meta, write_results  # noqa: E402
from hybridrl.controller import ResourcePool, init_local_ray, shutdown_ray  # noqa: E402
from hybridrl.data.tasks import charset_oracle, make_charset_rows  # noqa: E402
from hybridrl.data.tokenizer import VOCAB_SIZE, create_char_tokenizer  # noqa: E402
from hybridrl.models.tiny import create_tiny_model  # noqa: E402
from hybridrl.roles import Judge, RewardModel  # noqa: E402

SHAPES = {"tiny": {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 2},  # tiny:charset_judge's
          "25m": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 8}}
TEMPLATE = "{prompt}|{response}="
DIGITS = [str(d) for d in range(10)]


def batch(size: int) -> tuple[list[str], list[str]]:
    """Bundled-task prompts with responses of 16 characters, half right, half random."""
    rows = make_charset_rows(size, seed=3)
    responses = [(charset_oracle(r["prompt"], r["target_set"]) * 4)[:16] if i % 2 else "qz!x" * 4
                 for i, r in enumerate(rows)]
    return [r["prompt"] for r in rows], responses


def models(folder: Path, shape: dict) -> tuple[str, str]:
    """A scalar reward model and a causal-LM judge of the same layers, over the bundled tokenizer."""
    paths = []
    for head in ("seq_cls", "lm"):
        path = create_tiny_model(folder / head, "llama", vocab_size=VOCAB_SIZE, head=head, seed=1, **shape)
        create_char_tokenizer(path)
        paths.append(str(path))
    return paths[0], paths[1]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: KV cache, first-call set-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 16], help="verdict lengths of the regex judge")
    parser.add_argument("--vllm", action="store_true", help="also a vLLM judge on a pool of its own")
    args = parser.parse_args()
    rm_path, judge_path = models(Path(tempfile.mkdtemp(prefix="judge-bench-")), SHAPES[args.shape])
    prompts, responses = batch(args.batch)
    init_local_ray(2 if args.vllm else 1)
    try:
        rows = run_cases(args, rm_path, judge_path, prompts, responses)
    finally:
        shutdown_ray()
    scalar = rows[0]["seconds"]
    for row in rows:
        row["ratio_vs_scalar"] = row["seconds"] / scalar
        print(f"{row['case']:14s} {row['seconds'] * 1e3:9.1f} ms  {row['ratio_vs_scalar']:6.2f}x the scalar model")
    meta = {**default_meta(), "shape": args.shape, **SHAPES[args.shape], "batch": args.batch,
            "repeats": args.repeats, "device": "CPU, 1 worker process"}
    name = "judge" if args.shape == "tiny" else f"judge_{args.shape}"
    write_results(name, rows, meta, columns=["case", "seconds", "ratio_vs_scalar", "verdict_tokens"])


def run_cases(args, rm_path: str, judge_path: str, prompts: list[str], responses: list[str]) -> list[dict]:
    pool = ResourcePool(devices=1, name="bench")
    rm = RewardModel(model=rm_path, resource_pool=pool, micro_batch_size=args.batch, role="scalar")
    rows = [{"case": "scalar", "seconds": timed(lambda: rm.score(prompts, responses), args.repeats),
             "verdict_tokens": 0}]
    choice = Judge(judge_path, TEMPLATE, {"name": "choice_logprob", "choices": DIGITS}, resource_pool=pool,
                   micro_batch_size=args.batch, role="choice")
    rows.append({"case": "choice", "seconds": timed(lambda: choice.score(prompts, responses), args.repeats),
                 "verdict_tokens": 0})
    for tokens in args.tokens:
        judge = Judge(judge_path, TEMPLATE, {"name": "regex"}, resource_pool=pool, role=f"regex{tokens}",
                      generation={"max_new_tokens": tokens, "max_batch_size": args.batch})
        rows.append(_generated(f"regex ({tokens})", judge, prompts, responses, args.repeats))
    if args.vllm:
        other = ResourcePool(devices=1, name="bench_vllm")
        judge = Judge(judge_path, TEMPLATE, {"name": "regex"}, resource_pool=other, role="vllm",
                      generation={"engine": "vllm", "max_new_tokens": max(args.tokens), "max_model_len": 128})
        rows.append(_generated(f"regex vllm ({max(args.tokens)})", judge, prompts, responses, args.repeats))
    return rows


def _generated(case: str, judge: Judge, prompts: list[str], responses: list[str], repeats: int) -> dict:
    seconds = timed(lambda: judge.score(prompts, responses), repeats)
    verdicts = judge.submit(prompts, responses).result().verdicts
    return {"case": case, "seconds": seconds, "verdict_tokens": sum(map(len, verdicts)) / len(verdicts)}


if __name__ == "__main__":
    main()
