"""Write a benchmark's results as JSON + a Markdown table under benchmarks/results/.

    from benchmarks._results import write_results   (or `from _results import ...` inside benchmarks/)
    json_path, md_path = write_results("controller", rows, meta={"machine": ...}, columns=["case", "ms"])
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def default_meta() -> dict:
    """Facts about the run every result should carry (when, where, how loaded the machine was)."""
    meta: dict[str, Any] = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "host_cpus": os.cpu_count(), "python": platform.python_version(),
                            "machine": platform.machine()}
    if hasattr(os, "getloadavg"):
        meta["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return meta


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    if value is None:
        return ""
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name: str, rows: list[dict], meta: dict, columns: list[str] | None = None,
                  out_dir: Path | str | None = None) -> tuple[Path, Path]:
    """Write results/<name>.json ({"name", "meta", "rows"}) and results/<name>.md (meta list + table).

    columns picks and orders the table's columns (default: every key, in first-seen order); the
    JSON always keeps every key. Returns (json_path, md_path).
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"write_results: name {name!r} must be a plain file stem like 'controller'")
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps({"name": name, "meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    meta_lines = [f"- {key}: {_cell(value)}" for key, value in meta.items()]
    md_path.write_text(f"# {name}\n\n" + "\n".join(meta_lines) + "\n\n" + markdown_table(rows, columns) + "\n")
    return json_path, md_path
