"""Run folder and metrics: metrics.jsonl (always), TensorBoard / wandb / mlflow (optional backends),
a progress bar with one console line per step, and reward/KL curves.

metrics.jsonl is the source of truth (resume truncates it, `hybridrl report` reads it); the other
backends are mirrors. wandb and mlflow are imported only when configured.
"""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from hybridrl.config import MachineError

logger = logging.getLogger(__name__)

# Keys shown on the per-step console line, in this order, when present.
CONSOLE_KEYS = ("reward_mean", "kl_mean", "kl_coef", "actor/pg_loss", "critic/value_loss",
                "response_length_mean", "tokens_per_s", "time/step")
BACKENDS = ("tensorboard", "wandb", "mlflow")
_INSTALL_HINT = {"wandb": "pip install wandb", "mlflow": "pip install mlflow  (or mlflow-skinny)"}


def new_run_dir(base: str | Path | None, algorithm: str) -> Path:
    if base is not None:
        path = Path(base)
    else:
        path = Path("runs") / f"{algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise MachineError(f"trainer.run_dir={path}: cannot write there ({exc.strerror or exc}); choose a folder "
                          f"you can write to") from None
    return path.resolve()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Numeric values as floats (NaN/inf kept: a diverging run should show up in the dashboards)."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, (int, float)):
            out[key] = float(value)
    return out


def _format_value(value: Any) -> str:
    value = _plain(value)
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def check_backends(backends: str | Sequence[str]) -> tuple[str, ...]:
    """Validate tracker backend names and that their packages import; call it before any work starts
    (MetricsTracker does). Returns the names, duplicates dropped."""
    if isinstance(backends, str):
        backends = (backends,)
    chosen = tuple(dict.fromkeys(str(b) for b in backends))
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown tracker backend(s) {unknown} (trainer.trackers): choose from {list(BACKENDS)}")
    for name in chosen:
        if name in _INSTALL_HINT:
            _import_backend(name)
    return chosen


def _import_backend(name: str):
    try:
        if name == "wandb":
            import wandb
            return wandb
        import mlflow
        return mlflow
    except ImportError as exc:
        raise ImportError(f"tracker backend {name!r} is configured but the package is not installed: "
                          f"{_INSTALL_HINT[name]} (or remove {name!r} from the tracker backends)") from exc


class _TensorBoardBackend:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _WandbBackend:
    """One wandb run per run folder; its id is kept in the folder so a resumed run continues it."""

    def __init__(self, run_dir: Path, project: str, run_name: str | None, config: Mapping | None) -> None:
        wandb = _import_backend("wandb")
        id_file = run_dir / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else None
        self.run = wandb.init(project=project, name=run_name or run_dir.name, dir=str(run_dir),
                              config=_plain_config(config), id=run_id, resume="allow" if run_id else None)
        id_file.write_text(self.run.id + "\n")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        # wandb drops steps <= the last one it saw (after a resume those were already logged once).
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _MlflowBackend:
    """An MLflow run in experiment ``project``; the run id is kept in the folder for resume."""

    def __init__(self, run_dir: Path, project: str, run_name: str | None, config: Mapping | None,
                 tracking_uri: str | None) -> None:
        _import_backend("mlflow")
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri)
        id_file = run_dir / "mlflow_run_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else None
        if run_id is not None:
            try:
                self._client.get_run(run_id)
                self._client.update_run(run_id, status="RUNNING")
            except MlflowException:
                logger.warning("mlflow run %s from %s not found in this tracking store; starting a new run",
                               run_id, id_file)
                run_id = None
        if run_id is None:
            experiment = self._client.get_experiment_by_name(project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self._client.create_experiment(project))
            run_id = self._client.create_run(experiment_id, run_name=run_name or run_dir.name).info.run_id
            params = [Param(k, v) for k, v in _flat_params(_plain_config(config)).items()]
            for i in range(0, len(params), 100):  # the store takes at most 100 params per batch
                self._client.log_batch(run_id, params=params[i:i + 100])
            id_file.write_text(run_id + "\n")
        self.run_id = run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in scalars.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _plain_config(config: Mapping | None) -> dict:
    """A plain nested dict (OmegaConf configs resolved) for wandb config / MLflow params."""
    if config is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:
        pass
    return dict(config)


def _flat_params(config: Mapping, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat_params(value, name + "."))
        else:
            out[name] = str(value)[:500]  # MLflow caps param values; keep them short
    return out


class MetricsTracker:
    """Writes one JSON object per step to metrics.jsonl (appending: a resumed run continues the file)
    and mirrors the numbers to the configured backends.

    ``backends``: any of "tensorboard", "wandb", "mlflow"; None means ("tensorboard",) if
    ``tensorboard`` else (). ``project`` / ``run_name`` name the wandb project / MLflow experiment and
    the run (default: the run folder's name); ``config`` is recorded as wandb config / MLflow params.
    ``mlflow_tracking_uri``: None uses MLflow's default (MLFLOW_TRACKING_URI). ``total_steps`` sizes the
    progress bar of :meth:`show`; ``progress_bar=False`` prints the per-step lines without a bar.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, backends: Sequence[str] | None = None,
                 project: str = "hybridrl", run_name: str | None = None, config: Mapping | None = None,
                 mlflow_tracking_uri: str | None = None, total_steps: int | None = None,
                 progress_bar: bool = True):
        chosen = check_backends(backends) if backends is not None else (("tensorboard",) if tensorboard else ())
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self.progress_bar = progress_bar
        self._console: Console | None = None
        self._backends: dict[str, Any] = {}
        try:
            for name in chosen:
                if name == "tensorboard":
                    try:
                        self._backends[name] = _TensorBoardBackend(self.run_dir)
                    except ImportError:  # a core dependency; keep running without it if absent
                        logger.warning("tensorboard not installed: no event files written")
                elif name == "wandb":
                    self._backends[name] = _WandbBackend(self.run_dir, project, run_name, config)
                else:
                    self._backends[name] = _MlflowBackend(self.run_dir, project, run_name, config,
                                                          mlflow_tracking_uri)
        except BaseException:
            self.close()
            raise

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends actually writing (metrics.jsonl is always written)."""
        return tuple(self._backends)

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint so the file stays one line per step."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items() if k != "step"}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in _scalars(metrics).items() if k != "step"}
        for backend in self._backends.values():
            backend.log(step, scalars)

    def console_line(self, step: int, metrics: dict[str, Any]) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {step}{total}"]
        for key in CONSOLE_KEYS:
            if key in metrics:
                parts.append(f"{key}={_format_value(metrics[key])}")
        return " | ".join(parts)

    def show(self, step: int, metrics: dict[str, Any]) -> str:
        """Per-step console output: advance the progress bar to ``step`` and print one metrics line."""
        if self._console is None:
            self._console = Console(total_steps=self.total_steps, initial_step=max(step - 1, 0),
                                    show_bar=self.progress_bar)
        line = self.console_line(step, metrics)
        self._console.update(step, line)
        return line

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
        if self._console is not None:
            self._console.close()
            self._console = None
        backends, self._backends = self._backends, {}
        for name, backend in backends.items():
            try:
                backend.close()
            except Exception:  # closing one backend must not keep the others open
                logger.exception("closing tracker backend %s failed", name)


class Console:
    """A progress bar over training steps plus one printed line per step.

    Uses tqdm when installed (its bar hides itself when ``stream`` is not a terminal unless
    ``use_tqdm=True`` forces it); otherwise prefixes each line with a plain ``[#####.....]`` bar.
    ``show_bar=False``: the lines only.
    """

    def __init__(self, total_steps: int | None = None, initial_step: int = 0, stream: TextIO | None = None,
                 use_tqdm: bool | None = None, width: int = 20, show_bar: bool = True) -> None:
        if total_steps is not None and total_steps < 0:
            raise ValueError(f"Console(total_steps={total_steps}): must be >= 0 or None")
        self.total_steps = total_steps
        self._stream = stream
        self._width = width
        self._show_bar = show_bar
        self._last = initial_step
        self._start = time.monotonic()
        self._bar = None
        if show_bar and use_tqdm is not False:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                if use_tqdm:
                    raise ImportError("Console(use_tqdm=True) but tqdm is not installed: pip install tqdm")
            else:
                self._tqdm_write = tqdm.write
                # disable=None: tqdm hides the bar on a non-terminal (log files, Slurm output)
                self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", file=self.stream,
                                 dynamic_ncols=True, disable=None if use_tqdm is None else False,
                                 leave=True)

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def update(self, step: int, line: str) -> None:
        advance = max(step - self._last, 0)
        self._last = max(step, self._last)
        if self._bar is not None:
            self._tqdm_write(line, file=self.stream)
            self._bar.update(advance)
            return
        self.stream.write(self._plain_bar() + line + "\n")
        self.stream.flush()

    def _plain_bar(self) -> str:
        if not self.total_steps or not self._show_bar:
            return ""
        done = min(self._last / self.total_steps, 1.0)
        filled = int(round(done * self._width))
        elapsed = time.monotonic() - self._start
        return f"[{'#' * filled}{'.' * (self._width - filled)}] {done:4.0%} {elapsed:.0f}s | "

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
