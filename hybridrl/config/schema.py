"""The schema: every option a run uses, declared once as a dataclass field with its default and a short comment.

Values are checked one by one in trainer/config_checks.py and together in trainer/plan.py, on the driver before
any worker starts; every error names the option and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the option and how to fix it."""


def check_config(condition: bool, message: str) -> None:
    """Refuse a configuration in one line (a ConfigError naming the option and the fix) unless `condition` holds."""
    if not condition:
        raise ConfigError(message)


class MachineError(OSError):
    """The machine refuses what a valid config asks: a folder that cannot be written, a full disk."""

    @classmethod
    def writing(cls, path: Any, exc: OSError, what: str = "") -> "MachineError":
        """The one line for a failed write to `path`; a full disk says so in words."""
        import errno  # only on this path

        if getattr(exc, "errno", None) == errno.ENOSPC:
            return cls(errno.ENOSPC, f"{path}: no space left on device{what}; free space or point trainer.run_dir "
                                     f"at a larger disk, then trainer.resume=auto")
        return cls(getattr(exc, "errno", None) or errno.EIO,
                   f"{path}: cannot write there{what} ({exc.strerror or exc}); choose a folder you can write to")

    def __str__(self) -> str:
        return self.strerror if self.strerror else super().__str__()


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None  # None: fill the role's devices (devices // (tp * pp))
    sequence_parallel: bool = False
    ep: int = 1  # expert parallel (mixture-of-experts models): DP replicas that split each MoE layer's experts
    expert_tp: Optional[int] = None  # the experts' own TP size, dividing tp or a multiple of it (None: tp; else ep > 1)
    # fully sharded data parallel (parallel/layout.py FSDP_MODES): no_shard (Megatron DDP + its optimizer), shard_grad_op
    # (gradients + optimizer states sharded over dp; parameters gathered from forward to backward), full_shard (also
    # the parameters, gathered layer by layer); Megatron-Core's wrapper of PyTorch FSDP2 (workers/sharding.py)
    fsdp: str = "no_shard"


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
    path: Optional[str] = None  # HF folder, hub id org/name[@revision] or tiny:<name>; None: the bundled tiny model
    dtype: str = "auto"  # auto (bf16 where native and worth it, else float32: models/precision.py) | float32 | bfloat16


@dataclass
class MoeConfig:
    """Mixture-of-experts training (models with experts only): the routers' auxiliary losses."""
    aux_loss_coef: float = 0.0  # load-balancing loss (Switch-style, per sequence batch); 0: off
    z_loss_coef: float = 0.0  # router z-loss (mean squared logsumexp of the router logits); 0: off


@dataclass
class LoraConfig:
    """LoRA adapters on the role's Megatron linears (models/lora.py): the base frozen, only the adapters trained.
    Off unless rank > 0 or init names a PEFT adapter folder."""
    rank: int = 0  # adapter rank r; 0: off (with init an adapter folder: the folder's rank)
    alpha: Optional[float] = None  # the update is (alpha / rank) * B A; None: alpha = rank (an init folder's alpha)
    dropout: float = 0.0  # dropout on the adapters' input (peft's lora_dropout)
    # Megatron linears: qkv (fused q, k, v), proj (attention output), fc1 (SwiGLU gate + up), fc2, all; or Hugging
    # Face names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj). None: all (an init folder's)
    target_modules: Optional[list[str]] = None
    init: str = "kaiming"  # kaiming (peft's default: A kaiming-uniform, B 0) | gaussian | a PEFT adapter folder
    # generation (native engine): merge (W + BA written into the generation weights; the frozen base shard kept
    # aside meanwhile) | forward (the adapters run in the decode forward: no copy, slower decoding)
    generation: str = "merge"

    @property
    def enabled(self) -> bool:
        return self.rank > 0 or self.init not in LORA_INITS


LORA_INITS = ("kaiming", "gaussian")


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
    lora: LoraConfig = field(default_factory=LoraConfig)  # actor / critic: adapters instead of full fine-tuning
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
class EndpointConfig:
    """The OpenAI-compatible endpoint agent programs talk to (rollout.agent; rollout/endpoint.py)."""

    host: str = "127.0.0.1"  # loopback: only programs on this machine reach it (another address: a warning)
    port: int = 0  # 0: a free port chosen at start
    max_request_bytes: int = 4 << 20  # a larger request body is refused (HTTP 413) before it is read
    max_n: int = 16  # the most choices one request may ask for (`n`)
    batch_window_ms: float = 50.0  # a run not back with a request this long after its answer is busy with tools:
    # the queued requests go to the engine without it (at most 10 windows after the oldest)
    sampling: str = "request"  # request: a request's temperature / top_p apply (rollout.* when absent) | config


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
    # rows decoded together per generation replica (native engine): its KV cache holds this many sequences of
    # max_model_len; 256 as vLLM's max_num_seqs (on 2 CPU cores 256 x 32 tokens decode 1.75x faster in one batch
    # than in four of 64)
    max_batch_size: int = 256
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
    # agent programs (rollout/agent.py): an async function agent(client, row) -> reward | dict | None that calls
    # the policy through an openai.AsyncOpenAI client on the endpoint; rollout.n runs per prompt row, each run's
    # requests limited by max_turns / max_new_tokens / max_episode_tokens like an episode's turns
    agent: Optional[str] = None  # "package.module:function"
    agent_concurrency: int = 64  # agent runs in flight at once
    agent_timeout_s: float = 600.0  # a run still going after this long is cancelled (agent/timeouts)
    agent_failure_reward: Optional[float] = None  # a run that raised or timed out: None drops it, a number keeps
    # the trajectories it has with this reward
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    # where tools run model-written code (hybridrl/envs/sandbox.py): auto (the strongest that starts here: bwrap,
    # else tools are refused) | bwrap | remote (an HTTP service, tool_sandbox_url) | guard (audit hooks: mistakes
    # only, not attackers) | none (no isolation: trusted code, or a run already inside a sandbox)
    tool_sandbox: str = "auto"
    tool_sandbox_url: Optional[str] = None  # tool_sandbox=remote: SandboxFusion-style POST endpoint (.../run_code)
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
class DistillConfig:
    """On-policy distillation (algorithm.distill): a teacher's per-token log-probs of the student's own samples
    give each token the advantage -coef * (log pi_student - log pi_teacher), added to the algorithm's."""

    teacher: Optional[str] = None  # the teacher model (a folder or tiny:<name>); None: no distillation
    coef: float = 1.0
    mode: str = "reverse_kl"  # a registered distillation term (algorithms/distill.py)
    # where the teacher runs, like the reference: the actor's pool (colocated, the pool's layout) or its own
    pool: str = "default"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: str = "auto"  # auto | float32 | bfloat16, as a role's model.dtype
    micro_batch_size: int = 8
    max_tokens_per_micro_batch: Optional[int] = 8192


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
    distill: DistillConfig = field(default_factory=DistillConfig)  # on-policy distillation from a teacher


@dataclass
class VerdictParserConfig:
    """How a generative judge's verdict becomes a number (reward_model.parser; data/verdicts.py)."""

    name: str = "regex"  # regex | choice_logprob | a parser registered with @register_verdict_parser
    pattern: str = r"(-?\d+(?:\.\d+)?)"  # regex: its first group (else the whole match) is the number
    # the verdict's scale [low, high], mapped onto [0, 1] (a number outside it is a parse error); None: as is
    score_range: Optional[list[float]] = None
    choices: list[str] = field(default_factory=list)  # choice_logprob: the answers, one judge token each
    choice_values: Optional[list[float]] = None  # choice_logprob: each answer's value; None: the answers as numbers
    module: Optional[str] = None  # a module to import first: its @register_verdict_parser adds parsers by name


@dataclass
class JudgeGenerationConfig:
    """How a generative judge writes its verdict (parsers that read text; choice_logprob needs one forward)."""

    engine: str = "auto"  # auto (vllm where the judge and machine support it, else native) | native | vllm
    tp: Optional[int] = None  # generation TP, dividing the judge's parallel.tp; None: its tp
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy (the same verdict for the same input)
    max_model_len: Optional[int] = None  # judge prompt + verdict tokens; None: (prompt + response) x 2 + 64 + verdict
    max_batch_size: int = 64  # rows decoded together per replica (native engine)
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class ScoreModelConfig:
    """A frozen scoring model (reward_model:, cost_model:, a reward source's model:): where it runs is its own
    choice, not ref's. kind=scalar: a *ForSequenceClassification head scores the sequence; kind=generative: a
    causal LM judge reads `template` filled with the prompt, the response and the row's columns, and `parser`
    turns its verdict (generated text, or the probabilities of answer tokens) into the score."""

    kind: str = "scalar"  # scalar | generative
    model: Optional[str] = None  # an HF folder, hub id org/name[@rev] or tiny:<name>; None: no such model (rule reward)
    dtype: str = "auto"  # auto (bf16 where native and worth it, else float32: models/precision.py) | float32 | bfloat16
    pool: str = "default"  # resource pool name; roles on one pool colocate
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 8  # sequences per micro-batch when max_tokens_per_micro_batch is null
    max_tokens_per_micro_batch: Optional[int] = 8192  # pack sequences into micro-batches of at most this many tokens
    tokenizer: Optional[str] = None  # None: the model folder's own tokenizer
    chat_template: Optional[bool] = None  # None: use the tokenizer's chat template when the folder declares one
    # the text the model was trained on, over {prompt}, {response} and row fields, e.g. "\n\nHuman: {prompt}\n\n
    # Assistant: {response}"; None: the chat template (above), else prompt + response
    format: Optional[str] = None
    # generative judges (kind=generative)
    template: Optional[str] = None  # Jinja ({{ prompt }}, {{ response }}, {{ row.x }}) or a format string ({prompt})
    parser: VerdictParserConfig = field(default_factory=VerdictParserConfig)
    on_parse_error: Union[float, str] = 0.0  # an unparsable verdict's score, or "drop": left out of the update
    generation: JudgeGenerationConfig = field(default_factory=JudgeGenerationConfig)


@dataclass
class RewardSourceConfig:
    """One reward source of reward.sources: a rule function (fn) or a model (model:, a reward model or judge)."""

    name: str = ""  # the metrics' reward/<name>_mean
    weight: float = 1.0  # the reward is the weighted sum of the sources' scores
    fn: Optional[str] = None  # a rule function "package.module:function"
    model: ScoreModelConfig = field(default_factory=ScoreModelConfig)


@dataclass
class RewardConfig:
    """Rule rewards (Python functions). Reward / cost MODELS have their own sections (ScoreModelConfig);
    several sources combined (rules, reward models, judges, with weights) go to `sources`."""

    fn: Optional[str] = None  # dotted path "package.module:function" (or package.module.function)
    cost_fn: Optional[str] = None  # safe_rlhf
    num_workers: int = 0  # rule rewards: 0 = on the driver, N = spread over N CPU Ray tasks
    sources: list[RewardSourceConfig] = field(default_factory=list)  # set: replaces reward.fn / reward_model


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
    # a pool's devices on each node (node 0: the driver's, then the others by name), e.g. whole nodes {default:
    # [8, 0], gen: [0, 8]}; a pool not listed spreads evenly over every node (hybridrl/parallel/placement.py)
    node_devices: dict[str, list[int]] = field(default_factory=dict)
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
    # SIGTERM / SIGINT: finish the step in flight and save one more checkpoint first, when that fits into
    # signal_grace_s (the time the scheduler leaves before its SIGKILL: Slurm's KillWait, 30 s by default)
    save_on_signal: bool = False
    signal_grace_s: float = 30.0


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


# the config section of each role whose name differs from it (critics share `critic:`; the device-mapping
# search's judge is the generative reward_model, its teacher algorithm.distill)
ROLE_SECTIONS = {"reward": "reward_model", "cost": "cost_model", "cost_critic": "critic", "judge": "reward_model",
                 "teacher": "algorithm.distill"}


def role_section(cfg: Any, role: str, create: bool = False) -> Any:
    """The config section of `role` (ROLE_SECTIONS; dotted for nested ones) in a loaded config or a plain dict
    (create: missing dict levels are added)."""
    node = cfg
    for key in ROLE_SECTIONS.get(role, role).split("."):
        node = node.setdefault(key, {}) if create and isinstance(node, dict) else node[key]
    return node


def dtype_holder(role: str, section: Any) -> Any:
    """The node of a role's config section that holds its dtype: model.dtype for the Megatron roles, dtype beside
    the model reference for score models, reward sources and the distillation teacher."""
    return section.model if role in ("actor", "ref", "critic", "cost_critic") else section
