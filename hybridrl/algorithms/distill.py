"""On-policy distillation (algorithm.distill): a teacher's per-token log-probs of the student's own samples turn
into a dense per-token advantage, added to whatever the algorithm estimated (or alone: algorithm.name=opd).

reverse_kl: the per-token estimate of KL(pi_student || pi_teacher) on a token y_t the student sampled is
    d_t = log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)
and the advantage of that token gains -coef * d_t: tokens the teacher finds likelier than the student are pushed
up. Its expectation over the student's samples is the reverse KL, logged every step as distill/reverse_kl (the
mean of d_t over response tokens). A distillation term is registered by name (`@register_distill_mode`):
`fn(student_log_probs, teacher_log_probs, mask) -> [B, T]` per-token divergence, whose negative (times coef) is
added to the advantages.
"""
from __future__ import annotations

from typing import Callable

import torch

from hybridrl.algorithms.losses import masked_mean
from hybridrl.registry import Registry

DistillTerm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

DISTILL_MODES = Registry("distillation mode", "@register_distill_mode in a module named by algorithm.module")


def register_distill_mode(name: str) -> Callable[[DistillTerm], DistillTerm]:
    def decorate(fn: DistillTerm) -> DistillTerm:
        DISTILL_MODES.add(name, fn, fn)
        return fn
    return decorate


@register_distill_mode("reverse_kl")
def reverse_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log pi_student - log pi_teacher on the sampled tokens (0 on padding)."""
    return (student.float() - teacher.float()) * mask


def check_distill_mode(mode: str) -> None:
    DISTILL_MODES.lookup(mode, subject=f"algorithm.distill.mode={mode!r}")


def distill_advantages(advantages: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                       coef: float, mode: str = "reverse_kl") -> tuple[torch.Tensor, dict[str, float]]:
    """advantages [B, T] + (-coef * the mode's per-token divergence), and distill/<mode> (its masked mean)."""
    mask = mask.float()
    divergence = DISTILL_MODES.lookup(mode, subject=f"algorithm.distill.mode={mode!r}")(student, teacher, mask)
    return (advantages - coef * divergence) * mask, {f"distill/{mode}": float(masked_mean(divergence, mask))}
