"""On-policy distillation alone (Agarwal et al. 2024, GKD; Thinking Machines' on-policy distillation): no task
advantage; each sampled token's advantage is the teacher's term that the trainer adds for every algorithm with
algorithm.distill.teacher set (algorithms/distill.py): -coef * (log pi_student - log pi_teacher). Rewards are
still scored, for the metrics."""
import torch

from hybridrl.algorithms.base import AdvantageInputs, AdvantageResult
from hybridrl.algorithms.registry import register_algorithm


@register_algorithm("opd", uses_reference=False, needs_teacher=True)
def opd(x: AdvantageInputs) -> AdvantageResult:
    zeros = torch.zeros_like(x.mask, dtype=torch.float32)
    return AdvantageResult(zeros, zeros.clone(), x.token_rewards)
