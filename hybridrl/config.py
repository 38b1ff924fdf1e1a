"""OmegaConf structured configs: the schema, loading (YAML + key=value overrides) and validation.

Every option a run uses is declared here once, with its default. Validation happens on the driver
before any worker starts, and every error names the option and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the option and how to fix it."""


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None  # None: fill the role's devices (devices // (tp * pp))
    sequence_parallel: bool = False


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
class RoleConfig:
    """A Megatron-backed role (actor, critic, reference, reward/cost model)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_size: int = 8  # sequences per micro-batch when max_tokens_per_micro_batch is null
    max_tokens_per_micro_batch: Optional[int] = 8192  # pack sequences into micro-batches of at most this many tokens
    pool: str = "default"  # resource pool name; roles on one pool colocate


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto (vllm where the model and machine support it, else native) | native | vllm
    tp: int = 1
    pp: int = 1
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


@dataclass
class KLConfig:
    type: str = "fixed"  # fixed | adaptive | linear
    coef: float = 0.01
    mode: str = "reward"  # reward (per-token penalty) | loss (loss term)
    estimator: str = "k1"  # k1 | k2 | k3
    target: float = 6.0  # adaptive
    horizon: int = 10000  # adaptive
    final_coef: float = 0.0  # linear decay end value


@dataclass
class AlgorithmConfig:
    name: str = "remax"  # remax | ppo | grpo | rloo | reinforce_pp | safe_rlhf
    gamma: float = 1.0
    lam: float = 0.95
    clip_ratio: float = 0.2
    value_clip: float = 0.2
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batch_size: Optional[int] = None  # None: one update per step over the whole batch
    kl: KLConfig = field(default_factory=KLConfig)
    cost_limit: float = 0.0  # safe_rlhf
    lagrangian_lr: float = 0.05  # safe_rlhf
    lagrangian_init: float = 1.0  # safe_rlhf


@dataclass
class RewardConfig:
    fn: Optional[str] = None  # dotted path "package.module:function" (or package.module.function)
    model: Optional[str] = None  # HF *ForSequenceClassification folder
    cost_fn: Optional[str] = None  # safe_rlhf
    cost_model: Optional[str] = None  # safe_rlhf
    num_workers: int = 0  # rule rewards: 0 = on the driver, N = spread over N CPU Ray tasks


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # empty: the bundled task
    prompt_key: str = "prompt"
    chat_template: bool = False
    batch_size: int = 16
    max_prompt_length: int = 32
    shuffle: bool = True
    seed: int = 0


@dataclass
class ResourcesConfig:
    devices: int = 2  # devices of the default pool (CPU: Ray "GPU" resources on the local cluster)
    nodes: int = 1
    pools: dict[str, int] = field(default_factory=dict)  # extra named pools: name -> devices
    ray_address: Optional[str] = None  # None: start a local Ray cluster


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
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # + wandb | mlflow
    project: str = "hybridrl"  # wandb project / MLflow experiment
    progress_bar: bool = True
    call_timeout_s: float = 900.0


@dataclass
class HybridRLConfig:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: RoleConfig = field(default_factory=RoleConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RoleConfig = field(default_factory=RoleConfig)
    critic: RoleConfig = field(default_factory=RoleConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides. Unknown keys and wrong types are errors."""
    cfg = OmegaConf.structured(HybridRLConfig)
    layers: list[Any] = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            candidate = CONFIG_DIR / path
            if candidate.is_file():
                path = candidate
            else:
                raise ConfigError(f"config file {str(path)!r} not found (give a path or a file under {CONFIG_DIR})")
        layers.append(OmegaConf.load(path))
    if overrides:
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value (e.g. trainer.steps=10)")
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        for layer in layers:
            cfg = OmegaConf.merge(cfg, layer)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        raise ConfigError(f"bad config option {key!r}: {exc.msg if hasattr(exc, 'msg') else exc}".strip()) from None
    OmegaConf.set_readonly(cfg, False)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
