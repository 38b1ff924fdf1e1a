"""Plots (PNG) and a Markdown summary of a run's metrics.jsonl (`hybridrl report`, cli/report.py).

Writes into RUN_DIR/report (or --out): reward.png (mean +- std), kl.png (KL and its coefficient),
throughput.png (tokens/s), stage_times.png (stacked seconds per stage, with the step total) and
report.md (steps, first/last/best reward, mean stage times and their share of the step, tokens/s).
A plot whose metrics the run never logged is left out (and the summary says so).
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from hybridrl.trainer.timers import STAGE_PREFIX, STEP_KEY

logger = logging.getLogger(__name__)

# Known stages in the order a step runs them; stages not listed here follow, sorted.
STAGE_ORDER = ("generation", "transition", "reward", "old_log_probs", "reference", "critic", "actor_update")
# Stages measured inside another one: the hybrid engine's transition happens within generate_sequences,
# so "time/generation" already includes "time/transition" (the loop adds the worker-measured seconds).
NESTED_STAGES = {"time/transition": "time/generation"}
LOSS_PREFIXES = ("actor/", "critic/")


class ReportError(ValueError):
    """Bad input for a report (missing/empty/corrupt metrics.jsonl); the message names the fix."""


@dataclass
class RunSummary:
    steps: int
    first_step: int
    last_step: int
    reward: dict[str, tuple[int, float]] = field(default_factory=dict)  # first/last/best -> (step, value)
    stage_mean_s: dict[str, float] = field(default_factory=dict)  # "time/<stage>" -> mean s per step
    stage_share: dict[str, float] = field(default_factory=dict)  # "time/<stage>" -> fraction of time/step
    step_mean_s: float | None = None
    untimed_share: float | None = None  # share of time/step outside every top-level stage
    tokens_per_s_mean: float | None = None
    tokens_per_s_last: float | None = None
    kl: dict[str, float] = field(default_factory=dict)  # kl_mean first/last, kl_coef last
    last_losses: dict[str, float] = field(default_factory=dict)


def _number(value: object) -> float | None:
    """A finite float, or None (missing, non-numeric, or "nan"/"inf" as metrics.jsonl stores them)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def load_metrics(run_dir: str | Path) -> list[dict]:
    """Records of RUN_DIR/metrics.jsonl sorted by step (a repeated step keeps its last line)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run folder {str(run_dir)!r} does not exist: pass the folder a training run "
                          f"wrote (it holds metrics.jsonl), e.g. runs/remax-20260101-120000")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"no metrics.jsonl in {str(run_dir)!r}: pass the folder of a training run that "
                          f"has logged at least one step (`hybridrl train ... trainer.run_dir=...`)")
    by_step: dict[int, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path}:{number}: not valid JSON ({exc.msg}); fix or delete that line") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ReportError(f"{path}:{number}: each line must be a JSON object with an integer \"step\"")
        by_step[record["step"]] = record
    if not by_step:
        raise ReportError(f"{path} is empty: the run has not logged a step yet; report after step 1")
    return [by_step[s] for s in sorted(by_step)]


def stage_keys(records: list[dict]) -> list[str]:
    """The "time/<stage>" keys present (not "time/step"), known stages first in running order."""
    present = {k for r in records for k in r if k.startswith(STAGE_PREFIX) and k != STEP_KEY}
    known = [STAGE_PREFIX + s for s in STAGE_ORDER if STAGE_PREFIX + s in present]
    return known + sorted(present - set(known))


def _series(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], v) for r in records if (v := _number(r.get(key))) is not None]


def summarize(records: list[dict]) -> RunSummary:
    """Numbers for report.md. A stage absent from a step counts as 0 s in that step; a stage's share is
    its total seconds over the total of "time/step". Nested stages (NESTED_STAGES) are counted within
    their parent, so only top-level shares plus "untimed" add up to 100%."""
    n = len(records)
    summary = RunSummary(steps=n, first_step=records[0]["step"], last_step=records[-1]["step"])
    rewards = _series(records, "reward_mean")
    if rewards:
        best = max(rewards, key=lambda p: p[1])  # the earliest step on ties
        summary.reward = {"first": rewards[0], "last": rewards[-1], "best": best}
    step_times = [v for _, v in _series(records, STEP_KEY)]
    if step_times:
        summary.step_mean_s = sum(step_times) / len(step_times)
    step_total = sum(step_times)
    for key in stage_keys(records):
        total = sum(v for _, v in _series(records, key))
        summary.stage_mean_s[key] = total / n
        if step_total > 0:
            summary.stage_share[key] = total / step_total
    if step_total > 0:
        top_level = [k for k in summary.stage_share if _parent(k, summary.stage_share) is None]
        summary.untimed_share = 1.0 - sum(summary.stage_share[k] for k in top_level)
    throughput = [v for _, v in _series(records, "tokens_per_s")]
    if throughput:
        summary.tokens_per_s_mean = sum(throughput) / len(throughput)
        summary.tokens_per_s_last = throughput[-1]
    kl = _series(records, "kl_mean")
    if kl:
        summary.kl["kl_mean first"] = kl[0][1]
        summary.kl["kl_mean last"] = kl[-1][1]
    coef = _series(records, "kl_coef")
    if coef:
        summary.kl["kl_coef last"] = coef[-1][1]
    loss_keys = sorted({k for r in records for k in r if k.startswith(LOSS_PREFIXES)})
    for key in loss_keys:
        values = _series(records, key)
        if values:
            summary.last_losses[key] = values[-1][1]
    return summary


def _parent(key: str, present) -> str | None:
    parent = NESTED_STAGES.get(key)
    return parent if parent in present else None


def fmt(value: float) -> str:
    """How report.md writes a number (4 significant digits)."""
    return f"{value:.4g}"


# ---------------------------------------------------------------- plots

def _plot_reward(records, ax) -> bool:
    mean = _series(records, "reward_mean")
    if not mean:
        return False
    std = dict(_series(records, "reward_std"))
    steps = [s for s, _ in mean]
    ax.plot(steps, [v for _, v in mean], marker="o", markersize=3, label="reward_mean")
    if std:
        band = [(s, v, std[s]) for s, v in mean if s in std]
        ax.fill_between([b[0] for b in band], [b[1] - b[2] for b in band], [b[1] + b[2] for b in band],
                        alpha=0.25, label="± reward_std")
    ax.set_title("reward")
    ax.legend(loc="best", fontsize=8)
    return True


def _plot_kl(records, ax) -> bool:
    kl, coef = _series(records, "kl_mean"), _series(records, "kl_coef")
    if not kl and not coef:
        return False
    if kl:
        ax.plot([s for s, _ in kl], [v for _, v in kl], marker="o", markersize=3, color="C0")
        ax.set_ylabel("kl_mean", color="C0")
    if coef:
        twin = ax.twinx() if kl else ax
        twin.plot([s for s, _ in coef], [v for _, v in coef], linestyle="--", color="C1")
        twin.set_ylabel("kl_coef", color="C1")
    ax.set_title("KL to the reference")
    return True


def _plot_throughput(records, ax) -> bool:
    tps = _series(records, "tokens_per_s")
    if not tps:
        return False
    ax.plot([s for s, _ in tps], [v for _, v in tps], marker="o", markersize=3)
    ax.set_ylabel("tokens / s")
    ax.set_title("throughput")
    return True


def _plot_stage_times(records, ax) -> bool:
    keys = stage_keys(records)
    if not keys:
        return False
    steps = [r["step"] for r in records]
    bottom = [0.0] * len(records)
    for key in keys:
        heights = [_number(r.get(key)) or 0.0 for r in records]
        label = key.removeprefix(STAGE_PREFIX)
        children = [k for k in keys if _parent(k, keys) == key]
        if children:  # draw the parent without its nested stages, so the stack adds up to the step
            for child in children:
                heights = [h - (_number(r.get(child)) or 0.0) for h, r in zip(heights, records)]
            label += f" (excl. {', '.join(c.removeprefix(STAGE_PREFIX) for c in children)})"
        ax.bar(steps, heights, bottom=bottom, label=label, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    total = _series(records, STEP_KEY)
    if total:
        ax.plot([s for s, _ in total], [v for _, v in total], color="black", marker="_", linestyle="none",
                markersize=12, label="step (total)")
    ax.set_ylabel("seconds")
    ax.set_title("time per stage")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)  # outside: bars fill the axes
    return True


PLOTS = {"reward.png": _plot_reward, "kl.png": _plot_kl, "throughput.png": _plot_throughput,
         "stage_times.png": _plot_stage_times}


def render_plots(records: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, draw in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 3.6))
        try:
            if draw(records, ax):
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
                fig.tight_layout()
                fig.savefig(out_dir / name, dpi=100)
                written.append(out_dir / name)
        finally:
            plt.close(fig)
    return written


# ---------------------------------------------------------------- markdown

def render_markdown(run_dir: Path, summary: RunSummary, plots: list[Path], config_text: str | None) -> str:
    lines = [f"# Run report: {run_dir.name}", "",
             f"Source: `{run_dir / 'metrics.jsonl'}`", "",
             f"- steps: {summary.steps} (step {summary.first_step} to {summary.last_step})"]
    if summary.step_mean_s is not None:
        lines.append(f"- mean step time: {fmt(summary.step_mean_s)} s")
    if summary.tokens_per_s_mean is not None:
        lines.append(f"- tokens/s: mean {fmt(summary.tokens_per_s_mean)}, last {fmt(summary.tokens_per_s_last)}")
    lines += ["", "## Reward", ""]
    if summary.reward:
        lines += ["| | step | reward_mean |", "|---|---:|---:|"]
        lines += [f"| {name} | {step} | {fmt(value)} |" for name, (step, value) in summary.reward.items()]
    else:
        lines.append("No reward_mean logged.")
    lines += ["", "## Stage times", ""]
    if summary.stage_mean_s:
        lines += ["| stage | mean s / step | share of step |", "|---|---:|---:|"]
        for key, mean in summary.stage_mean_s.items():
            share = summary.stage_share.get(key)
            share_text = f"{100 * share:.1f}%" if share is not None else "-"
            name = key.removeprefix(STAGE_PREFIX)
            parent = _parent(key, summary.stage_mean_s)
            if parent is not None:
                name += f" (within {parent.removeprefix(STAGE_PREFIX)})"
            lines.append(f"| {name} | {fmt(mean)} | {share_text} |")
        untimed = summary.untimed_share
        if summary.step_mean_s is not None and untimed is not None:
            lines.append(f"| (untimed) | {fmt(untimed * summary.step_mean_s)} | {100 * untimed:.1f}% |")
            lines.append(f"| step (total) | {fmt(summary.step_mean_s)} | 100.0% |")
    else:
        lines.append("No stage times (time/<stage>) logged.")
    if summary.kl:
        lines += ["", "## KL", "", "| | value |", "|---|---:|"]
        lines += [f"| {name} | {fmt(value)} |" for name, value in summary.kl.items()]
    if summary.last_losses:
        lines += ["", "## Losses (last step)", "", "| metric | value |", "|---|---:|"]
        lines += [f"| {key} | {fmt(value)} |" for key, value in summary.last_losses.items()]
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    missing = [name for name in PLOTS if name not in {p.name for p in plots}]
    if missing:
        lines += ["", f"Not drawn (metrics never logged): {', '.join(missing)}"]
    if config_text is not None:
        lines += ["", "## Config", "", "```yaml", config_text.rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


@dataclass
class Report:
    out_dir: Path
    markdown: Path
    plots: list[Path]
    summary: RunSummary


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Read RUN_DIR/metrics.jsonl (+ config.yaml if present), write plots and report.md."""
    run_dir = Path(run_dir)
    records = load_metrics(run_dir)  # raises ReportError before anything is written
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {str(out)!r} is a file: pass a folder (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    plots = render_plots(records, out)
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text() if config_path.is_file() else None
    markdown = out / "report.md"
    markdown.write_text(render_markdown(run_dir.resolve(), summary, plots, config_text))
    logger.info("report for %d steps written to %s", summary.steps, out)
    return Report(out_dir=out, markdown=markdown, plots=plots, summary=summary)
