"""`hybridrl report RUN_DIR [--out DIR]`: plots and a Markdown summary of a run (trainer/report.py)."""
from __future__ import annotations

import argparse
import sys

from hybridrl.trainer.report import ReportError, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run's folder (holds metrics.jsonl)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where to write report.md and the PNGs (default: RUN_DIR/report)")


def run(args: argparse.Namespace) -> int:
    try:
        report = write_report(args.run_dir, args.out)
    except ReportError as exc:
        print(f"hybridrl report: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {report.markdown} and {len(report.plots)} plots: "
          f"{', '.join(p.name for p in report.plots) or 'none'}")
    return 0
