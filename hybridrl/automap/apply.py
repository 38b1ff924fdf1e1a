"""`resources.auto_map=true` in `hybridrl train`: search the mapping for the machine this runs on and write it
into the config before the run is planned (trainer/plan.py then checks it like any hand-written layout).

The machine: on GPUs the preset of the device's type (hardware.detect_gpu) with resources.devices (+ pools)
over resources.nodes; on CPU a model calibrated on the spot (hardware.cpu_calibrated). The search runs in
the "trainer" execution model (calls in sequence, every pool spread over all nodes: what the trainer does).
It decides, for every role with devices: its pool (and the pools' sizes, which together use all devices),
its (tp, pp, dp), its micro-batch (at most the configured one), and the actor's rollout.tp / rollout.pp.
Everything else in the config is kept.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import hybridrl.algorithms  # noqa: F401  registers the built-in algorithms
from hybridrl.algorithms.registry import get_algorithm
from hybridrl.algorithms.step import step_needs
from hybridrl.automap.cost import Workload
from hybridrl.automap.hardware import cpu_calibrated, detect_gpu
from hybridrl.automap.judge_cost import JudgeWork
from hybridrl.automap.search import Mapper, make_problem, mapping_json, pool_name
from hybridrl.config import ConfigError, role_section, typed
from hybridrl.data.verdicts import verdict_parser
from hybridrl.models.hub import ModelReferenceError, resolve_model
from hybridrl.models.lora_io import resolve_lora_config
from hybridrl.models.precision import model_dtype

logger = logging.getLogger(__name__)


def _machine(devices: int, nodes: int, dtype: str):
    import torch

    acc = detect_gpu(devices // nodes) if torch.cuda.is_available() else cpu_calibrated(devices)
    if dtype == "float32":
        acc = replace(acc, param_bytes=4, mixed_precision=False)
    return acc


def _engine(requested: str, acc) -> str:
    """The actor's engine as the memory model sees it: vLLM on GPUs where rollout.engine is vllm or auto (the plan
    resolves auto to vLLM where it is installed), else native."""
    import importlib.util

    if acc.shared_cores or requested == "native":
        return "native"
    return "vllm" if requested == "vllm" or importlib.util.find_spec("vllm") is not None else "native"


def _lora_roles(cfg: Any) -> dict[str, tuple[int, list[str] | None]]:
    """The LoRA roles' (rank, targets) for the search (trainer/plan_lora.py resolves the same settings)."""
    out = {}
    for role in ("actor", "critic"):
        lora = typed(cfg[role].lora)
        if lora.enabled:
            resolved = resolve_lora_config(lora)
            out[role] = (int(resolved.rank), list(resolved.target_modules))
    return out


def _scorers(cfg: Any, reward_model: str | None) -> dict:
    """The reward model (its resolved folder), or the generative judge (its verdict's tokens; 0: one forward), and
    the teacher."""
    judge = cfg.reward_model.kind == "generative" and reward_model
    reads = verdict_parser(cfg.reward_model.parser).reads if judge else None
    teacher = cfg.algorithm.distill.teacher
    return {"reward_model": None if judge else reward_model, "judge_model": reward_model if judge else None,
            "judge_work": JudgeWork(cfg.reward_model.generation.max_new_tokens if reads == "text" else 0),
            "teacher_model": resolve_model(teacher, "algorithm.distill.teacher") if teacher else None}


def apply_auto_map(cfg: Any) -> dict:
    """Choose and write the mapping into `cfg` (in place); returns the search report (auto_map.json)."""
    alg, roll, data, res = cfg.algorithm, cfg.rollout, cfg.data, cfg.resources
    try:
        spec = get_algorithm(alg.name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    devices = int(res.devices) + sum(int(v) for v in res.pools.values())
    step = step_needs(spec, typed(alg), data.batch_size * roll.n)  # what the trainer's plan will decide
    work = Workload(prompts=data.batch_size, prompt_len=data.max_prompt_length, response_len=roll.max_new_tokens,
                    samples=roll.n, greedy=step.greedy_baseline, mini_batches=step.mini_batches, epochs=step.epochs,
                    old_log_probs=step.old_log_probs, max_decode_batch=roll.max_batch_size)
    try:  # hub ids and tiny: names as local folders (the plan resolves them again, from the cache at once)
        actor_path = resolve_model(cfg.actor.model.path, "actor.model.path")
        others = {name: resolve_model(ref, option) if ref else None for name, option, ref in (
            ("critic_model", "critic.model.path", cfg.critic.model.path),
            ("reward_model", "reward_model.model", cfg.reward_model.model),
            ("cost_model", "cost_model.model", cfg.cost_model.model))}
        others.update(_scorers(cfg, others.pop("reward_model")))
    except ModelReferenceError as exc:
        raise ConfigError(str(exc)) from None
    try:
        acc = _machine(devices, int(res.nodes), model_dtype(cfg.actor.model.dtype, actor_path))
        offload = cfg.actor.offload
        prob = make_problem(actor_path, alg.name, acc, devices, work, reference=step.reference, lora=_lora_roles(cfg),
                            engine=_engine(roll.engine, acc), offload=(offload.grads, offload.optimizer,
                                                                       offload.params), **others)
        budget = cfg.actor.max_tokens_per_micro_batch
        prob.max_micro_batch = max(1, budget // work.tokens) if budget else cfg.actor.micro_batch_size
        result = Mapper(prob, "trainer").search(top_k=3)
    except ValueError as exc:
        raise ConfigError(f"resources.auto_map: {exc}") from None

    best = result.best
    res.pools = {}
    for choice in best.pools:
        name = pool_name(choice)
        if name == "default":
            res.devices = choice.devices
        else:
            res.pools[name] = choice.devices
        for role in choice.roles:
            section = role_section(cfg, role)
            section.pool = name
            section.parallel.tp, section.parallel.pp, section.parallel.dp = choice.tp, choice.pp, choice.dp
            section.micro_batch_size = choice.micro_batch
            section.max_tokens_per_micro_batch = choice.micro_batch * work.tokens
        if "actor" in choice.roles:
            roll.tp, roll.pp = choice.gen_tp, choice.gen_pp
            if choice.vllm_utilization is not None:  # vLLM's share: what the pool leaves it while generating
                roll.vllm.gpu_memory_utilization = choice.vllm_utilization
    report = {"machine": acc.describe(), "calibration": {"peak_flops": acc.peak_flops, "memory_bw": acc.memory_bw,
                                                         "layer_overhead_s": acc.layer_overhead},
              "execution": result.execution.name, "best": mapping_json(best, prob),
              "top": [mapping_json(m, prob) for m in result.top],
              "candidates": {**result.counts, "search_s": round(result.seconds, 3)}}
    logger.info("resources.auto_map on %s: %s (%s), modelled %.3f s/step", acc.describe(), best.label, best.kind,
                best.step_s)
    return report
