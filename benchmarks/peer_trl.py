"""Peer benchmark: hybridrl GRPO vs Hugging Face TRL's GRPOTrainer on the identical CPU job (issue 12).

The job: a deterministic Llama (small: hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV heads; 25m:
hidden 512, intermediate 1536, 8 layers, 8 heads, 4 KV heads), fp32, over a 24-word word-level tokenizer;
a prompt set of "warm : ..." / "cold : ..." lines and a rule reward (the fraction of response words from
the named set, over at least 4 words); GRPO with 16 prompts x 4 samples a step, exactly 32 new tokens
(TRL: min_new_tokens=32; hybridrl: rollout.ignore_eos=true), temperature 1, lr 1e-3, beta / KL coef 0,
one update per batch, 2 intra-op threads, OMP_WAIT_POLICY=PASSIVE on both sides.

Both sides load the same Hugging Face checkpoint, tokenizer and prompt file from benchmarks/.cache/peer_trl/
(gitignored; created deterministically on first use) and score with the same function (`word_reward`).

- TRL runs in a venv this script creates (benchmarks/.venv-trl/, gitignored) with pinned trl /
  transformers / CPU torch (versions go into the results): GRPOTrainer with use_cpu, bf16 off, gradient
  checkpointing off, num_generations 4, per_device_train_batch_size 64, max_completion_length 32.
- hybridrl runs `hybridrl train configs/grpo_tiny.yaml key=value ...` on a local Ray cluster: layout
  "tp1" (1 device, native engine, no reshard) and "tp2->1" (2 devices: training TP=2, generation TP=1,
  3D-HybridEngine), ppo_epochs 1, one mini-batch (the old-log-prob pass is skipped), no reference.

Each side runs in its own subprocess; sides are interleaved within one run (per size: TRL, hybridrl tp1,
hybridrl tp2->1; `--rounds R` repeats the cycle). tokens/s = (prompt + response tokens of the sampled
sequences, steps 2..N) / (seconds of steps 2..N); step 1 (warm-up, lazy allocations) is excluded. The
per-stage breakdown is the mean over steps 2..N (hybridrl: time/<stage> of RUN/metrics.jsonl; TRL:
generation, reward, the rest of the rollout, the forward/backward and the optimizer step, timed with
wrappers and callbacks). Peak RSS sums the resident memory of the side's whole process tree (driver,
raylet/GCS and every Ray worker), sampled by a psutil thread every 0.2 s.

    python benchmarks/peer_trl.py                       # both sizes, both layouts (~15-20 min on 2 cores)
    python benchmarks/peer_trl.py --quick               # small model only, 6 steps, tp1
    python benchmarks/peer_trl.py --sizes small --steps 10 --layouts tp1
    hybridrl bench peer_trl --sizes 25m --steps 4
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
CACHE = BENCH_DIR / ".cache" / "peer_trl"
VENV = BENCH_DIR / ".venv-trl"
RESULTS = BENCH_DIR / "results"
logger = logging.getLogger("benchmarks.peer_trl")

# ---- the job -------------------------------------------------------------------------------------
TRL_PINS = {"trl": "1.16.0", "transformers": "5.19.0", "torch": "2.13.0"}
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SIZES: dict[str, dict[str, int]] = {
    "small": {"hidden": 128, "ffn_hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2},
    "25m": {"hidden": 512, "ffn_hidden": 1536, "layers": 8, "heads": 8, "kv_heads": 4},
}
DEFAULT_STEPS = {"small": 20, "25m": 6}
LAYOUTS = ("tp1", "tp2->1")
JOB = {"prompts_per_step": 16, "samples_per_prompt": 4, "new_tokens": 32, "lr": 1e-3, "beta": 0.0,
       "temperature": 1.0, "threads": 2, "seed": 0, "max_prompt_length": 16, "clip_ratio": 0.2,
       "clip_grad": 1.0}
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
WORD_SETS: dict[str, tuple[str, ...]] = {
    "warm": ("sun", "fire", "tea", "sand", "lamp", "oven", "soup", "wool"),
    "cold": ("ice", "snow", "frost", "hail", "sleet", "lake", "wind", "mist"),
}
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + ("warm", "cold", ":", "and") + WORD_SETS["warm"] + WORD_SETS["cold"]
assert len(VOCAB) == 24 and len(set(VOCAB)) == 24  # a multiple of 8: no Megatron vocab padding at TP <= 8


def word_reward(prompt: str, response: str, target: str | None = None, min_words: int = 4, **_: Any) -> float:
    """The rule reward both sides use: the fraction of response words in the set the prompt names
    ("warm" or "cold", its first word, or the row column `target`), over max(#words, min_words)."""
    name = target if target is not None else prompt.split()[0]
    allowed = WORD_SETS[name]
    words = response.split()
    return sum(1 for word in words if word in allowed) / max(len(words), min_words, 1)


def make_rows(num_rows: int = 1024, seed: int = 0) -> list[dict[str, Any]]:
    """Deterministic prompts "<set> : w1 .. wk" (k = 3..8 words drawn from both sets and "and")."""
    import random

    rng = random.Random(seed)
    pool = list(WORD_SETS["warm"] + WORD_SETS["cold"]) + ["and"]
    rows = []
    for index in range(num_rows):
        name = ("warm", "cold")[index % 2]
        words = " ".join(rng.choice(pool) for _ in range(rng.randint(3, 8)))
        rows.append({"prompt": f"{name} : {words}", "target": name, "id": index})
    rng.shuffle(rows)
    return rows


def write_tokenizer(out_dir: Path) -> None:
    """A word-level tokenizer over VOCAB (whitespace split, <s> prepended like Llama's, words joined by
    spaces on decode), saved so AutoTokenizer loads it identically in both environments."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                             special_tokens=[("<s>", vocab["<s>"])])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 4096, "padding_side": "left"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")


def prepare_job(size: str, cache: Path = CACHE) -> dict[str, str]:
    """Create (once) cache/<size>/{model,train.jsonl}: the HF checkpoint + tokenizer and the prompt file
    both sides read. Returns {"model": dir, "data": file, "weights_sha256": ...}."""
    import hashlib

    target = cache / size
    model_dir, data = target / "model", target / "train.jsonl"
    if not (model_dir / "model.safetensors").is_file() or not (model_dir / "tokenizer.json").is_file():
        sys.path.insert(0, str(ROOT))
        from hybridrl.models.tiny import create_tiny_model

        import shutil

        tmp = target / "model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        create_tiny_model(tmp, vocab_size=len(VOCAB), seed=JOB["seed"], max_positions=128, **SIZES[size])
        write_tokenizer(tmp)
        shutil.rmtree(model_dir, ignore_errors=True)
        os.replace(tmp, model_dir)
    if not data.is_file():
        data.write_text("".join(json.dumps(row) + "\n" for row in make_rows(seed=JOB["seed"])))
    digest = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    return {"model": str(model_dir), "data": str(data), "weights_sha256": digest}


def count_tokens_per_s(steps: list[dict], skip: int = 1) -> tuple[float, float, float]:
    """(tokens, seconds, tokens/s) over steps[skip:]: each step a dict with prompt_tokens,
    response_tokens (summed over the step's sampled sequences) and seconds."""
    timed = steps[skip:]
    tokens = sum(s["prompt_tokens"] + s["response_tokens"] for s in timed)
    seconds = sum(s["seconds"] for s in timed)
    return tokens, seconds, tokens / seconds if seconds > 0 else float("nan")


# ---- process-tree memory -------------------------------------------------------------------------
class TreeSampler(threading.Thread):
    """Samples the summed RSS of a process and all its descendants every `interval` s (the process list is
    refreshed every second); keeps the peak,
    the most processes seen, and the environment (PYTHONPATH, OMP_*) of the Ray worker processes."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_rss = 0
        self.max_procs = 0
        self.worker_env: dict[str, str] = {}
        self.loads: list[float] = []  # 1-min load average, once a second
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        procs, found_at = [root], 0.0
        while not self._halt.is_set():
            if time.monotonic() - found_at > 1.0:  # walking /proc for descendants costs more than sampling them
                try:
                    procs = [root] + root.children(recursive=True)
                except psutil.NoSuchProcess:
                    break
                found_at = time.monotonic()
                self.loads.append(os.getloadavg()[0])
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                    name = "" if self.worker_env else proc.name()
                    if name.startswith("ray::") and "Agent" not in name:
                        env = proc.environ()
                        self.worker_env = {k: env.get(k, "") for k in ("PYTHONPATH", "OMP_NUM_THREADS",
                                                                        "OMP_WAIT_POLICY")}
                        self.worker_env["process"] = name
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.peak_rss = max(self.peak_rss, total)
            self.max_procs = max(self.max_procs, len(procs))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2)


def run_side(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> dict[str, Any]:
    """Run one side's subprocess with the tree sampler; raise with the log's tail when it fails."""
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        finally:
            sampler.stop()
    if rc != 0:
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {rc}); log {log_path}:\n{tail}")
    return {"wall_s": time.perf_counter() - start, "peak_rss_mib": sampler.peak_rss / 2**20,
            "processes": sampler.max_procs, "worker_env": sampler.worker_env,
            "load_mean": sum(sampler.loads) / len(sampler.loads) if sampler.loads else float("nan"),
            "load_max": max(sampler.loads, default=float("nan"))}


def side_env(threads: int, pythonpath: str | None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE", MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if pythonpath is None:
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = pythonpath
    return env


# ---- TRL side ------------------------------------------------------------------------------------
def _venv_python() -> Path:
    return VENV / "bin" / "python"


def _reachable(url: str, timeout: float = 3.0) -> bool:
    from urllib.parse import urlparse

    host = urlparse(url).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def ensure_trl_venv() -> dict[str, str]:
    """Create benchmarks/.venv-trl (once) with the pinned packages; return the installed versions."""
    python = _venv_python()
    probe = ("import json, torch, transformers, trl, accelerate, datasets; print(json.dumps({'trl': trl.__version__, "
             "'transformers': transformers.__version__, 'torch': torch.__version__, "
             "'accelerate': accelerate.__version__, 'datasets': datasets.__version__}))")
    if python.is_file():
        found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        if found.returncode == 0:
            versions = json.loads(found.stdout.strip().splitlines()[-1])
            if all(versions[k].split("+")[0] == v for k, v in TRL_PINS.items()):
                return versions
    logger.info("creating %s (trl %s, transformers %s, torch %s CPU)", VENV, *TRL_PINS.values())
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    # the CPU wheel index when reachable; else a local wheel (PIP_FIND_LINKS) or the default index
    if _reachable(TORCH_CPU_INDEX):
        pip += ["--extra-index-url", TORCH_CPU_INDEX]
    pip += [f"{name}=={version}" for name, version in TRL_PINS.items()] + ["psutil"]
    subprocess.run(pip, check=True)
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(found.stdout.strip().splitlines()[-1])


def trl_worker(args: argparse.Namespace) -> None:
    """Runs inside the TRL venv (no hybridrl import): GRPOTrainer on the job; writes per-step records."""
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(JOB["seed"])
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "target": r["target"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    per_step = JOB["prompts_per_step"] * JOB["samples_per_prompt"]

    def reward(prompts, completions, target, **_):
        return [word_reward(p, c, target=t) for p, c, t in zip(prompts, completions, target)]

    config = GRPOConfig(
        output_dir=args.out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=per_step, gradient_accumulation_steps=1, num_generations=JOB["samples_per_prompt"],
        num_iterations=1, max_completion_length=JOB["new_tokens"], generation_kwargs={"min_new_tokens": JOB["new_tokens"]},
        temperature=JOB["temperature"], top_p=1.0, top_k=0, beta=JOB["beta"], epsilon=JOB["clip_ratio"],
        learning_rate=JOB["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=JOB["clip_grad"], max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", seed=JOB["seed"], data_seed=JOB["seed"], dataloader_num_workers=0,
        remove_unused_columns=False, disable_tqdm=True, log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)

    clock = time.perf_counter
    current: dict[str, float] = {}
    steps: list[dict] = []

    def timed(name: str, fn):
        def wrapper(*a, **k):
            start = clock()
            try:
                return fn(*a, **k)
            finally:
                current[name] = current.get(name, 0.0) + clock() - start
        return wrapper

    generate_and_score = trainer._generate_and_score_completions

    def rollout(inputs):
        start = clock()
        out = generate_and_score(inputs)
        current["rollout"] = current.get("rollout", 0.0) + clock() - start
        current["prompt_tokens"] = float(out["prompt_mask"].sum())
        current["response_tokens"] = float(out["completion_mask"].sum())
        current["sequences"] = float(out["completion_mask"].shape[0])
        current["response_len_min"] = float(out["completion_mask"].sum(-1).min())
        return out

    trainer._generate_and_score_completions = rollout
    trainer._generate_single_turn = timed("generation", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            current.clear()
            current["_start"] = clock()

        def on_pre_optimizer_step(self, *_, **__):
            current["_opt"] = clock()

        def on_optimizer_step(self, *_, **__):
            current["optimizer"] = clock() - current.pop("_opt")

        def on_step_end(self, *_, **__):
            record = dict(current)
            record["seconds"] = clock() - record.pop("_start")
            steps.append(record)

    trainer.add_callback(StepTimes())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for record, log in zip(steps, logs):
        record["reward_mean"] = float(log["reward"])
    import transformers
    import trl

    Path(args.out).write_text(json.dumps({"steps": steps, "threads": torch.get_num_threads(),
                                          "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                                       "torch": torch.__version__}}))


def trl_stages(record: dict) -> dict[str, float]:
    """TRL's step split into generation / reward / other rollout / forward+backward / optimizer."""
    rollout = record.get("rollout", 0.0)
    gen, rew, opt = record.get("generation", 0.0), record.get("reward", 0.0), record.get("optimizer", 0.0)
    return {"generation": gen, "reward": rew, "rollout_other": rollout - gen - rew,
            "fwd_bwd": record["seconds"] - rollout - opt, "optimizer": opt}


# ---- hybridrl side -------------------------------------------------------------------------------
def hybridrl_overrides(job: dict[str, str], layout: str, steps: int, run_dir: Path) -> list[str]:
    tp = 2 if layout == "tp2->1" else 1
    return [f"actor.model.path={job['model']}", f"data.train_files=[{job['data']}]", "data.shuffle=true",
            f"data.batch_size={JOB['prompts_per_step']}", f"data.max_prompt_length={JOB['max_prompt_length']}",
            f"data.seed={JOB['seed']}", "reward.fn=peer_trl:word_reward", "algorithm.name=grpo",
            f"algorithm.clip_ratio={JOB['clip_ratio']}", "algorithm.kl.coef=0.0", "algorithm.ppo_epochs=1",
            "algorithm.mini_batch_size=null", f"actor.optim.lr={JOB['lr']}", f"actor.optim.clip_grad={JOB['clip_grad']}",
            f"actor.parallel.tp={tp}", f"resources.devices={tp}", "rollout.engine=native", "rollout.tp=1",
            f"rollout.n={JOB['samples_per_prompt']}", f"rollout.temperature={JOB['temperature']}",
            f"rollout.max_new_tokens={JOB['new_tokens']}", "rollout.ignore_eos=true", f"trainer.steps={steps}",
            f"trainer.seed={JOB['seed'] + 1}", f"trainer.run_dir={run_dir}", "trainer.trackers=[]",
            "trainer.progress_bar=false", "trainer.save_every=0"]


def hybridrl_steps(run_dir: Path) -> list[dict]:
    per_step = JOB["prompts_per_step"] * JOB["samples_per_prompt"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = []
    for rec in records:
        stages = {k[len("time/"):]: v for k, v in rec.items() if k.startswith("time/") and k != "time/step"}
        steps.append({"seconds": rec["time/step"], "prompt_tokens": rec["prompt_length_mean"] * per_step,
                      "response_tokens": rec["response_length_mean"] * per_step, "reward_mean": rec["reward_mean"],
                      "stages": stages})
    return steps


def hybridrl_stages(record: dict) -> dict[str, float]:
    """Stages of one step; generation excludes the transition (reported on its own), `other` is the rest."""
    stages = dict(record["stages"])
    out = {"transition": stages.pop("transition", 0.0)}
    out["generation"] = stages.pop("generation", 0.0) - out["transition"]
    out.update(stages)
    out["other"] = record["seconds"] - sum(out.values())
    return out


# ---- driver --------------------------------------------------------------------------------------
def mean_stages(steps: list[dict], split) -> dict[str, float]:
    timed = steps[1:] or steps
    keys = list(dict.fromkeys(k for s in timed for k in split(s)))
    return {k: sum(split(s).get(k, 0.0) for s in timed) / len(timed) for k in keys}


def summarize(side: str, size: str, layout: str, steps: list[dict], proc: dict, split) -> dict[str, Any]:
    tokens, seconds, tps = count_tokens_per_s(steps)
    stages = mean_stages(steps, split)
    step_s = seconds / max(len(steps) - 1, 1)
    row = {"size": size, "side": side, "layout": layout, "steps": len(steps), "tokens_per_s": tps,
           "step_s": step_s, "tokens_timed": tokens, "seconds_timed": seconds,
           "peak_rss_mib": proc["peak_rss_mib"], "processes": proc["processes"], "wall_s": proc["wall_s"],
           "load_mean": proc["load_mean"], "load_max": proc["load_max"],
           "reward_first": steps[0].get("reward_mean"), "reward_last": steps[-1].get("reward_mean"),
           "stages_s": stages, "stage_share": {k: v / step_s for k, v in stages.items()}}
    if proc.get("worker_env"):
        row["ray_worker_env"] = proc["worker_env"]
    return row


def write_markdown(report: dict, path: Path) -> None:
    meta, rows = report["meta"], report["rows"]
    lines = ["# peer_trl: hybridrl GRPO vs TRL GRPOTrainer, same CPU job", "",
             f"Run {meta['utc']} on {meta['machine_desc']}; 1-min load average {meta['load_avg_start']:.2f} at start, "
             f"{meta['load_avg_end']:.2f} at end (other jobs may share the cores: compare sides within one run).", "",
             f"Job: {JOB['prompts_per_step']} prompts x {JOB['samples_per_prompt']} samples per step, "
             f"{JOB['new_tokens']} new tokens (fixed length), GRPO, lr {JOB['lr']}, beta 0, fp32, "
             f"{JOB['threads']} threads, OMP_WAIT_POLICY=PASSIVE; word-level tokenizer of {len(VOCAB)} words; "
             f"same checkpoint both sides (sha256 {', '.join(f'{k} {v[:12]}' for k, v in meta['weights_sha256'].items())}).",
             f"TRL side: trl {meta['trl_versions'].get('trl')}, transformers {meta['trl_versions'].get('transformers')}, "
             f"torch {meta['trl_versions'].get('torch')} (benchmarks/.venv-trl). hybridrl side: torch "
             f"{meta['hybridrl_torch']}, transformers {meta['hybridrl_transformers']}, native engine.",
             "tokens/s = (prompt + response tokens of the sampled sequences) / seconds, steps 2..N; stage columns: "
             "mean seconds per step over steps 2..N; peak RSS: whole process tree (driver + Ray daemons + workers); "
             "load: the machine's 1-min load average while that side ran (2 cores: above ~2 another job was "
             "competing for them).", "",
             "| size | side | layout | steps | tokens/s | vs TRL | s/step | generation | transition | reward | "
             "fwd+bwd / actor_update | optimizer | other | peak RSS MiB | procs | load mean/max |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        st = row["stages_s"]
        if row["side"] == "trl":
            update, opt = st.get("fwd_bwd", 0.0), st.get("optimizer", 0.0)
            other = st.get("rollout_other", 0.0)
        else:
            update, opt = st.get("actor_update", 0.0), None
            other = st.get("other", 0.0) + sum(v for k, v in st.items() if k not in
                                               ("generation", "transition", "reward", "actor_update", "other"))
        ratio = row.get("ratio_vs_trl")
        cells = [row["size"], row["side"], row["layout"], str(row["steps"]), f"{row['tokens_per_s']:.0f}",
                 f"{ratio:.2f}" if ratio is not None else ("1.00" if row["side"] == "trl" else "-"), f"{row['step_s']:.3f}",
                 f"{st.get('generation', 0.0):.3f}",
                 f"{st['transition']:.3f} ({100 * row['stage_share']['transition']:.0f}%)" if "transition" in st
                 else "-", f"{st.get('reward', 0.0):.3f}", f"{update:.3f}",
                 f"{opt:.3f}" if opt is not None else "(in update)", f"{other:.3f}",
                 f"{row['peak_rss_mib']:.0f}", str(row["processes"]),
                 f"{row.get('load_mean', float('nan')):.1f}/{row.get('load_max', float('nan')):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Notes:", ""] + [f"- {note}" for note in report.get("notes", [])] + [""]
    path.write_text("\n".join(lines))


def write_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(1, 2 * len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    colors = {"generation": "tab:blue", "transition": "tab:purple", "reward": "tab:olive", "rollout_other": "tab:gray",
              "fwd_bwd": "tab:orange", "actor_update": "tab:orange", "optimizer": "tab:red", "other": "tab:gray"}
    for index, size in enumerate(sizes):
        sub = [r for r in rows if r["size"] == size]
        labels = [f"{r['side']}\n{r['layout']}" for r in sub]
        ax = axes[0][2 * index]
        ax.bar(labels, [r["tokens_per_s"] for r in sub], color=["tab:green" if r["side"] == "trl" else "tab:blue"
                                                                for r in sub])
        ax.set_title(f"{size}: tokens/s (steps 2..N)")
        ax = axes[0][2 * index + 1]
        for x, row in enumerate(sub):
            bottom = 0.0
            for stage, seconds in row["stages_s"].items():
                seconds = max(seconds, 0.0)
                ax.bar(x, seconds, bottom=bottom, color=colors.get(stage, "tab:cyan"),
                       label=stage if x == 0 or stage not in sub[0]["stages_s"] else None)
                bottom += seconds
        ax.set_xticks(range(len(sub)), labels)
        ax.set_title(f"{size}: seconds per step by stage")
        handles, names = ax.get_legend_handles_labels()
        unique = dict(zip(names, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,25m", help="comma list of: " + ", ".join(SIZES))
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per side (default {DEFAULT_STEPS}; step 1 is warm-up, not timed)")
    parser.add_argument("--layouts", default=None, help="hybridrl layouts, comma list of: tp1, tp2->1 (default both)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the interleaved TRL / hybridrl cycle")
    parser.add_argument("--quick", action="store_true", help="small model, 6 steps, tp1 only")
    parser.add_argument("--no-trl", action="store_true", help="hybridrl side only (no venv)")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one side may run")
    parser.add_argument("--worker", choices=("trl",), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=JOB["threads"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        trl_worker(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.quick:
        args.sizes, args.layouts, args.steps = "small", args.layouts or "tp1", args.steps or 6
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    layouts = [s.strip() for s in (args.layouts or ",".join(LAYOUTS)).split(",") if s.strip()]
    if not sizes or any(s not in SIZES for s in sizes):
        parser.error(f"--sizes: choose from {list(SIZES)}")
    if any(layout not in LAYOUTS for layout in layouts):
        parser.error(f"--layouts: choose from {list(LAYOUTS)}")
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is not timed)")

    import torch
    import transformers

    load_start = os.getloadavg()[0]
    trl_versions = {} if args.no_trl else ensure_trl_venv()
    jobs = {size: prepare_job(size) for size in sizes}
    pythonpath = os.pathsep.join([str(ROOT), str(BENCH_DIR)])
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as tmp:
        for rnd in range(args.rounds):
            for size in sizes:
                steps = args.steps or DEFAULT_STEPS[size]
                job = jobs[size]
                if not args.no_trl:
                    out = Path(tmp) / f"trl-{size}-{rnd}.json"
                    cmd = [str(_venv_python()), str(Path(__file__).resolve()), "--worker", "trl", "--model-dir",
                           job["model"], "--data", job["data"], "--threads", str(JOB["threads"]), "--steps",
                           str(steps), "--out", str(out), "--out-dir", str(Path(tmp) / f"trl-out-{size}-{rnd}")]
                    logger.info("[%s] TRL GRPOTrainer, %d steps", size, steps)
                    proc = run_side(cmd, side_env(JOB["threads"], None), Path(tmp) / f"trl-{size}-{rnd}.log",
                                    args.timeout)
                    result = json.loads(out.read_text())
                    row = summarize("trl", size, "tp1 (1 process)", result["steps"], proc, trl_stages)
                    row["threads"] = result["threads"]
                    row["response_len_min"] = min(s.get("response_len_min", 0) for s in result["steps"])
                    rows.append(row)
                    logger.info("[%s] TRL: %.0f tokens/s, %.3f s/step", size, row["tokens_per_s"], row["step_s"])
                for layout in layouts:
                    run_dir = Path(tmp) / f"hybridrl-{size}-{layout.replace('->', 'to')}-{rnd}"
                    cmd = [sys.executable, "-m", "hybridrl.cli", "train", "configs/grpo_tiny.yaml",
                           *hybridrl_overrides(job, layout, steps, run_dir)]
                    logger.info("[%s] hybridrl %s, %d steps", size, layout, steps)
                    proc = run_side(cmd, side_env(JOB["threads"], pythonpath), Path(tmp) / f"{run_dir.name}.log",
                                    args.timeout)
                    row = summarize("hybridrl", size, layout, hybridrl_steps(run_dir), proc, hybridrl_stages)
                    rows.append(row)
                    logger.info("[%s] hybridrl %s: %.0f tokens/s, %.3f s/step", size, layout, row["tokens_per_s"],
                                row["step_s"])
        if args.rounds > 1:  # one row per (size, side, layout): the median round by tokens/s
            grouped: dict[tuple, list[dict]] = {}
            for row in rows:
                grouped.setdefault((row["size"], row["side"], row["layout"]), []).append(row)
            rows = []
            for group in grouped.values():
                group.sort(key=lambda r: r["tokens_per_s"])
                chosen = dict(group[len(group) // 2])
                chosen["tokens_per_s_rounds"] = [r["tokens_per_s"] for r in group]
                rows.append(chosen)
    for row in rows:
        base = next((r for r in rows if r["size"] == row["size"] and r["side"] == "trl"), None)
        if row["side"] != "trl" and base is not None:
            row["ratio_vs_trl"] = row["tokens_per_s"] / base["tokens_per_s"]
    meta = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host_cpus": os.cpu_count(),
            "machine_desc": f"{platform.machine()}, {os.cpu_count()} cores, no GPU", "python": platform.python_version(),
            "load_avg_start": round(load_start, 2), "load_avg_end": round(os.getloadavg()[0], 2),
            "trl_versions": trl_versions, "hybridrl_torch": torch.__version__,
            "hybridrl_transformers": transformers.__version__, "job": JOB, "sizes": {s: SIZES[s] for s in sizes},
            "steps": {s: args.steps or DEFAULT_STEPS[s] for s in sizes}, "rounds": args.rounds,
            "weights_sha256": {s: j["weights_sha256"] for s, j in jobs.items()},
            "env": {"OMP_NUM_THREADS": str(JOB["threads"]), "OMP_WAIT_POLICY": "PASSIVE"}}
    notes = ["hybridrl: `hybridrl train configs/grpo_tiny.yaml` with " + " ".join(
                 o for o in hybridrl_overrides({"model": "M", "data": "D"}, "tp1", 0, Path("R"))
                 if not o.startswith(("actor.model.path", "data.train_files", "trainer.run_dir", "trainer.steps"))),
             "hybridrl stages: generation excludes the transition (reshard + engine wake-up, shown with its share "
             "of the step); `other` is the step's untimed rest (advantages, driver bookkeeping). The old-log-prob "
             "and reference passes do not run (one update per batch, KL coef 0).",
             "TRL stages: generation = _generate_single_turn (model.generate with min_new_tokens=32), reward = "
             "_calculate_rewards, other = the rest of _generate_and_score_completions (tokenize, decode, "
             "advantages), fwd+bwd = training_step minus the rollout, optimizer = clip + Adam step.",
             "The tp2->1 layout uses 2 Ray devices on the same 2 cores (1 thread per worker): it shows the hybrid "
             "engine's cost, not a speed-up."]
    report = {"name": "peer_trl", "meta": meta, "rows": rows, "notes": notes}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "peer_trl.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    write_markdown(report, out_dir / "peer_trl.md")
    write_plot(rows, out_dir / "peer_trl.png")
    print((out_dir / "peer_trl.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
