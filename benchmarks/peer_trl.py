"""Peer benchmark: hybridrl GRPO vs Hugging Face TRL's GRPOTrainer on the identical CPU job (issues 12, 34).

The job and how each side runs are in benchmarks/peer_job.py: the same checkpoint, tokenizer, prompts and reward on
both sides (benchmarks/.cache/peer_trl/, created deterministically on first use), 16 prompts x 4 samples a step,
32 new tokens, GRPO with beta 0 and one update per batch. Each side runs as a user runs it: in its own
subprocess and its own DEFAULT environment (no threading variable from the caller's shell, none added), so
thread counts and OpenMP wait policies are each side's own defaults; what each side's worker process saw is in
the results.

- TRL: GRPOTrainer (benchmarks/peer_trl_worker.py) in a venv this script creates (benchmarks/.venv-trl/, pinned trl
  / transformers / CPU torch; versions go into the results), per_device_train_batch_size 64 (the whole step).
- hybridrl: `hybridrl train configs/grpo_tiny.yaml key=value ...` on a local Ray cluster, layout "tp1" (1 device,
  native engine, no reshard) and "tp2->1" (2 devices: training TP=2, generation TP=1, 3D-HybridEngine).

Rounds interleave the sides (round 1: TRL then hybridrl, round 2: hybridrl then TRL, ...), so drift of the
machine falls on both; every round's tokens/s and ratio is reported, and the breakdown of the median round.
tokens/s = (prompt + response tokens of the sampled sequences, steps 2..N) / (seconds of steps 2..N); step 1
(warm-up, lazy allocations) is excluded. --lengths natural lets EOS end responses (lengths differ per sample) and
reports which share of the positions each side computes are real tokens (update: the training forward's
[rows x width]; decode: rows x decode steps).

    python benchmarks/peer_trl.py --rounds 3 --layouts tp1        # both sizes, 3 interleaved rounds
    python benchmarks/peer_trl.py --quick                         # small model, 6 steps, tp1
    python benchmarks/peer_trl.py --lengths natural --rounds 3 --layouts tp1   # -> results/peer_trl_natural.*
    python benchmarks/peer_trl.py --precision bf16 --rounds 3 --layouts tp1    # -> results/peer_trl_bf16.*
    python benchmarks/peer_trl.py --precision fp32 --rounds 3 --layouts tp1    # -> results/peer_trl_fp32.*

--precision default runs each side as its user does: TRL at its own default (GRPOConfig bf16=True: fp32 weights,
bf16 autocast), hybridrl at its own (dtype auto: bf16 mixed precision where the CPU has bf16 units and the model's
hidden size is >= 512, fp32 below; hybridrl/models/precision.py). --precision fp32 runs both in fp32 (TRL told
bf16=False, a setting its user changes); --precision bf16 both in bf16 (hybridrl actor.model.dtype=bfloat16:
Megatron's mixed precision, bf16 module, fp32 main weights in the optimizer).
    python benchmarks/peer_trl.py --profile DIR ...               # each side under py-spy (raw stacks in DIR)
    hybridrl bench peer_trl --sizes 25m --steps 4
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_job import (JOB, LAYOUTS, PRECISIONS, RESULTS, SIZES, VOCAB, Shape, ensure_trl_venv, hybridrl_overrides,  # noqa: E402
                      prepare_job, run_hybridrl, run_trl, shape_dict, side_env, wait_for_quiet, write_report)

logger = logging.getLogger("benchmarks.peer_trl")
DEFAULT_STEPS = {"small": 20, "25m": 6}


def profiler(profile_dir: Path | None, name: str, native: bool = False) -> tuple[str, ...]:
    """`py-spy record --subprocesses` (on-CPU samples of every process of the side's tree; native: C/C++ frames
    too, e.g. which torch kernels) when asked."""
    if profile_dir is None:
        return ()
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    return (py_spy, "record", "--subprocesses", "--rate", "50", "--format", "raw", *(["--native"] if native else []),
            "--output", str(profile_dir / f"{name}.txt"), "--")


def run_rounds(args, sizes: list[str], layouts: list[str], shape: Shape, jobs: dict, work: Path) -> list[dict]:
    rows: list[dict] = []
    profile = Path(args.profile) if args.profile else None
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    for rnd in range(args.rounds):
        for size in sizes:
            steps = args.steps or DEFAULT_STEPS[size]
            sides = ([] if args.no_trl else ["trl"]) + layouts
            if rnd % 2:  # odd rounds run hybridrl first: drift of the machine falls on both sides
                sides = sides[::-1]
            for side in sides:
                tag = f"{size}-r{rnd}"
                busy = wait_for_quiet(args.quiet, args.quiet_wait)
                logger.info("[%s round %d] %s, %d steps (cores %.0f%% busy before)", size, rnd + 1, side, steps, busy)
                if side == "trl":
                    row = run_trl(jobs[size], size, shape, steps, work, args.timeout, tag,
                                  profiler(profile, f"trl-{tag}", args.profile_native))
                else:
                    row = run_hybridrl(jobs[size], size, shape, side, steps, work, args.timeout, tag,
                                       profiler(profile, f"hybridrl-{side.replace('->', 'to')}-{tag}",
                                                args.profile_native))
                if row["status"] != "ok":
                    raise RuntimeError(f"{side} at {size} did not finish ({row['status']}): {row.get('error')}")
                row["round"], row["busy_before_pct"] = rnd + 1, busy
                rows.append(row)
                logger.info("[%s round %d] %s: %.0f tokens/s, %.3f s/step", size, rnd + 1, side,
                            row["tokens_per_s"], row["step_s"])
    return rows


def round_ratios(rows: list[dict]) -> None:
    """Each hybridrl row's ratio to TRL's tokens/s in the same round and size."""
    for row in rows:
        base = next((r for r in rows if r["side"] == "trl" and r["size"] == row["size"]
                     and r["round"] == row["round"]), None)
        if row["side"] != "trl" and base is not None:
            row["ratio_vs_trl"] = row["tokens_per_s"] / base["tokens_per_s"]


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (size, side, layout): the median round by tokens/s, with every round's tokens/s and ratio."""
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["size"], row["side"], row["layout"]), []).append(row)
    out = []
    for group in grouped.values():
        ordered = sorted(group, key=lambda r: r["tokens_per_s"])
        chosen = dict(ordered[len(ordered) // 2])
        chosen["tokens_per_s_rounds"] = [r["tokens_per_s"] for r in group]
        if "ratio_vs_trl" in chosen:
            chosen["ratio_rounds"] = [r["ratio_vs_trl"] for r in group]
        out.append(chosen)
    return out


def _stage_cells(row: dict) -> list[str]:
    st = row["stages_s"]
    if row["side"] == "trl":
        update, opt, other = st.get("fwd_bwd", 0.0), f"{st.get('optimizer', 0.0):.3f}", st.get("rollout_other", 0.0)
    else:
        update, opt = st.get("actor_update", 0.0), "(in update)"
        other = sum(v for k, v in st.items() if k not in ("generation", "transition", "reward", "actor_update"))
    transition = f"{st['transition']:.3f} ({100 * row['stage_share']['transition']:.0f}%)" if "transition" in st \
        else "-"
    return [f"{st.get('generation', 0.0):.3f}", transition, f"{st.get('reward', 0.0):.3f}", f"{update:.3f}", opt,
            f"{other:.3f}"]


def write_markdown(report: dict, path: Path) -> None:
    meta, rounds, rows = report["meta"], report["rounds"], report["rows"]
    shape = meta["shape"]
    lengths = "natural lengths (EOS ends a response)" if shape["natural"] else "fixed length"
    lines = [f"# {report['name']}: hybridrl GRPO vs TRL GRPOTrainer, same CPU job, each side in its own default "
             "environment", "",
             f"Run {meta['utc']} on {meta['machine_desc']}; 1-min load average {meta['load_avg_start']:.2f} at start, "
             f"{meta['load_avg_end']:.2f} at end.", "",
             f"Job: {shape['prompts']} prompts x {shape['samples']} samples per step, up to {shape['new_tokens']} new "
             f"tokens ({lengths}), GRPO, lr {JOB['lr']}, beta 0, {PRECISIONS[shape.get('precision', 'fp32')]}; word-level tokenizer of {len(VOCAB)} words; "
             f"same checkpoint both sides (sha256 {', '.join(f'{k} {v[:12]}' for k, v in meta['weights_sha256'].items())}).",
             f"TRL: trl {meta['trl_versions'].get('trl')}, transformers {meta['trl_versions'].get('transformers')}, "
             f"torch {meta['trl_versions'].get('torch')} (benchmarks/.venv-trl). hybridrl: torch "
             f"{meta['hybridrl_torch']}, transformers {meta['hybridrl_transformers']}, native engine.",
             f"Environment: each side its own defaults; threading variables removed from the caller's: "
             f"{', '.join(meta['dropped_env']) or 'none were set'}. What the working process saw: "
             + "; ".join(f"{k}: {v}" for k, v in meta["side_env_seen"].items()) + ".",
             "tokens/s = (prompt + response tokens of the sampled sequences) / seconds, steps 2..N. Rounds alternate "
             "the order of the sides. Each side waited for the cores to be under "
             f"{meta['quiet_pct']:.0f}% busy before it started; others' CPU s: the machine's busy CPU seconds outside the "
             "side's process tree while it ran (other users' jobs on this shared machine; 0 on a quiet one).", "",
             "## Every round", "",
             "| size | side | layout | " + " | ".join(f"round {r} tokens/s (vs TRL)" for r in range(1, meta["rounds"] + 1))
             + " |", "|---|---|---|" + "---:|" * meta["rounds"]]
    for row in rows:
        cells = [row["size"], row["side"], row["layout"]]
        for r in range(1, meta["rounds"] + 1):
            match = next((x for x in rounds if x["round"] == r and x["size"] == row["size"] and x["side"] == row["side"]
                          and x["layout"] == row["layout"]), None)
            ratio = match.get("ratio_vs_trl") if match else None
            cells.append("-" if match is None else f"{match['tokens_per_s']:.0f}" +
                         (f" ({ratio:.2f})" if ratio is not None else ""))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## The median round: where a step's time goes (seconds per step, steps 2..N)", "",
              "| size | side | layout | round | tokens/s | vs TRL | s/step | generation | transition | reward | "
              "fwd+bwd / actor_update | optimizer | other | update fill | decode fill | peak RSS MiB | procs | load | "
              "others' CPU s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ratio = row.get("ratio_vs_trl")
        fills = [f"{row[k]:.2f}" if k in row else "-" for k in ("update_fill", "decode_fill")]
        lines.append("| " + " | ".join([row["size"], row["side"], row["layout"], str(row["round"]),
                                         f"{row['tokens_per_s']:.0f}", f"{ratio:.2f}" if ratio is not None else "1.00",
                                         f"{row['step_s']:.3f}", *_stage_cells(row), *fills,
                                         f"{row['peak_rss_mib']:.0f}", str(row["processes"]),
                                         f"{row['load_mean']:.1f}/{row['load_max']:.1f}",
                                         f"{row.get('other_cpu_s', float('nan')):.0f}"]) + " |")
    lines += ["", "Notes:", ""] + [f"- {note}" for note in report["notes"]] + [""]
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
        for x, row in enumerate(sub):  # every round a dot, the median round a bar
            ax.bar(x, row["tokens_per_s"], color="tab:green" if row["side"] == "trl" else "tab:blue")
            values = row.get("tokens_per_s_rounds", [row["tokens_per_s"]])
            ax.plot([x] * len(values), values, "k.")
        ax.set_xticks(range(len(sub)), labels)
        ax.set_title(f"{size}: tokens/s (bars: median round; dots: rounds)")
        ax = axes[0][2 * index + 1]
        for x, row in enumerate(sub):
            bottom = 0.0
            for stage, seconds in row["stages_s"].items():
                seconds = max(seconds, 0.0)
                ax.bar(x, seconds, bottom=bottom, color=colors.get(stage, "tab:cyan"), label=stage)
                bottom += seconds
        ax.set_xticks(range(len(sub)), labels)
        ax.set_title(f"{size}: seconds per step by stage")
        handles, names = ax.get_legend_handles_labels()
        unique = dict(zip(names, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def notes(shape: Shape) -> list[str]:
    return ["hybridrl: `hybridrl train configs/grpo_tiny.yaml` with " + " ".join(
                o for o in hybridrl_overrides({"model": "M", "data": "D"}, "tp1", 0, Path("R"), shape)
                if not o.startswith(("actor.model.path", "data.train_files", "trainer.run_dir", "trainer.steps"))),
            "hybridrl stages: generation excludes the transition (reshard + engine wake-up); `other` is the rest of "
            "the step (advantages, driver bookkeeping). The old-log-prob and reference passes do not run (one "
            "update per batch, KL coef 0).",
            "TRL stages: generation = _generate_single_turn (model.generate), reward = _calculate_rewards, other = the "
            "rest of _generate_and_score_completions (tokenize, decode, advantages), fwd+bwd = training_step minus "
            "the rollout, optimizer = clip + Adam step.",
            "fill: the share of the positions a stage computes that are real tokens (update: the training forward's "
            "rows x width; decode: rows x decode steps). hybridrl packs sequences into rows (no padding between "
            "them) and drops finished rows from the decode batch; TRL pads to the longest prompt + completion.",
            "The tp2->1 layout uses 2 Ray devices on the same 2 cores (1 thread per worker): it shows the hybrid "
            "engine's cost, not a speed-up."]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,25m", help="comma list of: " + ", ".join(SIZES))
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per side (default {DEFAULT_STEPS}; step 1 is warm-up, not timed)")
    parser.add_argument("--layouts", default=None, help="hybridrl layouts, comma list of: tp1, tp2->1 (default both)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the order alternates)")
    parser.add_argument("--lengths", choices=("fixed", "natural"), default="fixed",
                        help="fixed: exactly 32 new tokens; natural: EOS ends a response (results peer_trl_natural)")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="default",
                        help="default: each side's own; fp32 / bf16: both sides in it (results *_fp32, *_bf16)")
    parser.add_argument("--quick", action="store_true", help="small model, 6 steps, tp1, one round")
    parser.add_argument("--no-trl", action="store_true", help="hybridrl side only (no venv)")
    parser.add_argument("--profile", default=None, help="folder for py-spy's raw stacks of each side's run")
    parser.add_argument("--profile-native", action="store_true", help="with --profile: C/C++ frames too")
    parser.add_argument("--quiet", type=float, default=15.0,
                        help="before each side, wait until the cores are under this %% busy (0: do not wait)")
    parser.add_argument("--quiet-wait", type=float, default=600.0, help="seconds to wait for --quiet at most")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one side may run")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.layouts, args.steps, args.rounds = "small", args.layouts or "tp1", args.steps or 6, 1
    args.size_list = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.layout_list = [s.strip() for s in (args.layouts or ",".join(LAYOUTS)).split(",") if s.strip()]
    if not args.size_list or any(s not in SIZES for s in args.size_list):
        parser.error(f"--sizes: choose from {list(SIZES)}")
    if any(layout not in LAYOUTS for layout in args.layout_list):
        parser.error(f"--layouts: choose from {list(LAYOUTS)}")
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is not timed)")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    import transformers

    shape = Shape(natural=args.lengths == "natural", precision=args.precision)
    load_start = os.getloadavg()[0]
    trl_versions = {} if args.no_trl else ensure_trl_venv()
    jobs = {size: prepare_job(size) for size in args.size_list}
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as tmp:
        rounds = run_rounds(args, args.size_list, args.layout_list, shape, jobs, Path(tmp))
    round_ratios(rounds)
    rows = median_rows(rounds)
    name = "peer_trl" + ("_natural" if shape.natural else "") + \
        ("" if shape.precision == "default" else f"_{shape.precision}")
    meta = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host_cpus": os.cpu_count(),
            "machine_desc": f"{platform.machine()}, {os.cpu_count()} cores, no GPU", "python": platform.python_version(),
            "load_avg_start": round(load_start, 2), "load_avg_end": round(os.getloadavg()[0], 2),
            "trl_versions": trl_versions, "hybridrl_torch": torch.__version__,
            "hybridrl_transformers": transformers.__version__, "job": JOB, "shape": shape_dict(shape),
            "sizes": {s: SIZES[s] for s in args.size_list}, "rounds": args.rounds,
            "steps": {s: args.steps or DEFAULT_STEPS[s] for s in args.size_list},
            "weights_sha256": {s: j["weights_sha256"] for s, j in jobs.items()},
            "dropped_env": side_env(None)[1], "quiet_pct": args.quiet,
            "side_env_seen": {f"{r['side']} {r['layout']}": ", ".join(f"{k}={v}" for k, v in r["env"].items())
                              for r in rows}}
    report = {"name": name, "meta": meta, "rounds": rounds, "rows": rows, "notes": notes(shape)}
    markdown = write_report(report, Path(args.out_dir), name, write_markdown,
                            lambda result, path: write_plot(result["rows"], path))
    print(markdown.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
