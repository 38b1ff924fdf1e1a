"""Reward sources combined in one place: rule functions, scalar reward models and generative judges, each with a
weight; the reward is the weighted sum of their scores (reward.sources; a run without it has one source: the
reward_model section, or the rule function).

A source kind is registered by name (`@register_reward_source`): a builder that starts the scorer from the
source's SourceSpec and where it runs. A scorer's `submit(rollout)` returns something whose `result()` is the
source's SourceScores; every source is submitted before any is waited for, so judges and reward models on pools
of their own score at the same time. Metrics per step: reward/<name>_mean for each source (over the samples it
kept), reward/judge_parse_errors (verdicts that could not be parsed, all judges) and reward/judge_dropped
(samples left out of the update by on_parse_error=drop).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from hybridrl.config import ScoreModelConfig
from hybridrl.controller import ResourcePool
from hybridrl.parallel.layout import ParallelLayout
from hybridrl.registry import Registry
from hybridrl.roles.judge import Judge
from hybridrl.roles.reward import RewardModel


@dataclass(frozen=True)
class SourceSpec:
    """One reward source as the run plan resolved it."""
    name: str  # reward/<name>_mean
    kind: str  # a registered source kind: rule | scalar | generative
    weight: float = 1.0
    fn: str | None = None  # rule: the function's dotted path
    scorer: ScoreModelConfig | None = None  # model kinds: the section (model a local folder, generation resolved)
    role: str | None = None  # model kinds: the role's name (its worker group)


@dataclass
class SourceScores:
    scores: torch.Tensor  # [B]
    valid: torch.Tensor  # [B] bool: False where the sample is dropped
    parse_errors: int | None = None  # judges: unparsable verdicts


@dataclass(frozen=True)
class Placement:
    """Where a model source runs and how its calls behave."""
    pool: ResourcePool | None = None
    layout: ParallelLayout | None = None
    seed: int = 1
    call_timeout_s: float | None = 3600.0
    num_workers: int = 0  # rule functions: CPU Ray tasks


@dataclass(frozen=True)
class SourceKind:
    name: str
    needs_model: bool  # the source runs a model on a pool (the plan places it)
    build: Callable[[SourceSpec, Placement], Any]  # -> a scorer with submit(rollout) and close()


SOURCE_KINDS = Registry("reward source kind", "@register_reward_source in a module imported before the run")


def register_reward_source(kind: str, needs_model: bool = True) -> Callable:
    def decorate(build: Callable[[SourceSpec, Placement], Any]) -> Callable:
        SOURCE_KINDS.add(kind, SourceKind(kind, needs_model, build), build)
        return build
    return decorate


class _Done:
    def __init__(self, value: SourceScores) -> None:
        self.value = value

    def result(self) -> SourceScores:
        return self.value


class _Mapped:
    def __init__(self, future: Any, convert: Callable[[Any], SourceScores]) -> None:
        self.future, self.convert = future, convert

    def result(self) -> SourceScores:
        return self.convert(self.future.result())


class RewardModelSource:
    """A RewardModel (rule function or scalar model) as a source: every sample kept."""

    def __init__(self, model: RewardModel) -> None:
        self.model = model

    def submit(self, rollout: Any) -> _Done:
        scores = self.model.score(rollout).float()
        return _Done(SourceScores(scores, torch.ones(len(scores), dtype=torch.bool)))

    def close(self) -> None:
        self.model.close()


class JudgeSource:
    def __init__(self, judge: Judge) -> None:
        self.model = judge

    def submit(self, rollout: Any) -> _Mapped:
        return _Mapped(self.model.submit(rollout), lambda s: SourceScores(s.scores, s.valid, s.parse_errors))

    def close(self) -> None:
        self.model.close()


@register_reward_source("rule", needs_model=False)
def _rule(spec: SourceSpec, where: Placement) -> RewardModelSource:
    return RewardModelSource(RewardModel(fn=spec.fn, num_workers=where.num_workers))


@register_reward_source("scalar")
def _scalar(spec: SourceSpec, where: Placement) -> RewardModelSource:
    s = spec.scorer
    return RewardModelSource(RewardModel(model=s.model, resource_pool=where.pool, parallel=where.layout,
                                         micro_batch_size=s.micro_batch_size,
                                         max_tokens_per_micro_batch=s.max_tokens_per_micro_batch, dtype=s.dtype,
                                         tokenizer=s.tokenizer, chat_template=s.chat_template, format=s.format,
                                         seed=where.seed, role=spec.role, call_timeout_s=where.call_timeout_s))


@register_reward_source("generative")
def _generative(spec: SourceSpec, where: Placement) -> JudgeSource:
    return JudgeSource(Judge.from_settings(spec.scorer, where.layout, where.pool, where.seed, spec.role,
                                           where.call_timeout_s))


@dataclass
class Rewards:
    """The combined reward of a batch (total and keep are None when the run has no source: episode rewards)."""
    total: torch.Tensor | None  # [B] weighted sum of the sources' scores
    keep: torch.Tensor | None  # [B] bool: no source dropped the sample
    metrics: dict[str, float]


class RewardSources:
    """Named, weighted sources scored together: `submit(rollout).result()` -> Rewards."""

    def __init__(self, sources: list[tuple[SourceSpec, Any]]) -> None:
        self.sources = sources

    @property
    def scorers(self) -> dict[str, Any]:
        """The role objects behind the sources, by role name (model sources) or source name (rules)."""
        return {spec.role or spec.name: scorer.model for spec, scorer in self.sources}

    def submit(self, rollout: Any) -> "PendingRewards":
        # model sources first: they run on their pools while the rule functions run here
        ordered = sorted(self.sources, key=lambda item: item[0].kind == "rule")
        return PendingRewards([(spec, scorer.submit(rollout)) for spec, scorer in ordered])

    def score(self, rollout: Any) -> Rewards:
        return self.submit(rollout).result()

    def close(self) -> None:
        for _, scorer in self.sources:
            scorer.close()


class PendingRewards:
    def __init__(self, pending: list[tuple[SourceSpec, Any]]) -> None:
        self.pending = pending

    def result(self) -> Rewards:
        total, keep, metrics, errors = None, None, {}, None
        # a lone rule or reward model is the reward itself (reward_mean): no metric of its own
        named = len(self.pending) > 1 or any(spec.kind not in ("rule", "scalar") for spec, _ in self.pending)
        for spec, pending in self.pending:
            got = pending.result()
            weighted = spec.weight * got.scores.float()
            total = weighted if total is None else total + weighted
            keep = got.valid if keep is None else keep & got.valid
            kept = got.scores[got.valid]
            if named and len(kept):  # a batch whose samples were all dropped has no mean (NaN would stop the run)
                metrics[f"reward/{spec.name}_mean"] = float(kept.mean())
            if got.parse_errors is not None:
                errors = (errors or 0) + got.parse_errors
        if errors is not None:
            metrics["reward/judge_parse_errors"] = float(errors)
            metrics["reward/judge_dropped"] = float((~keep).sum())
        return Rewards(total, keep, metrics)
