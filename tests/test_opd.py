"""On-policy distillation end to end: a teacher made by a short GRPO run on the bundled task (what
scripts/make_opd_teacher.py makes tiny:opd_teacher with, shortened), then configs/opd_tiny.yaml distils it into the
student from its random start: the student's reverse KL to the teacher falls every few steps and its reward rises."""
from __future__ import annotations

import pytest

from hybridrl.config import load_config
from hybridrl.trainer.loop import RLTrainer
from hybridrl.trainer.made_teacher import make_opd_teacher
from hybridrl.trainer.plan import plan_run

pytestmark = pytest.mark.slow


def test_student_distils_a_teacher_a_short_run_made(ray_two_devices, tmp_path):
    teacher, made = make_opd_teacher(tmp_path / "teacher", steps=20)
    assert made[-1]["reward_mean"] > made[0]["reward_mean"] + 0.3  # the teacher learnt the task (0.10 -> ~0.65)
    cfg = load_config("opd_tiny", [f"algorithm.distill.teacher={teacher}", "trainer.steps=12", "trainer.trackers=[]"])
    plan = plan_run(cfg)
    assert plan.step.teacher and plan.step.old_log_probs and "ref" not in plan.roles
    trainer = RLTrainer(cfg, plan)
    try:
        trainer.start()
        history = [trainer.train_step() for _ in range(cfg.trainer.steps)]
    finally:
        trainer.close()
    kl = [m["distill/reverse_kl"] for m in history]
    reward = [m["reward_mean"] for m in history]
    assert kl[-1] < 0.7 * kl[0] and all(b < a for a, b in zip(kl[::4], kl[4::4])), kl  # 3.3 -> ~1.5 (README)
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.1, reward
    assert all(m["actor/update_ok"] == 1.0 for m in history)
