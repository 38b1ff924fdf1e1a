"""`hybridrl report RUN_DIR`: PNGs are real images, report.md numbers equal those computed from the file."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from hybridrl.cli import main
from hybridrl.trainer.report import ReportError, load_metrics, write_report

STAGES = ("generation", "transition", "reward", "old_log_probs", "reference", "actor_update")
TOP_LEVEL = tuple(s for s in STAGES if s != "transition")  # transition is timed within generation
PNGS = ("reward.png", "kl.png", "throughput.png", "stage_times.png")


def _synthetic_records(n: int = 6) -> list[dict]:
    records = []
    for step in range(1, n + 1):
        stage = {f"time/{name}": round(0.1 * (i + 1) + 0.01 * step, 4) for i, name in enumerate(STAGES)}
        stage["time/generation"] += 1.0  # includes the transition
        records.append({
            "step": step,
            "reward_mean": [0.10, 0.35, 0.30, 0.80, 0.55, 0.70][step - 1],
            "reward_std": 0.05 * step,
            "kl_mean": 0.001 * step * step,
            "kl_coef": 0.1 - 0.005 * step,
            "tokens_per_s": 1000.0 + 37.5 * step,
            "response_length_mean": 20.0 + step,
            "prompt_length_mean": 16.0,
            **stage,
            "time/step": round(sum(stage[f"time/{s}"] for s in TOP_LEVEL) + 0.2, 4),  # 0.2 s untimed
            "actor/pg_loss": -0.01 * step,
            "actor/grad_norm": 1.5 / step,
        })
    return records


def _write_run(run_dir: Path, records: list[dict], config: str | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (run_dir / "config.yaml").write_text(config)
    return run_dir


def _table(markdown: str, header: str) -> dict[str, list[str]]:
    """Rows of the Markdown table right after '## header', keyed by the first cell."""
    section = markdown.split(f"## {header}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100
        # a drawn plot, not a blank canvas
        assert len(image.convert("L").getcolors(maxcolors=1 << 16) or range(300)) > 2


def test_report_cli_writes_plots_and_exact_summary(tmp_path, capsys):
    records = _synthetic_records()
    run = _write_run(tmp_path / "run", records, config="algorithm: remax\nactor:\n  tp: 2\n")

    assert main(["report", str(run)]) == 0
    out_dir = run / "report"
    assert "report.md" in capsys.readouterr().out
    for name in PNGS:
        _assert_png(out_dir / name)
    markdown = (out_dir / "report.md").read_text()
    n = len(records)

    assert f"- steps: {n} (step 1 to {n})" in markdown
    # reward: first, last, best (step 4, 0.80)
    reward = _table(markdown, "Reward")
    assert reward["first"] == ["1", "0.1"] and reward["last"] == ["6", "0.7"] and reward["best"] == ["4", "0.8"]
    # mean stage times and their share of the total step time, computed here from the records
    stages = _table(markdown, "Stage times")
    assert list(stages)[1:] == [*(s if s != "transition" else "transition (within generation)" for s in STAGES),
                                "(untimed)", "step (total)"]
    stages["transition"] = stages.pop("transition (within generation)")
    total_step = sum(r["time/step"] for r in records)
    for name in STAGES:
        mean_text, share_text = stages[name]
        stage_total = sum(r[f"time/{name}"] for r in records)
        assert float(mean_text) == pytest.approx(stage_total / n, rel=1e-3)
        assert float(share_text.rstrip("%")) == pytest.approx(100 * stage_total / total_step, abs=0.05)
    untimed_mean, untimed_share = stages["(untimed)"]
    assert float(untimed_mean) == pytest.approx(0.2, rel=1e-3)
    assert float(untimed_share.rstrip("%")) == pytest.approx(100 * 0.2 * n / total_step, abs=0.05)
    assert float(stages["step (total)"][0]) == pytest.approx(total_step / n, rel=1e-3)
    # throughput
    tps = [r["tokens_per_s"] for r in records]
    match = re.search(r"- tokens/s: mean ([\d.e+-]+), last ([\d.e+-]+)", markdown)
    assert float(match[1]) == pytest.approx(sum(tps) / n, rel=1e-3)
    assert float(match[2]) == pytest.approx(tps[-1], rel=1e-3)
    # KL and last losses
    kl = _table(markdown, "KL")
    assert float(kl["kl_mean last"][0]) == pytest.approx(records[-1]["kl_mean"], rel=1e-3)
    assert float(kl["kl_coef last"][0]) == pytest.approx(records[-1]["kl_coef"], rel=1e-3)
    losses = _table(markdown, "Losses (last step)")
    assert float(losses["actor/pg_loss"][0]) == pytest.approx(records[-1]["actor/pg_loss"], rel=1e-3)
    assert "actor/grad_norm" in losses
    # plots linked, config embedded
    for name in PNGS:
        assert f"]({name})" in markdown
    assert "```yaml\nalgorithm: remax\nactor:\n  tp: 2\n```" in markdown


def test_report_out_dir_partial_metrics_and_nan(tmp_path):
    # GRPO-like run without KL or throughput; one step's reward diverged (stored as "nan");
    # a resumed run repeated step 2 (the last line of a step wins).
    records = [{"step": 1, "reward_mean": 0.5, "time/generation": 1.0, "time/step": 2.0},
               {"step": 2, "reward_mean": 0.1, "time/generation": 9.0, "time/step": 9.0},
               {"step": 3, "reward_mean": "nan", "time/generation": 1.0, "time/critic": 0.5, "time/step": 2.0},
               {"step": 2, "reward_mean": 0.9, "time/generation": 1.0, "time/step": 2.0}]
    run = _write_run(tmp_path / "run", records)
    report = write_report(run, tmp_path / "elsewhere")

    assert report.out_dir == tmp_path / "elsewhere" and not (run / "report").exists()
    assert sorted(p.name for p in report.plots) == ["reward.png", "stage_times.png"]
    for path in report.plots:
        _assert_png(path)
    s = report.summary
    assert s.steps == 3 and (s.first_step, s.last_step) == (1, 3)
    assert s.reward == {"first": (1, 0.5), "last": (2, 0.9), "best": (2, 0.9)}
    assert s.stage_mean_s == {"time/generation": pytest.approx(1.0), "time/critic": pytest.approx(0.5 / 3)}
    assert s.stage_share["time/critic"] == pytest.approx(0.5 / 6.0)
    assert s.untimed_share == pytest.approx(1 - 3.5 / 6.0)
    assert s.tokens_per_s_mean is None and s.kl == {}
    markdown = report.markdown.read_text()
    assert "Not drawn (metrics never logged): kl.png, throughput.png" in markdown
    assert "## Config" not in markdown


def test_report_bad_input_errors(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["report", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "metrics.jsonl" in err

    empty_dir = tmp_path / "no_metrics"
    empty_dir.mkdir()
    assert main(["report", str(empty_dir)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert not (empty_dir / "report").exists()  # nothing written before the input is checked

    (empty_dir / "metrics.jsonl").write_text("\n")
    with pytest.raises(ReportError, match="is empty"):
        load_metrics(empty_dir)

    (empty_dir / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 1.0}\n{"step": 2, "rew\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: not valid JSON"):
        load_metrics(empty_dir)
    (empty_dir / "metrics.jsonl").write_text('{"reward_mean": 1.0}\n')
    with pytest.raises(ReportError, match=r':1: .*integer "step"'):
        load_metrics(empty_dir)

    run = _write_run(tmp_path / "run", _synthetic_records(2))
    (tmp_path / "a_file").write_text("x")
    assert main(["report", str(run), "--out", str(tmp_path / "a_file")]) == 2
    assert "is a file" in capsys.readouterr().err
