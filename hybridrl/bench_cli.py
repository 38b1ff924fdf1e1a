"""`hybridrl bench NAME [ARGS ...]`: run a benchmark script from benchmarks/ (results go to benchmarks/results/)."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def available() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="benchmark to run (omit to list them)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")


def run(args: argparse.Namespace) -> int:
    names = available()
    if not BENCH_DIR.is_dir():
        print(f"hybridrl bench: no benchmarks/ folder next to the package ({BENCH_DIR}); use a source checkout",
              file=sys.stderr)
        return 2
    if args.name is None:
        print("benchmarks: " + ", ".join(names))
        return 0
    if args.name not in names:
        print(f"hybridrl bench: unknown benchmark {args.name!r}; choose one of {names}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(BENCH_DIR / f"{args.name}.py"), *args.args])
