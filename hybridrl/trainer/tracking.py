"""Run folder and metrics: metrics.jsonl, TensorBoard events, a console line per step, reward/KL curves."""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CONSOLE_KEYS = ("reward_mean", "kl_mean", "pg_loss", "response_len_mean", "tokens_per_s", "step_time_s")


def new_run_dir(base: str | Path | None, algorithm: str) -> Path:
    if base is not None:
        path = Path(base)
    else:
        path = Path("runs") / f"{algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsTracker:
    """Writes one JSON object per step to metrics.jsonl (appending: a resumed run continues the file)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            except ImportError:  # tensorboard is a core dependency; keep running without it if absent
                logger.warning("tensorboard not installed: no event files written")

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint so the file stays one line per step."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def console_line(self, step: int, metrics: dict[str, Any]) -> str:
        parts = [f"step {step}"]
        for key in CONSOLE_KEYS:
            if key in metrics:
                parts.append(f"{key}={_plain(metrics[key]):.4g}")
        return " | ".join(parts)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def plot(self, keys: tuple[str, ...] = ("reward_mean", "kl_mean")) -> Path | None:
        records = self.read()
        if not records:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        present = [k for k in keys if any(k in r for r in records)]
        fig, axes = plt.subplots(1, max(1, len(present)), figsize=(5 * max(1, len(present)), 3.5))
        axes = [axes] if len(present) <= 1 else list(axes)
        for ax, key in zip(axes, present):
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
            ax.set_xlabel("step")
            ax.set_title(key)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        out = self.run_dir / "curves.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
