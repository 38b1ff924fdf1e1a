"""`hybridrl bench NAME [ARGS ...]`: run a benchmark script from the source tree's benchmarks/ (results go
to benchmarks/results/). Benchmarks are not installed with the package: they need a source checkout."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from hybridrl.bundled import source_checkout


def bench_dir() -> Path | None:
    """benchmarks/ of the source checkout hybridrl runs from; None for an installed wheel."""
    root = source_checkout()
    return root / "benchmarks" if root is not None and (root / "benchmarks").is_dir() else None


def available() -> list[str]:
    folder = bench_dir()
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")) if folder else []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="benchmark to run (omit to list them)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")


def run(args: argparse.Namespace) -> int:
    folder = bench_dir()
    if folder is None:
        print("hybridrl bench: benchmarks live in the source tree (benchmarks/), which an installed package does not "
              "include; run `hybridrl bench` from a source checkout (pip install -e .)", file=sys.stderr)
        return 2
    names = available()
    if args.name is None:
        print("benchmarks: " + ", ".join(names))
        return 0
    if args.name not in names:
        print(f"hybridrl bench: unknown benchmark {args.name!r}; choose one of {names}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(folder / f"{args.name}.py"), *args.args])
