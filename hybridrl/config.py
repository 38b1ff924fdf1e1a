"""OmegaConf structured configs: the schema, loading (YAML + key=value overrides) and validation.

Every option a run uses is declared here once, with its default. Validation happens on the driver
before any worker starts, and every error names the option and the fix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.bundled import bundled_dir

CONFIG_DIR = bundled_dir("configs")


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the option and how to fix it."""


class MachineError(OSError):
    """The machine refuses what a valid config asks: a folder that cannot be written, a full disk."""


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None  # None: fill the role's devices (devices // (tp * pp))
    sequence_parallel: bool = False
    ep: int = 1  # expert parallel (mixture-of-experts models): DP replicas that split each MoE layer's experts
    expert_tp: Optional[int] = None  # the experts' own TP size, dividing tp or a multiple of it (None: tp; else ep > 1)


@dataclass
class OptimConfig:
    optimizer: str = "adam"  # adam | sgd
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    clip_grad: float = 1.0
    warmup_steps: int = 0
    use_distributed_optimizer: bool = True


@dataclass
class ModelConfig:
    path: Optional[str] = None  # Hugging Face folder; None: the bundled tiny model (created on first use)
    dtype: str = "float32"  # float32 | bfloat16


@dataclass
class MoeConfig:
    """Mixture-of-experts training (models with experts only): the routers' auxiliary losses."""
    aux_loss_coef: float = 0.0  # load-balancing loss (Switch-style, per sequence batch); 0: off
    z_loss_coef: float = 0.0  # router z-loss (mean squared logsumexp of the router logits); 0: off


@dataclass
class OffloadConfig:
    """What a trained role keeps in host memory while it is not needed (workers/offload.py): room on a colocated GPU
    for generation's KV cache. Trained roles (actor, critic) only."""

    grads: bool = False  # fp32 gradient buffers freed between updates (each update zeroes them first)
    optimizer: bool = False  # fp32 main weights + Adam moments in host memory between updates (moved back bit-exactly)
    params: bool = False  # actor with rollout.engine=vllm: its weights in host memory while vLLM generates


@dataclass
class RoleConfig:
    """A Megatron-backed role (actor, critic, reference, reward/cost model)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)  # the actor's (and the critic's) routers
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_size: int = 8  # sequences per micro-batch when max_tokens_per_micro_batch is null
    max_tokens_per_micro_batch: Optional[int] = 8192  # pack sequences into micro-batches of at most this many tokens
    pool: str = "default"  # resource pool name; roles on one pool colocate
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # trained roles: state in host memory when idle


@dataclass
class VllmConfig:
    """vLLM's engine settings (rollout.engine=vllm); the CPU defaults keep a tiny model's engine under ~1 GiB."""

    dtype: Optional[str] = None  # None: the actor's dtype (actor.model.dtype), so log-probs match the trainer's
    # the KV cache's bytes per device; None: 64 MiB on CPU, on GPU what gpu_memory_utilization leaves after vLLM's
    # weights and activations
    kv_cache_memory_bytes: Optional[int] = None
    # GPU: share of the device vLLM takes while awake (its weights + activations + KV cache); it must be free
    # when the engine starts and beside what stays on a colocated GPU while generating (hybridrl plan counts it)
    gpu_memory_utilization: float = 0.5
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = True  # GPU: between generations the engine gives back its weights and KV cache


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto (vllm where the model and machine support it, else native) | native | vllm
    tp: int = 1
    pp: int = 1
    # generation expert parallelism (mixture-of-experts actor, native engine, colocated): each generation replica
    # holds 1/ep of the experts and the ep replicas decode in lockstep; divides actor.parallel.ep
    ep: int = 1
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    ignore_eos: bool = False  # generate exactly max_new_tokens (no stop at EOS): fixed-length benchmarks
    reshard: str = "hybrid"  # hybrid | ds_chat | hybridflow_v
    bucket_mb: float = 32.0  # most MiB one reshard collective outputs (bounds the transient scratch)
    max_model_len: Optional[int] = None  # None: data.max_prompt_length + max_new_tokens
    max_batch_size: int = 64  # rows decoded together per generation replica (native engine)
    # the pool generation runs on: the actor's (colocated, the 3D-HybridEngine) or one of its own (disaggregated:
    # weights sent shard to shard after each update, hybrid_engine/bridge.py)
    pool: str = "default"
    # with a pool of its own: a generation in progress takes new weights at once, interrupted sequences resuming
    # with them (per-token policy versions kept); false: new weights wait for the generations queued before them
    partial: bool = False
    # mixture-of-experts: keep the experts the rollout routed each token to, and route the actor's forwards
    # (old log-probs, update) the same way (routing_replay); record_routing only measures moe/routing_mismatch
    routing_replay: bool = False
    record_routing: bool = False
    # multi-turn episodes (rollout/multiturn.py); env None: one prompt -> one response
    env: Optional[str] = None  # a registered environment (charset_turns, tool_answer) or "package.module:Class"
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # the environment's constructor arguments
    max_turns: int = 4  # model turns per episode (max_new_tokens each)
    max_episode_tokens: Optional[int] = None  # after the prompt, turns + observations; None: 2*max_turns*max_new_tokens
    turn_discount: float = 1.0  # episode reward = sum over turns t of turn_discount**t * reward_t
    vllm: VllmConfig = field(default_factory=VllmConfig)

    @property
    def routing_mode(self) -> str:
        """What the actor's forwards do with the rollout's recorded experts: off | measure | replay."""
        return "replay" if self.routing_replay else "measure" if self.record_routing else "off"


@dataclass
class KLConfig:
    type: str = "fixed"  # fixed | adaptive | linear
    coef: float = 0.01
    # None: the algorithm's default (its registry entry: GRPO uses loss + k3, the others reward + k1)
    mode: Optional[str] = None  # reward (per-token penalty) | loss (loss term)
    estimator: Optional[str] = None  # k1 | k2 | k3
    target: float = 6.0  # adaptive
    horizon: int = 10000  # adaptive
    final_coef: float = 0.0  # linear decay end value


@dataclass
class AlgorithmConfig:
    name: str = "remax"  # a registered algorithm: remax | ppo | grpo | rloo | reinforce_pp | safe_rlhf | yours
    module: Optional[str] = None  # a module to import first: its @register_algorithm adds algorithms by name
    gamma: float = 1.0
    lam: float = 0.95
    clip_ratio: float = 0.2  # the ratio's lower clip 1 - clip_ratio (and upper, unless clip_ratio_high)
    clip_ratio_high: Optional[float] = None  # decoupled upper clip 1 + clip_ratio_high (DAPO's clip-higher)
    value_clip: float = 0.2
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batch_size: Optional[int] = None  # None: one update per step over the whole batch
    kl: KLConfig = field(default_factory=KLConfig)
    # rollout / training mismatch (algorithms/rollout_correction.py): none | tis | mis importance weights
    # pi_old / pi_rollout, capped at rollout_correction_cap, per token or per sequence
    rollout_correction: str = "none"
    # DAPO's dynamic sampling and overlong shaping (algorithms/shaping.py); None: the algorithm's default, or off
    max_refill_rounds: Optional[int] = None  # > 0: drop all-equal-reward groups, refill up to this many rounds
    overlong_buffer: Optional[int] = None  # > 0: responses past max_new_tokens - buffer lose reward linearly
    overlong_penalty: Optional[float] = None  # the penalty at max_new_tokens (default 1.0)
    # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm; None: the algorithm's
    loss_agg: Optional[str] = None
    rollout_correction_cap: float = 2.0
    rollout_correction_level: str = "token"
    # trainer.mode=async: the most policy versions between the weights that generated a sample and the weights
    # it updates (generation runs this many batches ahead of training); one_step_off is async with 1
    max_staleness: int = 1
    cost_limit: float = 0.0  # safe_rlhf
    lagrangian_lr: float = 0.05  # safe_rlhf
    lagrangian_init: float = 1.0  # safe_rlhf


@dataclass
class RewardConfig:
    """Rule rewards (Python functions). Reward / cost MODELS have their own sections (ScoreModelConfig)."""

    fn: Optional[str] = None  # dotted path "package.module:function" (or package.module.function)
    cost_fn: Optional[str] = None  # safe_rlhf
    num_workers: int = 0  # rule rewards: 0 = on the driver, N = spread over N CPU Ray tasks


@dataclass
class ScoreModelConfig:
    """A frozen scoring model (reward_model:, cost_model:): where it runs is its own choice, not ref's."""

    model: Optional[str] = None  # HF *ForSequenceClassification folder; None: no such model (rule reward)
    dtype: str = "float32"  # float32 | bfloat16
    pool: str = "default"  # resource pool name; roles on one pool colocate
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 8  # sequences per micro-batch when max_tokens_per_micro_batch is null
    max_tokens_per_micro_batch: Optional[int] = 8192  # pack sequences into micro-batches of at most this many tokens
    tokenizer: Optional[str] = None  # None: the model folder's own tokenizer
    chat_template: Optional[bool] = None  # None: use the tokenizer's chat template when the folder declares one


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # empty: the bundled task
    prompt_key: str = "prompt"
    chat_template: bool = False
    batch_size: int = 16
    max_prompt_length: int = 32
    overlong_prompts: str = "error"  # error | drop: prompts longer than max_prompt_length
    shuffle: bool = True
    seed: int = 0


@dataclass
class ResourcesConfig:
    devices: int = 2  # devices of the default pool (CPU: Ray "GPU" resources on the local cluster)
    nodes: int = 1
    pools: dict[str, int] = field(default_factory=dict)  # extra named pools: name -> devices
    ray_address: Optional[str] = None  # None: start a local Ray cluster
    auto_map: bool = False  # search placement + layouts for this machine (hybridrl/automap/apply.py)


@dataclass
class TrainerConfig:
    steps: int = 30
    seed: int = 1
    run_dir: Optional[str] = None  # None: runs/<algorithm>-<timestamp>
    log_every: int = 1
    save_every: int = 0  # 0: never
    keep_last: int = 2
    resume: str = "never"  # never | auto | PATH
    max_restarts: int = 0
    on_nan: str = "stop"  # stop | skip
    mode: str = "sync"  # sync | one_step_off | async (both need rollout.pool apart from actor.pool)
    max_skipped_steps: int = 5  # on_nan=skip: this many non-finite steps in a row end the run (exit 3)
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # + wandb | mlflow
    project: str = "hybridrl"  # wandb project / MLflow experiment
    progress_bar: bool = True
    call_timeout_s: float = 900.0
    # how long a role may take to start (load its shard, build the generation model, start vLLM); None: 300 s + 30 s
    # per billion parameters of the largest model (a cold 70B start reads 140 GB)
    start_timeout_s: Optional[float] = None
    hang_timeout_s: float = 300.0  # a call without progress this long (scaled up by the step times seen) is
    # a hang: stacks dumped into the run folder, recovered like a dead worker (controller/watchdog.py); 0: off


@dataclass
class HybridRLConfig:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: RoleConfig = field(default_factory=RoleConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RoleConfig = field(default_factory=RoleConfig)
    critic: RoleConfig = field(default_factory=RoleConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: ScoreModelConfig = field(default_factory=ScoreModelConfig)
    cost_model: ScoreModelConfig = field(default_factory=ScoreModelConfig)  # safe_rlhf
    data: DataConfig = field(default_factory=DataConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# the config section of each role whose name differs from it (critics share `critic:`)
ROLE_SECTIONS = {"reward": "reward_model", "cost": "cost_model", "cost_critic": "critic"}

# options that moved: old key -> its new home (an old config gets a one-line pointer, not a schema error)
MOVED_OPTIONS = {"reward.model": "reward_model.model", "reward.cost_model": "cost_model.model"}


def find_config(path: str | Path) -> Path:
    """A config file: a path, or a bundled config by name (`ppo_tiny`, `ppo_tiny.yaml`, `configs/ppo_tiny.yaml`,
    `gpu/remax_llama2_7b_8gpu.yaml`), so the bundled configs work from any directory and after a wheel install."""
    given = Path(path).expanduser()
    if given.is_file():
        return given
    name = Path(*given.parts[1:]) if given.parts[:1] == ("configs",) else given
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / name.with_suffix(name.suffix or ".yaml")):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"config file {str(path)!r} not found (give a path, or a bundled config name: "
                      f"{', '.join(sorted(p.name for p in CONFIG_DIR.glob('*.yaml')))})")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides <- the algorithm's defaults for options left unset.
    Unknown keys, wrong types and unparsable values are ConfigErrors."""
    cfg = OmegaConf.structured(HybridRLConfig)
    layers: list[Any] = []
    if path is not None:
        path = find_config(path)
        try:
            layers.append(OmegaConf.load(path))
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_one_line(exc)}") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. trainer.steps=10)")
        try:  # one at a time, so the error names the override that does not parse
            layers.append(OmegaConf.from_dotlist([item]))
        except (yaml.YAMLError, OmegaConfBaseException) as exc:
            raise ConfigError(f"override {item!r} does not parse ({_one_line(exc)}); write lists "
                              f"like data.train_files=[a.jsonl,b.jsonl]") from None
    try:
        for layer in layers:
            cfg = OmegaConf.merge(cfg, layer)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        if key in MOVED_OPTIONS:
            raise ConfigError(f"option {key!r} moved to {MOVED_OPTIONS[key]!r} (its section also sets the "
                              f"model's pool, parallel, micro_batch_size and dtype)") from None
        detail = str(exc.msg if hasattr(exc, "msg") else exc).strip().splitlines()[0]  # not OmegaConf's key dump
        raise ConfigError(f"bad config option {key!r}: {detail}") from None
    OmegaConf.set_readonly(cfg, False)
    apply_algorithm_defaults(cfg)
    return cfg


def apply_algorithm_defaults(cfg: DictConfig) -> None:
    """Fill the options the user left unset (None) with the algorithm's registry defaults, so the resolved
    config (and --print-config) shows what runs. An unknown algorithm is left for plan_run to refuse."""
    # the algorithms import torch (~2 s): only when a config is loaded, not for every command's parser
    from hybridrl.algorithms.registry import ALGORITHMS, import_algorithm_module

    if cfg.algorithm.module:
        try:
            import_algorithm_module(cfg.algorithm.module)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    spec = ALGORITHMS.get(cfg.algorithm.name)
    if spec is None:
        return
    if cfg.algorithm.kl.mode is None:
        cfg.algorithm.kl.mode = spec.default_kl_mode
    if cfg.algorithm.kl.estimator is None:
        cfg.algorithm.kl.estimator = spec.default_kl_estimator
    if cfg.algorithm.loss_agg is None:
        cfg.algorithm.loss_agg = spec.default_loss_agg
    for key, value in spec.config_defaults.items():
        if key not in cfg.algorithm:
            raise ConfigError(f"algorithm {spec.name!r} declares a default for algorithm.{key}, which is no option")
        if cfg.algorithm.get(key) is None:
            cfg.algorithm[key] = value


Section = TypeVar("Section")


def as_section(cls: type[Section], value: Any, where: str) -> Section:
    """A config section from the short API's keyword argument (None, a dict, or the section itself): the one
    place where keyword dicts become typed settings. Unknown keys are refused, naming the known ones."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{where}: give a dict or a {cls.__name__}, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    nested = {f.name: f.type for f in dataclasses.fields(cls)}
    converted = {}
    for key, item in value.items():
        section = _SECTIONS.get(nested[key]) if isinstance(nested[key], str) else None
        converted[key] = as_section(section, item, f"{where}[{key!r}]") if section and isinstance(item, dict) \
            else item
    return cls(**converted)


def typed(section: Any) -> Any:
    """A section of a loaded (OmegaConf) config as its dataclass, e.g. typed(cfg.rollout) -> RolloutConfig."""
    return OmegaConf.to_object(section) if isinstance(section, DictConfig) else section


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


_SECTIONS = {name: cls for name, cls in globals().items()
             if isinstance(cls, type) and dataclasses.is_dataclass(cls) and name.endswith("Config")}


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
