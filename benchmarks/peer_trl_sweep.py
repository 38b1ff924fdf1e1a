"""Cost as work grows: hybridrl GRPO vs TRL's GRPOTrainer over batch x response length on the 25M model (issue 34).

The peer job of benchmarks/peer_job.py (same checkpoint with a 1024-position config, tokenizer, prompts, reward;
each side in its own default environment) at every cell of sequences per step (--batches, default 16, 64, 256:
prompts x 4 samples) x new tokens per response (--lengths, default 32, 128, 512, fixed length). Per cell and side:
tokens/s over steps 2..N, seconds per step, and the peak resident memory of the side's whole process tree.

Micro-batches as a user sizes them on a small machine: hybridrl packs by its default token budget
(actor.max_tokens_per_micro_batch 8192); TRL gets per_device_train_batch_size = the largest power of two whose
rows (16 prompt + new tokens) fit the same 8192 tokens (at most the batch), with gradient accumulation up to the
batch (TRL still generates the whole batch at once). Everything else is each side's default.

Big cells are slow on 2 cores (TRL's 256 x 512 step is minutes): each side of a cell runs at most --cell-timeout
seconds; a side that did not finish (time limit, out of memory, error) is reported as such, with no number.
Results are written after every cell, and --resume keeps the cells a previous run finished, so the sweep can be
run in parts (--cells picks some, measured again if they were finished).

    python benchmarks/peer_trl_sweep.py                                  # all 9 cells (about 1-2 h on 2 cores)
    python benchmarks/peer_trl_sweep.py --cells 16x32,64x128 --resume    # some cells, keeping the others
    python benchmarks/peer_trl_sweep.py --batches 16 --lengths 32 --steps 2 --out-name peer_trl_sweep_smoke
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_job import (JOB, PRECISIONS, RESULTS, SIZES, Shape, ensure_trl_venv, prepare_job, run_hybridrl, run_trl,  # noqa: E402
                      side_env, wait_for_quiet, write_report)

logger = logging.getLogger("benchmarks.peer_trl_sweep")
TOKEN_BUDGET = 8192  # hybridrl's default actor.max_tokens_per_micro_batch; TRL's micro-batch is sized to it
SAMPLES = 4


def trl_micro_batch(sequences: int, new_tokens: int) -> int:
    """The largest power of two <= sequences whose rows of (max prompt + new tokens) fit TOKEN_BUDGET tokens."""
    fit = max(1, TOKEN_BUDGET // (JOB["max_prompt_length"] + new_tokens))
    micro = 1
    while micro * 2 <= min(fit, sequences):
        micro *= 2
    return micro


def cell_key(sequences: int, new_tokens: int) -> str:
    return f"{sequences}x{new_tokens}"


def run_cell(job: dict, size: str, sequences: int, new_tokens: int, steps: int, order: list[str], timeout: float,
             work: Path, quiet: tuple[float, float] = (0.0, 0.0), precision: str = "default") -> dict:
    shape = Shape(prompts=sequences // SAMPLES, samples=SAMPLES, new_tokens=new_tokens,
                  trl_micro_batch=trl_micro_batch(sequences, new_tokens), precision=precision)
    cell = {"cell": cell_key(sequences, new_tokens), "sequences": sequences, "new_tokens": new_tokens,
            "steps": steps, "trl_micro_batch": shape.trl_micro_batch, "order": order}
    for side in order:
        tag = f"{cell['cell']}-{side}"
        busy = wait_for_quiet(*quiet)
        logger.info("[%s] %s, %d steps (at most %.0f s)", cell["cell"], side, steps, timeout)
        if side == "trl":
            row = run_trl(job, size, shape, steps, work, timeout, tag)
        else:
            row = run_hybridrl(job, size, shape, "tp1", steps, work, timeout, tag)
        cell[side] = {**row, "busy_before_pct": busy}
        logger.info("[%s] %s: %s", cell["cell"], side, f"{row['tokens_per_s']:.0f} tokens/s, {row['step_s']:.2f} s/step"
                    if row["status"] == "ok" else f"did not finish ({row['status']}, {row['steps']} steps done)")
    trl, ours = cell.get("trl", {}), cell.get("hybridrl", {})
    if trl.get("status") == "ok" and ours.get("status") == "ok":
        cell["ratio"] = ours["tokens_per_s"] / trl["tokens_per_s"]
    return cell


def growth(cells: list[dict], side: str) -> dict[str, float]:
    """Each finished cell's seconds per step over the smallest finished cell's, for one side."""
    done = [c for c in cells if c.get(side, {}).get("status") == "ok"]
    if not done:
        return {}
    base = min(done, key=lambda c: (c["sequences"], c["new_tokens"]))
    return {c["cell"]: c[side]["step_s"] / base[side]["step_s"] for c in done}


def _side_cells(row: dict | None) -> list[str]:
    if not row:
        return ["not run", "-", "-"]
    rss = f"{row['peak_rss_mib']:.0f}" + ("" if row["status"] == "ok" else " (so far)")
    if row["status"] != "ok":
        return [f"did not finish ({row['status']}, {row['steps']} steps done, {row['wall_s']:.0f} s)", "-", rss]
    return [f"{row['tokens_per_s']:.0f}", f"{row['step_s']:.2f}", rss]


def write_markdown(report: dict, path: Path) -> None:
    meta, cells = report["meta"], report["cells"]
    grow = {side: growth(cells, side) for side in ("trl", "hybridrl")}
    lines = ["# peer_trl_sweep: hybridrl GRPO vs TRL GRPOTrainer as work grows (25M model, each side in its own "
             "default environment)",
             "", f"Last cell {meta['utc']} on {meta['machine_desc']}. TRL {meta['trl_versions'].get('trl')} "
             f"(transformers {meta['trl_versions'].get('transformers')}, torch {meta['trl_versions'].get('torch')}); "
             f"hybridrl tp1, native engine. Precision: {PRECISIONS[meta.get('precision', 'fp32')]}. "
             f"Steps per cell: {meta['steps']} ({meta['big_steps']} where sequences x "
             f"new tokens >= {meta['big_cell']}); step 1 is warm-up, not timed. Each side of a cell at most "
             f"{meta['cell_timeout_s']:.0f} s.", "",
             "| sequences | new tokens | TRL tokens/s | hybridrl tokens/s | ratio | TRL s/step | hybridrl s/step | "
             "TRL step-time growth | hybridrl step-time growth | TRL peak RSS MiB | hybridrl peak RSS MiB | "
             "TRL micro-batch | others' CPU s (TRL / hybridrl) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cell in sorted(cells, key=lambda c: (c["sequences"], c["new_tokens"])):
        trl, ours = _side_cells(cell.get("trl")), _side_cells(cell.get("hybridrl"))
        ratio = f"{cell['ratio']:.2f}" if "ratio" in cell else "-"
        g = [f"{grow[s][cell['cell']]:.1f}x" if cell["cell"] in grow[s] else "-" for s in ("trl", "hybridrl")]
        others = " / ".join(f"{cell.get(s, {}).get('other_cpu_s') or 0:.0f}" for s in ("trl", "hybridrl"))
        lines.append("| " + " | ".join([str(cell["sequences"]), str(cell["new_tokens"]), trl[0], ours[0], ratio,
                                         trl[1], ours[1], *g, trl[2], ours[2], str(cell["trl_micro_batch"]),
                                         others]) + " |")
    lines += ["", "step-time growth: the cell's seconds per step over the smallest finished cell's (same side). "
              "Peak RSS: the side's whole process tree (hybridrl: driver, Ray daemons and worker). Each side waited "
              f"for the cores to be under {meta.get('quiet_pct', 0):.0f}% busy before it started; others' CPU s: the "
              "machine's busy CPU seconds outside the side's process tree while it ran (other users' jobs).",
              f"Threading variables removed from the caller's environment: {', '.join(meta['dropped_env']) or 'none'}.",
              ""]
    path.write_text("\n".join(lines))


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    batches = sorted({c["sequences"] for c in cells})
    lengths = sorted({c["new_tokens"] for c in cells})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, batch in enumerate(batches):
        color = plt.cm.tab10(index)
        for side, style in (("trl", "--"), ("hybridrl", "-")):
            points = [(c["new_tokens"], c[side]["tokens_per_s"]) for c in cells
                      if c["sequences"] == batch and c.get(side, {}).get("status") == "ok"]
            if points:
                points.sort()
                left.plot(*zip(*points), style, marker="o", color=color, label=f"{side}, {batch} sequences")
    left.set_xscale("log", base=2)
    left.set_xticks(lengths, [str(x) for x in lengths])
    left.set_xlabel("new tokens per response")
    left.set_ylabel("tokens/s (steps 2..N)")
    left.set_title("tokens/s (dashed: TRL, solid: hybridrl)")
    left.legend(fontsize=7)
    grid = [[next((c.get("ratio") for c in cells if c["sequences"] == b and c["new_tokens"] == n), None)
             for n in lengths] for b in batches]
    right.imshow([[v if v is not None else float("nan") for v in row] for row in grid], cmap="RdYlGn", vmin=0.5,
                 vmax=2.0, origin="lower")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            right.text(j, i, f"{value:.2f}" if value is not None else "did not\nfinish", ha="center", va="center")
    right.set_xticks(range(len(lengths)), [str(x) for x in lengths])
    right.set_yticks(range(len(batches)), [str(b) for b in batches])
    right.set_xlabel("new tokens per response")
    right.set_ylabel("sequences per step")
    right.set_title("hybridrl tokens/s / TRL tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="25m", choices=sorted(SIZES))
    parser.add_argument("--batches", default="16,64,256", help="sequences per step (multiples of 4)")
    parser.add_argument("--lengths", default="32,128,512", help="new tokens per response")
    parser.add_argument("--cells", default=None, help="only these cells, e.g. 16x32,64x512 (default: every cell)")
    parser.add_argument("--steps", type=int, default=3, help="steps per side and cell (step 1 is not timed)")
    parser.add_argument("--big-steps", type=int, default=2, help="steps in cells of sequences x new tokens >= --big-cell")
    parser.add_argument("--big-cell", type=int, default=64 * 512)
    parser.add_argument("--cell-timeout", type=float, default=1200.0, help="seconds one side of one cell may run")
    parser.add_argument("--quiet", type=float, default=15.0,
                        help="before each side, wait until the cores are under this %% busy (0: do not wait)")
    parser.add_argument("--quiet-wait", type=float, default=600.0, help="seconds to wait for --quiet at most")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="default",
                        help="default: each side's own; fp32 / bf16: both sides in it (peer_job.PRECISIONS)")
    parser.add_argument("--resume", action="store_true", help="keep the cells the existing results finished")
    parser.add_argument("--out-name", default=None, help="results name (default peer_trl_sweep[_<precision>])")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.out_name = args.out_name or "peer_trl_sweep" + ("" if args.precision == "default" else f"_{args.precision}")
    args.batch_list = [int(x) for x in args.batches.split(",") if x.strip()]
    args.length_list = [int(x) for x in args.lengths.split(",") if x.strip()]
    if any(b < SAMPLES or b % SAMPLES for b in args.batch_list):
        parser.error(f"--batches: sequences per step must be multiples of {SAMPLES}")
    if min(args.steps, args.big_steps) < 2:
        parser.error("--steps / --big-steps must be >= 2 (step 1 is not timed)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{args.out_name}.json"
    previous = json.loads(json_path.read_text()) if args.resume and json_path.is_file() else {"cells": []}
    if previous["cells"] and previous["meta"].get("precision", "fp32") != args.precision:
        raise SystemExit(f"--resume: {json_path} holds --precision {previous['meta'].get('precision', 'fp32')} "
                         f"cells, not {args.precision}")
    previous = previous["cells"]
    wanted = [(b, n) for b in args.batch_list for n in args.length_list]
    if args.cells:
        picked = {c.strip() for c in args.cells.split(",") if c.strip()}
        wanted = [(b, n) for b, n in wanted if cell_key(b, n) in picked]
    cells = {c["cell"]: c for c in previous}
    markdown = None
    trl_versions = ensure_trl_venv()
    max_len = JOB["max_prompt_length"] + max(args.length_list)
    job = prepare_job(args.size, max_positions=max(128, 1 << (max_len - 1).bit_length()))
    with tempfile.TemporaryDirectory(prefix="peer-sweep-") as tmp:
        for index, (batch, new_tokens) in enumerate(wanted):
            key = cell_key(batch, new_tokens)
            if args.resume and not args.cells and key in cells and all(
                    cells[key].get(s, {}).get("status") == "ok" for s in ("trl", "hybridrl")):
                continue  # finished before (cells named by --cells are measured again)
            steps = args.big_steps if batch * new_tokens >= args.big_cell else args.steps
            order = ["trl", "hybridrl"] if index % 2 == 0 else ["hybridrl", "trl"]
            cells[key] = run_cell(job, args.size, batch, new_tokens, steps, order, args.cell_timeout, Path(tmp),
                                  (args.quiet, args.quiet_wait), args.precision)
            meta = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "machine_desc": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
                    "python": platform.python_version(), "load_avg_1m": round(os.getloadavg()[0], 2),
                    "trl_versions": trl_versions, "size": args.size, "model": SIZES[args.size], "job": JOB,
                    "weights_sha256": job["weights_sha256"], "steps": args.steps, "big_steps": args.big_steps,
                    "big_cell": args.big_cell, "cell_timeout_s": args.cell_timeout, "token_budget": TOKEN_BUDGET,
                    "quiet_pct": args.quiet, "precision": args.precision,
                    "dropped_env": side_env(None)[1]}
            report = {"name": args.out_name, "meta": meta, "cells": list(cells.values())}
            markdown = write_report(report, out_dir, args.out_name, write_markdown, write_plot)
    print(markdown.read_text() if markdown else f"every cell asked for is finished in {json_path} (--resume)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
