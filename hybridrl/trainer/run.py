"""A training run: steps up to trainer.steps with a checkpoint every trainer.save_every steps, resumed from a
checkpoint, and recovered from dead or hung workers (tear down, restart, reload the latest checkpoint) up to
trainer.max_restarts times; a dead rollout pool alone is restarted without touching the trainer."""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from hybridrl.controller import WorkerDiedError, WorkerHungError, interrupts
from hybridrl.controller.watchdog import WATCHDOG
from hybridrl.trainer.checkpoint import CheckpointManager
from hybridrl.trainer.loop import NonFiniteError, RLTrainer
from hybridrl.trainer.tracking import new_run_dir

logger = logging.getLogger(__name__)


class RestartsExhaustedError(RuntimeError):
    """A worker died and trainer.max_restarts recoveries were already used."""


def run_training(trainer: RLTrainer, tracker: Any, run_dir: str | Path, resume_from: str | Path | None = None
                 ) -> list[dict[str, float]]:
    """Start the trainer's roles, resume from `resume_from`, train to trainer.steps; the caller closes the
    trainer. Returns every step's metrics."""
    WATCHDOG.configure(trainer.cfg.trainer.hang_timeout_s, run_dir)
    try:
        return _run_with_restarts(trainer, tracker, run_dir, resume_from)
    finally:
        WATCHDOG.configure(None, None)


def fit(trainer: RLTrainer, tracker: Any, checkpoints: CheckpointManager | None = None) -> list[dict[str, float]]:
    """Steps from trainer.step to trainer.steps: metrics logged and shown, checkpoints every save_every steps
    (never of a non-finite step), max_skipped_steps skipped steps in a row end the run."""
    tr, history, skipped_in_a_row = trainer.cfg.trainer, [], 0
    while trainer.step < tr.steps:
        metrics = trainer.train_step()
        skipped_in_a_row = 0 if step_was_finite(metrics) else skipped_in_a_row + 1
        tracker.log(trainer.step, metrics)
        if tr.log_every and trainer.step % tr.log_every == 0:
            line = tracker.show(trainer.step, metrics) if tr.progress_bar else \
                tracker.console_line(trainer.step, metrics)
            if not tr.progress_bar:
                print(line, flush=True)
        history.append(metrics)
        saved = False
        if checkpoints is not None and tr.save_every and trainer.step % tr.save_every == 0:
            if step_was_finite(metrics):
                trainer.save_checkpoint(checkpoints)
                saved = True
            else:  # a poisoned step: keep the previous checkpoint as the one to come back to
                logger.warning("step %d was not finite: no checkpoint written for it", trainer.step)
        if interrupts.pending() is not None:  # a signal held back for this (trainer.save_on_signal)
            _save_on_signal(trainer, checkpoints, metrics, saved)
        if skipped_in_a_row >= tr.max_skipped_steps:  # nothing is being learned any more
            raise NonFiniteError(f"{skipped_in_a_row} steps in a row (up to step {trainer.step}) were not finite "
                                 f"and skipped (trainer.max_skipped_steps={tr.max_skipped_steps}); check the reward "
                                 f"function and lower actor.optim.lr")
    return history


def _save_on_signal(trainer: RLTrainer, checkpoints: CheckpointManager | None, metrics: dict, saved: bool) -> None:
    """The step that was running when the signal came is done: save it (unless it is saved already or not finite),
    then stop. A save that outlasts the grace period is cut off by the wait loop and discarded."""
    if checkpoints is not None and not saved and step_was_finite(metrics):
        logger.warning("%s: saving step %d before stopping (%.0f s of the grace period left)",
                       interrupts.pending().name, trainer.step, interrupts.seconds_left())
        trainer.save_checkpoint(checkpoints)
    interrupts.raise_pending()


def _run_with_restarts(trainer: RLTrainer, tracker: Any, run_dir: str | Path,
                       resume_from: str | Path | None) -> list[dict]:
    tr = trainer.cfg.trainer
    checkpoints = CheckpointManager(run_dir, tr.keep_last)
    trainer.start()
    initial = trainer.driver_state()
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
        tracker.truncate_after(trainer.step)
        checkpoints.discard_after(trainer.step)
    restarts = 0
    while True:
        try:
            return fit(trainer, tracker, checkpoints)
        except WorkerDiedError as exc:  # WorkerHungError too: the watchdog stopped a call without progress
            interrupts.raise_pending()  # workers that died of the stop signal itself (a whole-cgroup SIGTERM)
            restarts += 1
            _recover(trainer, tracker, exc, restarts, checkpoints, initial)


def _recover(trainer: RLTrainer, tracker: Any, exc: WorkerDiedError, restarts: int,
             checkpoints: CheckpointManager, initial: dict) -> None:
    """Restart after a dead or hung worker: the rollout pool alone when it was one of its workers, else every
    role from the latest checkpoint (or the initial state); raise when trainer.max_restarts are used up."""
    limit, step = trainer.cfg.trainer.max_restarts, trainer.step + 1
    what = "hung" if isinstance(exc, WorkerHungError) else "died"
    if restarts <= limit and exc.role == "rollout" and trainer.rollouts is not None:
        logger.warning("rollout pool worker %s during step %d (rank %s: %s); restart %d/%d of the rollout pool only, "
                       "from the actor's current weights", what, step, exc.rank, exc.cause, restarts, limit)
        trainer.restart_rollout_pool()
        return
    if restarts > limit:
        raise RestartsExhaustedError(
            f"a worker {what} at step {step} ({exc.role} rank {exc.rank}: {exc.cause}) and trainer.max_restarts="
            f"{limit} restart(s) are used up; raise trainer.max_restarts or resume later with trainer.resume=auto"
        ) from exc
    logger.warning("worker %s during step %d (%s rank %s: %s); restart %d/%d from the last checkpoint",
                   what, step, exc.role, exc.rank, exc.cause, restarts, limit)
    trainer.close()
    trainer.start()
    latest = checkpoints.latest()
    if latest is not None:
        trainer.load_checkpoint(latest)
    else:  # nothing saved yet: the fresh roles hold the initial weights; rewind the driver too
        trainer.load_driver_state(initial)
    tracker.truncate_after(trainer.step)


def step_was_finite(metrics: dict[str, float]) -> bool:
    """False for a skipped step or one with NaN/inf metrics or a skipped optimizer step: never checkpointed."""
    if metrics.get("skipped"):
        return False
    if metrics.get("actor/update_ok", 1.0) < 1:
        return False
    return all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


def run_dir_for(cfg: Any) -> Path:
    return new_run_dir(cfg.trainer.run_dir, cfg.algorithm.name)
