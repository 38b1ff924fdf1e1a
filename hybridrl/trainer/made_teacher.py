"""`tiny:opd_teacher`, the teacher of configs/opd_tiny.yaml: what a short GRPO run on the bundled task trains
(configs/grpo_tiny.yaml for TEACHER_STEPS steps at its seed), exported as a Hugging Face folder into the cache
where `tiny:opd_teacher` resolves (models/tiny.py made_model_dir). `python scripts/make_opd_teacher.py` runs it."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hybridrl.config import load_config
from hybridrl.models.tiny import made_model_dir
from hybridrl.trainer.loop import RLTrainer
from hybridrl.trainer.plan import plan_run

TEACHER_CONFIG = "grpo_tiny"
TEACHER_STEPS = 30


def make_opd_teacher(out_dir: str | Path | None = None, steps: int = TEACHER_STEPS,
                     overrides: tuple[str, ...] = ()) -> tuple[Path, list[dict]]:
    """Train the teacher (on the Ray cluster this driver runs, or a local one) and write it to `out_dir` (default:
    the cache folder of tiny:opd_teacher), atomically. Returns the folder and the run's per-step metrics."""
    target = Path(out_dir) if out_dir is not None else made_model_dir("opd_teacher")
    cfg = load_config(TEACHER_CONFIG, [f"trainer.steps={steps}", "trainer.trackers=[]", *overrides])
    trainer = RLTrainer(cfg, plan_run(cfg))
    try:
        trainer.start()
        history = [trainer.train_step() for _ in range(steps)]
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            trainer.roles["actor"].save_hf(str(staging))
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        trainer.close()
    return target, history
