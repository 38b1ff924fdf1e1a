"""The peer job of benchmarks/peer_trl.py and benchmarks/peer_trl_sweep.py: hybridrl GRPO and TRL's GRPOTrainer on
the identical CPU job, each side run as a user runs it.

The job: a deterministic Llama (small: hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV heads; 25m: hidden
512, intermediate 1536, 8 layers, 8 heads, 4 KV heads), fp32, over a 24-word word-level tokenizer; a prompt set of
"warm : ..." / "cold : ..." lines and a rule reward (`word_reward`: the fraction of response words from the named
set, over at least 4 words); GRPO, temperature 1, lr 1e-3, beta / KL coef 0, one update per batch. A `Shape` says
how much work a step is: prompts x samples sequences, new tokens per response, fixed length (TRL min_new_tokens,
hybridrl rollout.ignore_eos) or natural length (EOS ends a response, lengths differ per sample).

Each side runs in its own subprocess in its OWN DEFAULT ENVIRONMENT (`side_env`): the variables that tune OpenMP /
BLAS threading are removed from what the caller's shell had, nothing is added but the offline switches (no model
hub here) and unbuffered output. Thread counts and wait policies are each side's own choice; what they used is
recorded. Peak RSS sums the resident memory of the side's whole process tree (driver, Ray daemons and workers),
sampled every 0.2 s.

This module imports nothing from hybridrl at module level: the TRL side (benchmarks/peer_trl_worker.py) imports it
inside the TRL venv.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
CACHE = BENCH_DIR / ".cache" / "peer_trl"
VENV = BENCH_DIR / ".venv-trl"
RESULTS = BENCH_DIR / "results"
logger = logging.getLogger("benchmarks.peer_job")

TRL_PINS = {"trl": "1.16.0", "transformers": "5.19.0", "torch": "2.13.0"}
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SIZES: dict[str, dict[str, int]] = {
    "small": {"hidden": 128, "ffn_hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2},
    "25m": {"hidden": 512, "ffn_hidden": 1536, "layers": 8, "heads": 8, "kv_heads": 4},
}
LAYOUTS = ("tp1", "tp2->1")
JOB = {"lr": 1e-3, "beta": 0.0, "temperature": 1.0, "seed": 0, "max_prompt_length": 16, "clip_ratio": 0.2,
       "clip_grad": 1.0}
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
WORD_SETS: dict[str, tuple[str, ...]] = {
    "warm": ("sun", "fire", "tea", "sand", "lamp", "oven", "soup", "wool"),
    "cold": ("ice", "snow", "frost", "hail", "sleet", "lake", "wind", "mist"),
}
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + ("warm", "cold", ":", "and") + WORD_SETS["warm"] + WORD_SETS["cold"]
assert len(VOCAB) == 24 and len(set(VOCAB)) == 24  # a multiple of 8: no Megatron vocab padding at TP <= 8
# environment variables that tune threading: a side gets none of them from the caller (its own defaults rule)
THREAD_VARIABLE_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "BLIS_", "TORCH_NUM_", "TOKENIZERS_PARALLELISM",
                            "DNNL_", "ONEDNN_")


@dataclass(frozen=True)
class Shape:
    """How much work one step is."""

    prompts: int = 16  # prompts per step
    samples: int = 4  # responses per prompt (a GRPO group)
    new_tokens: int = 32  # response length (fixed) or its cap (natural)
    natural: bool = False  # EOS ends a response (lengths differ per sample); False: exactly new_tokens
    # a PRECISIONS key: default (each side as its user runs it), fp32 or bf16 (the same precision on both sides)
    precision: str = "default"
    trl_micro_batch: int | None = None  # TRL's per_device_train_batch_size (None: all sequences in one)

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples

    @property
    def label(self) -> str:
        return f"{self.sequences}x{self.new_tokens}{' natural' if self.natural else ''}" \
            f"{'' if self.precision == 'default' else ' ' + self.precision}"

    @property
    def trl_precision(self) -> str:
        """What TRL's side is told: fp32 sets bf16=False (a change its user makes); otherwise TRL's own default
        (GRPOConfig bf16=True: fp32 weights, bf16 autocast)."""
        return "fp32" if self.precision == "fp32" else "bf16"


DEFAULT_SHAPE = Shape()
PRECISIONS = {"default": "each side at its own default (TRL: GRPOConfig bf16=True, autocast; hybridrl: dtype auto, "
                         "bf16 mixed precision where the CPU has bf16 units and hidden >= 512, else fp32)",
              "fp32": "fp32 on both sides (TRL: GRPOConfig bf16=False)",
              "bf16": "bf16 mixed precision (TRL: its default GRPOConfig bf16=True, autocast; hybridrl: "
                      "actor.model.dtype=bfloat16, fp32 main weights)"}
HYBRIDRL_DTYPE = {"default": [], "fp32": ["actor.model.dtype=float32"], "bf16": ["actor.model.dtype=bfloat16"]}


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


def prepare_job(size: str, cache: Path = CACHE, max_positions: int = 128) -> dict[str, str]:
    """Create (once) cache/<size>[-p<max_positions>]/{model,train.jsonl}: the HF checkpoint + tokenizer and the
    prompt file both sides read (max_positions only changes config.json: RoPE has no position weights).
    Returns {"model": dir, "data": file, "weights_sha256": ...}."""
    import hashlib
    import shutil

    target = cache / (size if max_positions == 128 else f"{size}-p{max_positions}")
    model_dir, data = target / "model", target / "train.jsonl"
    if not (model_dir / "model.safetensors").is_file() or not (model_dir / "tokenizer.json").is_file():
        sys.path.insert(0, str(ROOT))
        from hybridrl.models.tiny import create_tiny_model  # hybridrl's side only: the TRL venv never prepares

        tmp = target / "model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        create_tiny_model(tmp, vocab_size=len(VOCAB), seed=JOB["seed"], max_positions=max_positions, **SIZES[size])
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


# ---- processes -----------------------------------------------------------------------------------
class TreeSampler(threading.Thread):
    """Samples the summed RSS of a process and all its descendants every `interval` s (the process list is
    refreshed every second); keeps the peak, the most processes seen, and the threading environment of the
    process doing the work (the Ray worker for hybridrl, the process itself for TRL)."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_rss = 0
        self.max_procs = 0
        self.worker_env: dict[str, str] = {}
        self.loads: list[float] = []  # 1-min load average, once a second
        self.cpu_s: dict[int, tuple[str, float]] = {}  # pid -> (name, user + system CPU seconds when last seen)
        self._halt = threading.Event()

    def _note_env(self, proc, root) -> None:
        """The threading variables of a Ray worker (hybridrl) or, until one is seen, of the root process (TRL)."""
        name = proc.name()
        worker = name.startswith("ray::") and "Agent" not in name and "IDLE" not in name
        if worker or (proc is root and not self.worker_env):
            env = proc.environ()
            self.worker_env = {"process": name, **{k: v for k, v in env.items()
                                                    if k.startswith(THREAD_VARIABLE_PREFIXES)}}

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        procs, found_at = [root], 0.0
        while not self._halt.is_set():
            last_walk = None
            if time.monotonic() - found_at > 1.0:  # walking /proc for descendants costs more than sampling them
                try:
                    procs = [root] + root.children(recursive=True)
                except psutil.NoSuchProcess:
                    break
                found_at = last_walk = time.monotonic()
                self.loads.append(os.getloadavg()[0])
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                    if found_at == last_walk:  # CPU seconds once a second, right after the walk
                        times = proc.cpu_times()
                        self.cpu_s[proc.pid] = (self.cpu_s.get(proc.pid, (proc.name(),))[0], times.user + times.system)
                    if not self.worker_env.get("process", "").startswith("ray::"):
                        self._note_env(proc, root)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.peak_rss = max(self.peak_rss, total)
            self.max_procs = max(self.max_procs, len(procs))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2)

    def cpu_by_name(self) -> dict[str, float]:
        """CPU seconds per process name (summed over processes of one name), largest first: who used the cores."""
        totals: dict[str, float] = {}
        for name, seconds in self.cpu_s.values():
            totals[name] = totals.get(name, 0.0) + seconds
        return dict(sorted(((k, round(v, 2)) for k, v in totals.items()), key=lambda kv: -kv[1]))


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (every core, every process) since boot."""
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def wait_for_quiet(busy_below: float, timeout_s: float, window_s: float = 3.0) -> float:
    """Wait (at most timeout_s) until the machine's cores are under `busy_below` percent busy over two windows in a
    row: other users' jobs on a shared machine would share the cores with the side about to run. Returns the last
    window's percentage (0 when busy_below <= 0: no waiting)."""
    import psutil

    if busy_below <= 0:
        return 0.0
    deadline, quiet, busy = time.monotonic() + timeout_s, 0, 100.0
    while quiet < 2 and time.monotonic() < deadline:
        busy = psutil.cpu_percent(interval=window_s)
        quiet = quiet + 1 if busy < busy_below else 0
    if quiet < 2:
        logger.warning("the machine stayed busy (%.0f%% of its cores) for %.0f s; running anyway", busy, timeout_s)
    return busy


def run_side(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> dict[str, Any]:
    """Run one side's subprocess (its own process group) with the tree sampler. Returns its record with status
    "ok", "timeout" (killed, with its whole group, after `timeout` s) or "failed" (with the log's tail)."""
    import signal

    start, busy_start = time.perf_counter(), busy_seconds()
    status = "ok"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = "timeout"
            os.killpg(proc.pid, signal.SIGTERM)  # the driver stops its Ray cluster on SIGTERM
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        finally:
            sampler.stop()
    own_cpu = sum(sampler.cpu_by_name().values())
    record = {"status": status, "wall_s": time.perf_counter() - start, "peak_rss_mib": sampler.peak_rss / 2**20,
              # CPU seconds the machine spent on processes outside this side's tree while it ran (other users' jobs);
              # approximate: the tree's own time is sampled once a second
              "other_cpu_s": round(max(0.0, busy_seconds() - busy_start - own_cpu), 1),
              "processes": sampler.max_procs, "worker_env": sampler.worker_env, "cpu_s": sampler.cpu_by_name(),
              "load_mean": sum(sampler.loads) / len(sampler.loads) if sampler.loads else float("nan"),
              "load_max": max(sampler.loads, default=float("nan"))}
    if status == "ok" and rc != 0:
        record.update(status="failed", error=f"{' '.join(cmd[:4])} ... exit {rc}; log {log_path}:\n"
                                             + log_path.read_text()[-4000:])
    return record


def side_env(pythonpath: str | None) -> tuple[dict[str, str], list[str]]:
    """A side's environment: the caller's, less every threading variable (returned by name), plus the offline
    switches (nothing to download here) and unbuffered output. PYTHONPATH set, or removed when None."""
    dropped = sorted(k for k in os.environ if k.startswith(THREAD_VARIABLE_PREFIXES))
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if pythonpath is None:
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = pythonpath
    return env, dropped


# ---- TRL side: the venv ----------------------------------------------------------------------------
def venv_python() -> Path:
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
    python = venv_python()
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


def trl_stages(record: dict) -> dict[str, float]:
    """TRL's step split into generation / reward / other rollout / forward+backward / optimizer."""
    rollout = record.get("rollout", 0.0)
    gen, rew, opt = record.get("generation", 0.0), record.get("reward", 0.0), record.get("optimizer", 0.0)
    return {"generation": gen, "reward": rew, "rollout_other": rollout - gen - rew,
            "fwd_bwd": record["seconds"] - rollout - opt, "optimizer": opt}


# ---- hybridrl side ---------------------------------------------------------------------------------
def hybridrl_overrides(job: dict[str, str], layout: str, steps: int, run_dir: Path,
                       shape: Shape = DEFAULT_SHAPE) -> list[str]:
    tp = 2 if layout == "tp2->1" else 1
    return [f"actor.model.path={job['model']}", f"data.train_files=[{job['data']}]", "data.shuffle=true",
            f"data.batch_size={shape.prompts}", f"data.max_prompt_length={JOB['max_prompt_length']}",
            f"data.seed={JOB['seed']}", "reward.fn=peer_job:word_reward", "algorithm.name=grpo",
            f"algorithm.clip_ratio={JOB['clip_ratio']}", "algorithm.kl.coef=0.0", "algorithm.ppo_epochs=1",
            "algorithm.mini_batch_size=null", f"actor.optim.lr={JOB['lr']}", f"actor.optim.clip_grad={JOB['clip_grad']}",
            f"actor.parallel.tp={tp}", f"resources.devices={tp}", "rollout.engine=native", "rollout.tp=1",
            f"rollout.n={shape.samples}", f"rollout.temperature={JOB['temperature']}",
            f"rollout.max_new_tokens={shape.new_tokens}", f"rollout.ignore_eos={str(not shape.natural).lower()}",
            f"trainer.steps={steps}", f"trainer.seed={JOB['seed'] + 1}", f"trainer.run_dir={run_dir}",
            "trainer.trackers=[]", "trainer.progress_bar=false", "trainer.save_every=0"] + \
        HYBRIDRL_DTYPE[shape.precision]


def hybridrl_steps(run_dir: Path, shape: Shape = DEFAULT_SHAPE) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = []
    for rec in records:
        stages = {k[len("time/"):]: v for k, v in rec.items() if k.startswith("time/") and k != "time/step"}
        step = {"seconds": rec["time/step"], "prompt_tokens": rec["prompt_length_mean"] * shape.sequences,
                "response_tokens": rec["response_length_mean"] * shape.sequences, "reward_mean": rec["reward_mean"],
                "stages": stages}
        for key, name in (("actor/token_fill", "update_fill"), ("rollout/decode_fill", "decode_fill")):
            if key in rec:
                step[name] = rec[key]
        steps.append(step)
    return steps


def hybridrl_stages(record: dict) -> dict[str, float]:
    """Stages of one step; generation excludes the transition (reported on its own), `other` is the rest."""
    stages = dict(record["stages"])
    out = {"transition": stages.pop("transition", 0.0)}
    out["generation"] = stages.pop("generation", 0.0) - out["transition"]
    out.update(stages)
    out["other"] = record["seconds"] - sum(out.values())
    return out


# ---- one side's run -> one row ---------------------------------------------------------------------
def mean_over_timed(steps: list[dict], value) -> dict[str, float]:
    timed = steps[1:] or steps
    keys = list(dict.fromkeys(k for s in timed for k in value(s)))
    return {k: sum(value(s).get(k, 0.0) for s in timed) / len(timed) for k in keys}


def summarize(side: str, size: str, layout: str, steps: list[dict], proc: dict, split) -> dict[str, Any]:
    tokens, seconds, tps = count_tokens_per_s(steps)
    stages = mean_over_timed(steps, split)
    step_s = seconds / max(len(steps) - 1, 1)
    fills = mean_over_timed(steps, lambda s: {k: s[k] for k in ("update_fill", "decode_fill") if k in s})
    timed = steps[1:] or steps
    row = {"size": size, "side": side, "layout": layout, "status": "ok", "steps": len(steps), "tokens_per_s": tps,
           "step_s": step_s, "tokens_timed": tokens, "seconds_timed": seconds,
           "response_tokens_mean": sum(s["response_tokens"] for s in timed) / len(timed),
           "peak_rss_mib": proc["peak_rss_mib"], "processes": proc["processes"], "wall_s": proc["wall_s"],
           "load_mean": proc["load_mean"], "load_max": proc["load_max"],
           "reward_first": steps[0].get("reward_mean"), "reward_last": steps[-1].get("reward_mean"),
           "stages_s": stages, "stage_share": {k: v / step_s for k, v in stages.items()}, **fills,
           "env": proc.get("worker_env", {}), "cpu_s_by_process": proc.get("cpu_s", {}),
           "other_cpu_s": proc.get("other_cpu_s")}
    return row


def unfinished(side: str, size: str, layout: str, proc: dict, steps_done: int) -> dict[str, Any]:
    """The row of a side that did not finish: its status and how far it got, no throughput."""
    return {"size": size, "side": side, "layout": layout, "status": proc["status"], "steps": steps_done,
            "tokens_per_s": None, "step_s": None, "peak_rss_mib": proc["peak_rss_mib"],
            "processes": proc["processes"], "wall_s": proc["wall_s"], "load_mean": proc["load_mean"],
            "load_max": proc["load_max"], "error": proc.get("error", "")[-600:], "env": proc.get("worker_env", {})}


def run_trl(job: dict[str, str], size: str, shape: Shape, steps: int, work: Path, timeout: float,
            tag: str = "", prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """TRL's run of `steps` steps -> its row (prefix: a command the side runs under, e.g. a profiler)."""
    out = work / f"trl-{tag}.json"
    cmd = [*prefix, str(venv_python()), str(BENCH_DIR / "peer_trl_worker.py"), "--model-dir", job["model"], "--data",
           job["data"], "--steps", str(steps), "--out", str(out), "--out-dir", str(work / f"trl-out-{tag}"),
           "--prompts", str(shape.prompts), "--samples", str(shape.samples), "--new-tokens", str(shape.new_tokens)]
    cmd += (["--natural"] if shape.natural else []) + ["--precision", shape.trl_precision] + \
        (["--micro-batch", str(shape.trl_micro_batch)] if shape.trl_micro_batch else [])
    env, _ = side_env(None)
    proc = run_side(cmd, env, work / f"trl-{tag}.log", timeout)
    result = json.loads(out.read_text()) if out.is_file() else {"steps": []}
    if proc["status"] != "ok" or len(result["steps"]) < 2:
        return unfinished("trl", size, "tp1 (1 process)", proc, len(result["steps"]))
    row = summarize("trl", size, "tp1 (1 process)", result["steps"], proc, trl_stages)
    row["threads"] = result["threads"]
    row["trl_bf16"] = result.get("bf16")
    row["micro_batch"] = result.get("micro_batch")
    row["response_len_min"] = min(s.get("response_len_min", 0) for s in result["steps"])
    return row


def run_hybridrl(job: dict[str, str], size: str, shape: Shape, layout: str, steps: int, work: Path,
                 timeout: float, tag: str = "", prefix: tuple[str, ...] = (),
                 extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """hybridrl's run of `steps` steps at `layout` -> its row (extra_env: variables added to its default
    environment, for benchmarks/thread_settings.py only)."""
    run_dir = work / f"hybridrl-{tag}-{layout.replace('->', 'to')}"
    cmd = [*prefix, sys.executable, "-m", "hybridrl.cli", "train", "configs/grpo_tiny.yaml",
           *hybridrl_overrides(job, layout, steps, run_dir, shape)]
    env, _ = side_env(os.pathsep.join([str(ROOT), str(BENCH_DIR)]))
    proc = run_side(cmd, {**env, **(extra_env or {})}, work / f"{run_dir.name}.log", timeout)
    metrics = run_dir / "metrics.jsonl"
    done = hybridrl_steps(run_dir, shape) if metrics.is_file() else []
    if proc["status"] != "ok" or len(done) < 2:
        return unfinished("hybridrl", size, layout, proc, len(done))
    return summarize("hybridrl", size, layout, done, proc, hybridrl_stages)


def shape_dict(shape: Shape) -> dict[str, Any]:
    return {**asdict(shape), "sequences": shape.sequences}


def write_report(report: dict, out_dir: Path, name: str, markdown, plot) -> Path:
    """results/<name>.json, .md (markdown(report, path)) and .png (plot(report, path)); returns the .md path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    markdown(report, out_dir / f"{name}.md")
    plot(report, out_dir / f"{name}.png")
    return out_dir / f"{name}.md"

