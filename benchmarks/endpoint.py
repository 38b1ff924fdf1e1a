"""The agent endpoint's overhead: requests/s and generated tokens/s through the OpenAI-compatible endpoint
(rollout/endpoint.py) under 1, 8 and 64 concurrent agents, against the same engine's batch generate on the same
prompts, in one run.

One local Ray device, the actor at TP=1 with the native engine in its generation layout (one transition, then
only generate calls are timed). The same --prompts prompts (the bundled task's, as token ids) get exactly
--new-tokens tokens each (ignore_eos):

    generate   actor.generate_turn on the prompts in batches of `concurrency` (what batching can at best give)
    endpoint   --prompts agent runs, `concurrency` at once (rollout.agent_concurrency), each one
               `client.completions.create(prompt=<token ids>)` through the official openai client: HTTP, the
               run's bookkeeping and the endpoint's batching of concurrent requests into generate calls

ratio = endpoint tokens/s / generate tokens/s (1.0: no overhead). Each point is the best of --repeats after a
warm-up. `calls` is the mean number of generate calls the endpoint made per repeat (batching at work: with 64
agents ideally 1). Model sizes: tiny (the bundled 2-layer hidden-64 model) and 25m (8 layers, hidden 512, where
generation costs more and the endpoint's fixed costs weigh less).

    python benchmarks/endpoint.py                  # writes benchmarks/results/endpoint.{json,md}
    python benchmarks/endpoint.py --sizes tiny --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from _results import default_meta, write_results  # noqa: E402

SIZES = {"tiny": None, "25m": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "ffn_hidden": 1536}}
CONCURRENCY = (1, 8, 64)
NEW_TOKENS = 32  # set from --new-tokens; the agents read it


async def one_completion(client, row):
    """The benchmark's agent: one completion of the row's token ids, exactly NEW_TOKENS tokens."""
    response = await client.completions.create(model="policy", prompt=row["ids"], max_tokens=NEW_TOKENS,
                                               extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == NEW_TOKENS
    return 0.0


def model_for(size: str, folder: Path) -> str | None:
    if SIZES[size] is None:
        return None
    from hybridrl.data.tokenizer import VOCAB_SIZE, create_char_tokenizer
    from hybridrl.models.tiny import create_tiny_model

    path = create_tiny_model(folder / size, "llama", vocab_size=VOCAB_SIZE, seed=0, **SIZES[size])
    create_char_tokenizer(path)
    return str(path)


def measure(size: str, prompts: int, repeats: int, folder: Path) -> list[dict]:
    import hybridrl
    from hybridrl.config import EndpointConfig
    from hybridrl.data.loader import collate_prompts
    from hybridrl.data.dataset import PromptRow
    from hybridrl.data.tasks import task_train_file
    from hybridrl.rollout.agent import AgentRunner, AgentSettings
    from hybridrl.rollout.agent_trace import TraceLimits

    pool = hybridrl.ResourcePool(devices=1)
    try:
        actor = hybridrl.Actor(model=model_for(size, folder), parallel={"tp": 1}, resource_pool=pool,
                               rollout={"max_new_tokens": NEW_TOKENS, "max_model_len": 64 + NEW_TOKENS,
                                        "max_batch_size": 64})
        texts = [json.loads(line)["prompt"] for line in open(task_train_file())][:prompts]
        ids = [actor.tokenizer(t)["input_ids"] for t in texts]
        batch = collate_prompts([PromptRow(i, row, t, {"ids": row}) for i, (row, t) in enumerate(zip(ids, texts))], 0)
        params = actor.sampling_params({"ignore_eos": True, "seed": 1})
        rows = []
        for concurrency in CONCURRENCY:
            settings = AgentSettings(concurrency, 600.0, None, EndpointConfig(), scored_elsewhere=False)
            runner = AgentRunner("__main__:one_completion", settings, actor.tokenizer, False,
                                 TraceLimits(1, NEW_TOKENS, NEW_TOKENS, 64 + NEW_TOKENS), size)
            calls = []
            real = actor.generate_turn

            def counting(prompt_ids, p, real=real):
                calls.append(len(prompt_ids))
                return real(prompt_ids, p)
            try:
                with actor.generation():  # warm-up, then the baseline
                    for chunk in range(0, prompts, concurrency):
                        actor.generate_turn(ids[chunk:chunk + concurrency], params)
                    generate_s = min(_timed(lambda: [actor.generate_turn(ids[c:c + concurrency], params)
                                                     for c in range(0, prompts, concurrency)]) for _ in range(repeats))
                actor.generate_turn = counting
                runner.run(actor, batch, [{"seed": 1}])  # warm-up (starts the server)
                calls.clear()
                endpoint_s = min(runner.run(actor, batch, [{"seed": 1}])[0].sequences.meta["timing"]["agent"]
                                 for _ in range(repeats))
            finally:
                actor.generate_turn = real
                runner.close()
            tokens = prompts * NEW_TOKENS
            rows.append({"size": size, "concurrency": concurrency, "prompts": prompts, "new_tokens": NEW_TOKENS,
                         "generate_req_s": prompts / generate_s, "generate_tok_s": tokens / generate_s,
                         "endpoint_req_s": prompts / endpoint_s, "endpoint_tok_s": tokens / endpoint_s,
                         "ratio": generate_s / endpoint_s, "calls": len(calls) / repeats,
                         "rows_per_call": sum(calls) / max(len(calls), 1)})
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        pool.shutdown()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    global NEW_TOKENS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,25m", help="comma list of: " + ", ".join(SIZES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stem", default="endpoint")
    args = parser.parse_args()
    NEW_TOKENS = args.new_tokens
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(s not in SIZES for s in sizes):
        parser.error(f"--sizes: choose from {list(SIZES)}")
    from hybridrl.controller import init_local_ray, shutdown_ray

    init_local_ray(1)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            for size in sizes:
                rows += measure(size, args.prompts, args.repeats, Path(folder))
    finally:
        shutdown_ray()
    meta = {**default_meta(), "device": "cpu", "engine": "native", "prompts": args.prompts,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "client": "openai (AsyncOpenAI, completions)"}
    json_path, md_path = write_results(args.stem, rows, meta, columns=[
        "size", "concurrency", "generate_req_s", "endpoint_req_s", "generate_tok_s", "endpoint_tok_s", "ratio",
        "calls", "rows_per_call"])
    print(md_path.read_text())


if __name__ == "__main__":
    main()
