"""Run checkpoints on disk: RUN/ckpt/step_N/, written atomically, the newest named by RUN/ckpt/latest.

A checkpoint folder holds
    actor/model/         Megatron distributed checkpoint of the policy (loads at any TP/PP; `hybridrl convert
                         --from ckpt --to hf` exports it)
    actor/optimizer/     the optimizer's sharded state (model space, so it reshards too), LR scheduler, steps
    actor/rng/           per-rank RNG states (torch, Megatron's RNG tracker)
    critic/ ...          the same for each trained value model (critic, cost_critic)
    driver.pt            the driver: step, prompt-loader position, KL controller, Lagrange multiplier, the
                         actor's seed counter, torch / python / numpy RNG states. Written last.

Atomicity: everything is written into step_N.tmp-XXXX, which is renamed to step_N only when complete, and
`latest` is replaced (write + os.replace) after the rename. A crash at any point leaves the previous
checkpoint valid; leftover *.tmp-* folders are ignored and removed by the next save. Workers write into the
same folder as the driver, so on several nodes RUN must be on a shared filesystem.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from hybridrl.config import MachineError
from hybridrl.models.lora_io import ADAPTER_DIR
from hybridrl.models.peft import ADAPTER_CONFIG

logger = logging.getLogger(__name__)

CKPT_DIR = "ckpt"
LATEST = "latest"
DRIVER_STATE = "driver.pt"
ACTOR_DIR = "actor"
_STEP_PATTERN = re.compile(r"^step_(\d+)$")


class CheckpointNotFoundError(FileNotFoundError):
    """trainer.resume / a convert source names no usable checkpoint."""


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def is_complete(path: str | Path) -> bool:
    """A checkpoint folder that finished writing (driver state present, the actor's weights and metadata; a LoRA
    actor's adapter folder)."""
    path = Path(path)
    return (path / DRIVER_STATE).is_file() and ((path / ACTOR_DIR / "model" / "metadata.json").is_file() or
                                                (path / ACTOR_DIR / ADAPTER_DIR / ADAPTER_CONFIG).is_file())


def checkpoint_step(path: str | Path) -> int:
    match = _STEP_PATTERN.match(Path(path).name)
    if not match:
        raise CheckpointNotFoundError(f"{path}: not a checkpoint folder (expected .../ckpt/step_N)")
    return int(match.group(1))


class CheckpointManager:
    """The checkpoints of one run folder: atomic saves, `latest`, pruning to the last `keep_last`."""

    def __init__(self, run_dir: str | Path, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"trainer.keep_last={keep_last} must be >= 1 (checkpoints kept)")
        self.root = Path(run_dir) / CKPT_DIR
        self.keep_last = keep_last

    def steps(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_PATTERN.match(child.name)
            if match and child.is_dir() and is_complete(child):
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint: the one `latest` names if it is complete, else the highest step."""
        marker = self.root / LATEST
        if marker.is_file():
            named = self.root / marker.read_text().strip()
            if is_complete(named):
                return named
            logger.warning("%s names %s, which is incomplete or missing; using the newest complete checkpoint",
                           marker, named.name)
        found = self.steps()
        return found[-1][1] if found else None

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for step `step` (stale ones from a killed save are removed first)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.discard_partial()
        return Path(tempfile.mkdtemp(prefix=f"{step_dir_name(step)}.tmp-", dir=self.root))

    def discard_partial(self) -> None:
        """Remove folders of saves that never finished (a killed or interrupted run)."""
        for stale in self.root.glob("step_*.tmp-*"):
            logger.warning("removing %s left by an interrupted save", stale)
            shutil.rmtree(stale, ignore_errors=True)

    def commit(self, tmp: Path, step: int) -> Path:
        """Publish a completely written temporary folder as step_N, point `latest` at it, prune old ones."""
        if not is_complete(tmp):
            raise RuntimeError(f"{tmp}: checkpoint incomplete, not published")
        final = self.root / step_dir_name(step)
        if final.exists():  # the same step saved again (a run recovered to an earlier checkpoint)
            old = final.with_name(f"{final.name}.old-{os.getpid()}")
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
        marker_tmp = self.root / f"{LATEST}.tmp-{os.getpid()}"
        marker_tmp.write_text(final.name + "\n")
        os.replace(marker_tmp, self.root / LATEST)
        for _, path in self.steps()[:-self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        logger.info("checkpoint saved: %s", final)
        return final

    def out_of_space(self, exc: BaseException, step: int, slack_bytes: int = 1 << 20) -> MachineError | None:
        """For a save that failed: the one-line MachineError when the disk is full (ENOSPC in the error, also a
        worker's; or, before the partial folder is removed, less than `slack_bytes` left on the checkpoint
        folder's filesystem: Megatron's writer and torch.save report a full disk in their own words), else None."""
        try:
            stats = os.statvfs(self.root)
            full = stats.f_bavail * stats.f_frsize < slack_bytes
        except OSError:
            full = False
        text = f"{exc} {getattr(exc, 'remote_traceback', '')}"
        if not (full or getattr(exc, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in text):
            return None
        latest = self.latest()
        kept = f"; the last complete checkpoint, {latest}, is intact" if latest else ""
        return MachineError.writing(self.root, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                                    f" while saving step {step}{kept}")

    def discard_after(self, step: int) -> None:
        """Drop checkpoints newer than `step` (a run resumed from an earlier one writes them again)."""
        for found, path in self.steps():
            if found > step:
                shutil.rmtree(path, ignore_errors=True)


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """trainer.resume -> the checkpoint folder to load, or None to start fresh.

    never: None. auto: the run folder's latest complete checkpoint, or None when it has none. PATH: a
    step_N folder, a ckpt folder or a run folder (its latest complete checkpoint); an error when none is there.
    """
    if resume == "never":
        return None
    if resume == "auto":
        found = CheckpointManager(run_dir).latest()
        if found is None:
            logger.info("trainer.resume=auto: no checkpoint in %s; starting from step 0", Path(run_dir) / CKPT_DIR)
        return found
    path = Path(resume).expanduser()
    if is_complete(path):
        return path
    run = path.parent if path.name == CKPT_DIR else path  # a ckpt folder or a run folder
    found = CheckpointManager(run).latest() if path.is_dir() else None
    if found is not None:
        return found
    raise CheckpointNotFoundError(
        f"trainer.resume={resume!r}: no complete checkpoint there (a run folder, its ckpt/ folder or a "
        f"ckpt/step_N folder with {DRIVER_STATE} and {ACTOR_DIR}/model); use trainer.resume=auto or never")


def actor_model_dir(path: str | Path) -> Path:
    """The policy's Megatron checkpoint inside a run checkpoint (a step_N folder or its actor/ folder)."""
    path = Path(path)
    for candidate in (path / ACTOR_DIR / "model", path / "model", path):
        if (candidate / "metadata.json").is_file():
            return candidate
    raise CheckpointNotFoundError(f"{path}: no actor checkpoint there (expected {path / ACTOR_DIR / 'model'}); "
                                  f"give a RUN/ckpt/step_N folder")


def actor_adapter_dir(path: str | Path) -> Path | None:
    """A LoRA actor's adapters (a PEFT adapter folder) inside a run checkpoint, or None for a full checkpoint."""
    path = Path(path)
    for candidate in (path / ACTOR_DIR / ADAPTER_DIR, path / ADAPTER_DIR, path):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    return None


def rng_states() -> dict[str, Any]:
    """The driver's torch / python / numpy RNG states."""
    import numpy as np

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_states(states: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])


def save_driver_state(folder: Path, state: dict[str, Any]) -> None:
    torch.save(state, folder / DRIVER_STATE)


def load_driver_state(folder: Path) -> dict[str, Any]:
    return torch.load(folder / DRIVER_STATE, weights_only=False)
