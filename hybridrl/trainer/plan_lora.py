"""The run plan's LoRA decisions (trainer/plan.py calls `plan_lora`): each role's resolved adapter settings, and
whether the reference log-probs come from the actor itself.

- actor.lora / critic.lora are resolved once here (rank, alpha, targets; from lora.init when it is a PEFT adapter
  folder) and travel to the workers as they are;
- a LoRA actor whose reference is its own base model (ref.model.path unset or the same) is its own reference:
  the adapters-off forward gives the reference log-probs and no reference model is built (StepNeeds.
  reference_from_actor), one copy of the weights fewer;
- combinations that cannot work are one line each, before any worker starts.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hybridrl.algorithms.step import StepNeeds
from hybridrl.config import ConfigError, LoraConfig, typed
from hybridrl.models.families import ModelDims
from hybridrl.models.lora import resolve_targets
from hybridrl.models.lora_io import resolve_lora_config
from hybridrl.models.peft import model_config

LORA_ROLES = ("actor", "critic")


def plan_lora(cfg: Any, step: StepNeeds) -> tuple[StepNeeds, dict[str, LoraConfig]]:
    """(the step with reference_from_actor decided, {role: resolved LoraConfig} for the LoRA roles)."""
    if typed(cfg.ref.lora).enabled:
        raise ConfigError("ref.lora: the reference policy is frozen; unset it (a LoRA actor's reference is its own "
                          "base model, computed with the adapters off)")
    resolved = {}
    for role in LORA_ROLES:
        lora = typed(cfg[role].lora)
        if not lora.enabled:
            continue
        try:
            resolved[role] = resolve_lora_config(lora)
        except ValueError as exc:
            raise ConfigError(f"{role}.{exc}" if str(exc).startswith("lora.") else f"{role}.lora: {exc}") from None
    from_actor = step.reference and "actor" in resolved and _same_model(cfg.ref.model.path, cfg.actor.model.path)
    return dataclasses.replace(step, reference_from_actor=from_actor), resolved


def _same_model(ref_path: str | None, actor_path: str | None) -> bool:
    if ref_path is None:
        return True
    if actor_path is None:
        return False
    return Path(str(ref_path)).expanduser().resolve() == Path(str(actor_path)).expanduser().resolve() \
        if not str(ref_path).startswith("tiny:") else ref_path == actor_path


def check_lora_generation(lora: LoraConfig | None, rollout: Any, actor_layout: Any, colocated: bool) -> None:
    """lora.generation=forward: the adapters run in the native engine's decode forward, on the training model
    itself (the generation layout equal to the training layout) or on a rollout pool (which always does so)."""
    if lora is None or lora.generation != "forward":
        return
    if rollout.engine != "native":
        raise ConfigError(f"actor.lora.generation=forward runs the adapters in the native engine's forward; "
                          f"rollout.engine resolved to {rollout.engine}, which generates with W + BA: set "
                          f"actor.lora.generation=merge or rollout.engine=native")
    same = rollout.tp == actor_layout.tp and actor_layout.pp == 1 and not actor_layout.sequence_parallel \
        and actor_layout.ep == 1
    if colocated and not same:
        raise ConfigError(f"actor.lora.generation=forward generates with the training model's own adapters: it needs "
                          f"rollout.tp = actor.parallel.tp ({actor_layout.tp}), pp = 1, no sequence or expert "
                          f"parallelism, or a rollout pool of its own; else set actor.lora.generation=merge")


def check_lora_experts(role: str, lora: LoraConfig, model_path: str, layout: Any) -> None:
    """Experts' adapters: whole experts (expert TP 1) or experts split like the dense layers (expert TP = TP,
    sequence parallel: finalize_model_grads sums their replicated factor's partial gradients over TP)."""
    if not resolve_targets(lora.target_modules) & {"gate", "up", "down"}:
        return
    if ModelDims.from_hf(model_config(model_path)).moe is not None and layout.expert_tp not in (1, layout.tp):
        raise ConfigError(f"{role}.lora adapts the experts' linears, whose {role}.parallel.expert_tp="
                          f"{layout.expert_tp} differs from tp={layout.tp} and 1: unset expert_tp, set it to 1, or "
                          f"leave fc1/fc2 out of {role}.lora.target_modules")
