"""The memory ledger of a planned run (`hybridrl plan --memory CONFIG`): per pool, what stays on one GPU in every
phase of a step (automap/ledger.py states the model), read from the same RunPlan `hybridrl train` runs.

Each role's sizes come from its model folder's real parameter shapes (built on the meta device); its layout,
precision, micro-batch, LoRA adapters and offload settings from the plan and the config; the actor's generation
from the resolved rollout settings (engine, t_g, vLLM's share or KV cache), a generating judge's from its
resolved generation section. A rollout pool of its own (disaggregated generation) is not modelled yet.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hybridrl.automap.cost import ModelStats
from hybridrl.automap.hardware import Accelerator
from hybridrl.automap.ledger import Generation, Ledger, load_of, pool_ledger
from hybridrl.config import dtype_holder, role_section, typed
from hybridrl.data.verdicts import verdict_parser
from hybridrl.hybrid_engine.model_shapes import model_shapes
from hybridrl.models.lora import adapter_numel
from hybridrl.trainer.plan import RunPlan

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
TRAINED = ("actor", "critic", "cost_critic")
LM_HEAD = ("actor", "ref", "teacher")


@dataclasses.dataclass(frozen=True)
class _Sized:
    stats: ModelStats
    experts: int
    named_shapes: tuple


def plan_memory(plan: RunPlan, cfg: Any, acc: Accelerator) -> dict[str, Ledger]:
    """pool name -> the ledger of one of its GPUs."""
    sizes: dict[str, _Sized] = {}

    def sized(path: str) -> _Sized:
        if path not in sizes:
            shapes = model_shapes(path)
            sizes[path] = _Sized(ModelStats.from_shapes(shapes), shapes.expert_numel,
                                 tuple((p.name, p.shape) for p in shapes.params))
        return sizes[path]

    loads: dict[str, list] = {}
    gens: dict[str, list[Generation]] = {}
    judges = {s.role: s.scorer for s in plan.sources if s.scorer is not None and s.kind == "generative"}
    for name, role in plan.roles.items():
        if name == "rollout":
            continue
        size = sized(role.model_path)
        section = _section(cfg, name, plan)
        judge = judges.get(name)
        generates = _judge_generation(judge, role) if judge is not None else None
        megatron = not (generates is not None and generates.engine == "vllm" and not _reads_choices(judge))
        loads.setdefault(role.pool, []).append(_load(name, role, size, section, plan, cfg, megatron,
                                                     lm_head=name in LM_HEAD or judge is not None))
        if generates is not None:
            gens.setdefault(role.pool, []).append(generates)
    actor = plan.roles["actor"]
    if "rollout" not in plan.roles:
        gens.setdefault(actor.pool, []).append(_actor_generation(plan, cfg))
    return {pool: pool_ledger(pool_loads, acc, gens.get(pool, [])) for pool, pool_loads in loads.items()}


def _section(cfg: Any, name: str, plan: RunPlan) -> Any:
    """The config section a role's sizes and micro-batch come from (a reward source: its own model section)."""
    if name.startswith("reward/"):
        index = next(i for i, s in enumerate(plan.sources) if s.role == name)
        return cfg.reward.sources[index].model
    return role_section(cfg, name)


def _load(name: str, role: Any, size: _Sized, section: Any, plan: RunPlan, cfg: Any, megatron: bool, lm_head: bool):
    layout = role.layout
    dtype = dtype_holder(name, section).dtype
    lora = plan.lora.get("critic" if name == "cost_critic" else name)
    adapters = 0.0
    if lora is not None and lora.enabled:
        adapters = adapter_numel(size.named_shapes, int(lora.rank), list(lora.target_modules or ["all"])) / \
            sum(_numel(shape) for _, shape in size.named_shapes)
    offload = typed(cfg.actor.offload) if name == "actor" else \
        typed(cfg.critic.offload) if name in ("critic", "cost_critic") else None
    tokens = section.max_tokens_per_micro_batch or section.micro_batch_size * int(plan.rollout.max_model_len or 512)
    return load_of(name, size.stats, size.experts, trained=name in TRAINED,
                   lm_head=lm_head,
                   t=layout.tp, p=layout.pp, d=layout.dp, ep=layout.ep, etp=layout.expert_tp,
                   dtype_bytes=DTYPE_BYTES[dtype], adapters=adapters, offload=offload, tokens_per_micro_batch=tokens,
                   megatron=megatron)


def _numel(shape: tuple) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _actor_generation(plan: RunPlan, cfg: Any) -> Generation:
    roll = plan.rollout
    lora = plan.lora.get("actor")
    own = roll.engine == "vllm" and lora is not None and lora.enabled and _vllm_serves(lora, plan)
    return Generation("actor", roll.engine, roll.tp, int(roll.max_model_len), roll.vllm.gpu_memory_utilization,
                      roll.vllm.kv_cache_memory_bytes, roll.max_batch_size, own_weights=own)


def _vllm_serves(lora: Any, plan: RunPlan) -> bool:
    # the vLLM engine imports nothing here: vllm_lora's check reads the settings and the model's config
    from hybridrl.models.peft import model_config
    from hybridrl.rollout.vllm_lora import vllm_adapter_support

    path = plan.roles["actor"].model_path
    return vllm_adapter_support(lora, path, model_config(path)) is None


def _reads_choices(scorer: Any) -> bool:
    return verdict_parser(scorer.parser).reads == "choices"


def _judge_generation(scorer: Any, role: Any) -> Generation | None:
    if verdict_parser(scorer.parser).reads != "text":
        return None
    gen = scorer.generation
    return Generation(role.name, gen.engine, gen.tp or role.layout.tp, int(gen.max_model_len),
                      gen.vllm.gpu_memory_utilization, gen.vllm.kv_cache_memory_bytes, gen.max_batch_size,
                      own_weights=gen.engine == "vllm")  # vLLM loads the judge's folder; native reshards its model
