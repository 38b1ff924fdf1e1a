"""Every option's value, checked on the driver before anything starts: one rule per option, one line per error.

`check_values(cfg)` looks at each option on its own (a range, a choice, a path that must exist); how options
fit together (layouts over pools, batch over ranks, lengths) is trainer/plan.py's job, run after this. Every
section is checked, also of roles the algorithm does not run: a wrong value is a mistake wherever it sits.
A rule's message reads `<option>=<value>: <what> (<fix>)`.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable

from hybridrl.algorithms.distill import check_distill_mode
from hybridrl.algorithms.losses import KL_ESTIMATORS
from hybridrl.config import ConfigError
from hybridrl.data.verdicts import verdict_parser
from hybridrl.envs.sandbox import SANDBOXES
from hybridrl.models.hub import is_hub_reference, parse_hub_id
from hybridrl.models.lora import TARGET_NAMES
from hybridrl.models.tiny import TINY_PREFIX
from hybridrl.parallel.layout import FSDP_MODES
from hybridrl.roles.reward import check_score_format
from hybridrl.models.precision import CONCRETE_DTYPES, DTYPE_CHOICES
from hybridrl.rollout import sampling_params_from_config
from hybridrl.rollout.base import SamplingParamsError
from hybridrl.trainer.tracking import BACKENDS

MODEL_ROLES = ("actor", "ref", "critic")  # sections with model / parallel / optim
SCORE_MODELS = ("reward_model", "cost_model")
PLACED = ("algorithm.distill",)  # other sections with parallel / pool / micro-batches: the distillation teacher
OPTIMIZERS = ("adam", "sgd")
RAY_ADDRESS = re.compile(r"^(auto|(ray://)?[\w.\-]+:\d+)$")


def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v is not None and v >= low


def _above(low: float) -> Callable[[Any], bool]:
    return lambda v: v is not None and v > low


def _unit(v: Any) -> bool:
    return v is not None and 0.0 <= v <= 1.0


def _one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda v: v in choices


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _finite(v: Any) -> bool:
    return v is not None and math.isfinite(v)


def _exists(v: Any) -> bool:
    """A model reference that can resolve: a folder, a tiny: name or a hub id (the plan resolves it)."""
    return v is None or str(v).startswith(TINY_PREFIX) or Path(str(v)).expanduser().exists() \
        or parse_hub_id(str(v)) is not None


def _betas(v: Any) -> bool:
    return v is not None and len(v) == 2 and all(0.0 <= b < 1.0 for b in v)


def _names(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


def _pattern(v: Any) -> bool:
    try:
        re.compile(v)
    except (re.error, TypeError):
        return False
    return True


def _range(v: Any) -> bool:
    return v is None or (len(v) == 2 and all(_finite(x) for x in v) and v[0] < v[1])


def _choices(v: Any) -> bool:
    return len(v) == 0 or (len(v) >= 2 and len(set(v)) == len(v) and all(_names(c) for c in v))


def _parse_error_value(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip() == "drop"
    return _finite(v)


# (options, check, what the value must be, how to fix it); "{m}" expands over MODEL_ROLES, "{s}" over
# SCORE_MODELS and each reward source's model (reward.sources.<i>.model), "{r}" over all of them and PLACED
RULES: list[tuple[tuple[str, ...], Callable[[Any], bool], str, str]] = [
    (("algorithm.gamma", "algorithm.lam"), _unit, "must be in [0, 1]", "1.0: no discount / plain returns"),
    (("algorithm.value_clip",), _above(0), "must be > 0", "0.2 is common"),
    (("algorithm.entropy_coef",), lambda v: _finite(v) and v >= 0, "must be >= 0", "0 turns the bonus off"),
    (("algorithm.ppo_epochs",), _at_least(1), "must be >= 1", "passes over each batch"),
    (("algorithm.mini_batch_size",), _optional(_at_least(1)), "must be >= 1", "leave unset for one mini-batch"),
    (("algorithm.kl.coef", "algorithm.kl.final_coef"), lambda v: _finite(v) and v >= 0, "must be >= 0",
     "0 turns the KL term off"),
    (("algorithm.kl.target",), _above(0), "must be > 0", "the adaptive controller's KL target, e.g. 6"),
    (("algorithm.kl.horizon",), _at_least(1), "must be >= 1", "steps over which the coefficient adapts"),
    (("algorithm.overlong_penalty",), _optional(lambda v: _finite(v) and v >= 0), "must be >= 0",
     "the reward lost at max_new_tokens, e.g. 1.0"),
    (("algorithm.cost_limit",), _finite, "must be a finite number", "the cost budget of Safe-RLHF"),
    (("algorithm.lagrangian_lr",), _above(0), "must be > 0", "e.g. 0.05"),
    (("algorithm.lagrangian_init",), lambda v: _finite(v) and v >= 0, "must be >= 0", "e.g. 1.0"),
    (("{m}.model.path", "{s}.model", "{s}.tokenizer"), _exists, "does not exist",
     "give a Hugging Face model folder, a hub id org/name[@revision], a bundled tiny:<name>, or leave it unset"),
    (("{m}.model.dtype", "{s}.dtype"), _one_of(*DTYPE_CHOICES), f"is not one of {list(DTYPE_CHOICES)}",
     "auto: bf16 where it is native and pays, else float32 (models/precision.py)"),
    (("{r}.parallel.tp", "{r}.parallel.pp"), _at_least(1), "must be >= 1", "1 means no split"),
    (("{r}.parallel.dp",), _optional(_at_least(1)), "must be >= 1", "leave unset: the pool's devices / (tp * pp)"),
    (("{r}.parallel.ep",), _at_least(1), "must be >= 1", "1: every rank holds all experts"),
    (("{r}.parallel.fsdp",), _one_of(*FSDP_MODES), f"is not one of {list(FSDP_MODES)}",
     "full_shard shards parameters, gradients and optimizer states over dp; no_shard: Megatron DDP"),
    (("rollout.ep",), _at_least(1), "must be >= 1", "1: every generation replica holds all experts"),
    (("{r}.parallel.expert_tp",), _optional(_at_least(1)), "must be >= 1",
     "leave unset for the dense tp; 1 keeps each expert whole"),
    (("{m}.optim.optimizer",), _one_of(*OPTIMIZERS), f"is not one of {list(OPTIMIZERS)}", "adam"),
    (("{m}.optim.lr",), _above(0), "must be > 0", "e.g. 1e-6 for a 7B actor"),
    (("{m}.optim.weight_decay", "{m}.optim.clip_grad"), lambda v: _finite(v) and v >= 0, "must be >= 0",
     "0 turns it off"),
    (("{m}.optim.betas",), _betas, "must be two numbers in [0, 1)", "[0.9, 0.999]"),
    (("{m}.optim.warmup_steps",), _at_least(0), "must be >= 0", "0: no warm-up"),
    (("{m}.moe.aux_loss_coef", "{m}.moe.z_loss_coef"), lambda v: _finite(v) and v >= 0, "must be >= 0",
     "0 turns it off; 1e-3 is common"),
    (("{r}.micro_batch_size",), _at_least(1), "must be >= 1", "sequences per forward pass"),
    (("{r}.max_tokens_per_micro_batch",), _optional(_at_least(1)), "must be >= 1",
     "leave unset to batch by micro_batch_size"),
    (("{r}.pool",), _names, "must name a pool", "default, or a name in resources.pools"),
    (("rollout.tp",), _at_least(1), "must be >= 1", "a divisor of actor.parallel.tp"),
    (("rollout.max_model_len",), _optional(_at_least(1)), "must be >= 1", "leave unset"),
    (("rollout.max_batch_size",), _at_least(1), "must be >= 1", "sequences decoded together"),
    (("rollout.vllm.dtype",), _optional(_one_of(*CONCRETE_DTYPES)), f"is not one of {list(CONCRETE_DTYPES)}",
     "leave unset: the actor's dtype"),
    (("rollout.vllm.kv_cache_memory_bytes",), _optional(_at_least(1)), "must be >= 1",
     "bytes of vLLM's KV cache on CPU, e.g. 67108864"),
    (("rollout.vllm.gpu_memory_utilization",), lambda v: v is not None and 0.0 < v <= 1.0, "must be in (0, 1]",
     "the share of GPU memory vLLM may take, e.g. 0.5"),
    (("rollout.pool",), _names, "must name a pool", "the actor's pool (colocated) or a name in resources.pools"),
    (("algorithm.max_staleness",), _at_least(0), "must be >= 0", "0: every sample from the current weights"),
    (("trainer.mode",), _one_of("sync", "one_step_off", "async"), "is not sync, one_step_off or async", "sync"),
    (("rollout.env",), _optional(_names), "must name an environment", "charset_turns, tool_answer or pkg.mod:Class"),
    (("rollout.tool_sandbox",), lambda v: v == "auto" or v in SANDBOXES, "is not a registered tool sandbox",
     "auto, bwrap, remote, guard or none"),
    (("rollout.tool_sandbox_url",), _optional(lambda v: str(v).startswith(("http://", "https://"))),
     "is not an http(s):// URL", "the sandbox service's endpoint, e.g. http://HOST:8080/run_code"),
    (("rollout.max_turns",), _at_least(1), "must be >= 1", "model turns per episode"),
    (("rollout.max_episode_tokens",), _optional(_at_least(1)), "must be >= 1",
     "leave unset: 2 * max_turns * max_new_tokens"),
    (("rollout.turn_discount",), _unit, "must be in [0, 1]", "1.0 sums the turn rewards"),
    (("rollout.agent",), _optional(_names), "must name an async function", "package.module:function"),
    (("rollout.agent_concurrency",), _at_least(1), "must be >= 1", "agent runs in flight at once, e.g. 64"),
    (("rollout.agent_timeout_s",), _above(0), "must be > 0", "seconds an agent run may take"),
    (("rollout.agent_failure_reward",), _optional(_finite), "must be a finite number",
     "leave unset to drop failed runs"),
    (("rollout.endpoint.host",), _names, "must name an address", "127.0.0.1 (this machine only)"),
    (("rollout.endpoint.port",), lambda v: v is not None and 0 <= v <= 65535, "must be in [0, 65535]",
     "0 picks a free port"),
    (("rollout.endpoint.max_request_bytes",), _at_least(1024), "must be >= 1024", "4194304 (4 MiB)"),
    (("rollout.endpoint.max_n",), _at_least(1), "must be >= 1", "choices one request may ask for"),
    (("rollout.endpoint.batch_window_ms",), lambda v: _finite(v) and v >= 0, "must be >= 0",
     "milliseconds a request waits for others to batch with"),
    (("rollout.endpoint.sampling",), _one_of("request", "config"), "is not request or config", "request"),
    (("reward.num_workers",), _at_least(0), "must be >= 0", "0 scores on the driver"),
    (("data.prompt_key",), _names, "must name a column", "prompt"),
    (("data.max_prompt_length",), _at_least(1), "must be >= 1", "the longest prompt in tokens"),
    (("data.overlong_prompts",), _one_of("error", "drop"), "is not error or drop", "drop skips long prompts"),
    (("data.seed", "trainer.seed"), _at_least(0), "must be >= 0", "any non-negative integer"),
    (("resources.ray_address",), _optional(lambda v: bool(RAY_ADDRESS.match(str(v)))),
     "is not auto, HOST:PORT or ray://HOST:PORT", "leave unset for a local Ray"),
    (("trainer.log_every",), _at_least(0), "must be >= 0", "0: no console lines"),
    (("trainer.project",), _names, "must not be empty", "hybridrl"),
    (("trainer.call_timeout_s",), _above(0), "must be > 0", "seconds one worker call may take"),
    # generative judges and reward sources
    (("{s}.kind",), _one_of("scalar", "generative"), "is not scalar or generative",
     "generative: a causal LM judge with a template and a parser"),
    (("{s}.generation.engine",), _one_of("auto", "native", "vllm"), "is not auto, native or vllm", "auto"),
    (("{s}.generation.max_new_tokens", "{s}.generation.max_batch_size"), _at_least(1), "must be >= 1",
     "the verdict's tokens / rows decoded together"),
    (("{s}.generation.tp", "{s}.generation.max_model_len"), _optional(_at_least(1)), "must be >= 1",
     "leave unset"),
    (("{s}.generation.temperature",), lambda v: _finite(v) and v >= 0, "must be >= 0", "0: greedy verdicts"),
    (("{s}.on_parse_error",), _parse_error_value, "is not a finite score or 'drop'",
     "a score such as 0.0, or drop: the sample is left out of the update"),
    (("{s}.template",), _optional(_names), "must not be empty", "the judge's prompt, e.g. '{prompt}|{response}='"),
    (("{s}.parser.pattern",), _pattern, "is not a regular expression", r"e.g. 'Score: (\d+)'"),
    (("{s}.parser.score_range",), _range, "must be [low, high] with low < high", "e.g. [0, 10]; unset: as is"),
    (("{s}.parser.choices",), _choices, "must be empty or two or more different answers", "e.g. ['yes', 'no']"),
    (("{s}.parser.choice_values",), _optional(lambda v: all(_finite(x) for x in v)), "must be numbers",
     "one value per answer, e.g. [1, 0]"),
    (("{s}.generation.vllm.dtype",), _optional(_one_of(*CONCRETE_DTYPES)), f"is not one of {list(CONCRETE_DTYPES)}",
     "leave unset: the judge's dtype"),
    (("{s}.generation.vllm.kv_cache_memory_bytes",), _optional(_at_least(1)), "must be >= 1", "e.g. 67108864"),
    (("{s}.generation.vllm.gpu_memory_utilization",), lambda v: _finite(v) and 0 < v <= 1, "must be in (0, 1]",
     "e.g. 0.5"),
    (("reward.sources.*.weight",), _finite, "must be a finite number", "the source's weight in the reward"),
    # on-policy distillation
    (("algorithm.distill.teacher",), _exists, "does not exist",
     "give the teacher's Hugging Face folder or a bundled tiny:<name>"),
    (("algorithm.distill.coef",), lambda v: _finite(v) and v >= 0, "must be >= 0", "1.0: the plain reverse KL"),
    (("algorithm.distill.dtype",), _one_of(*DTYPE_CHOICES), f"is not one of {list(DTYPE_CHOICES)}",
     "auto: bf16 where it is native and pays, else float32 (models/precision.py)"),
]

# LoRA adapters (actor.lora, critic.lora; models/lora.py)
RULES += [
    (("{m}.lora.rank",), _at_least(0), "must be >= 0", "0 turns LoRA off; 8-64 is common"),
    (("{m}.lora.alpha",), _optional(_above(0)), "must be > 0", "leave unset: alpha = rank"),
    (("{m}.lora.dropout",), lambda v: v is not None and 0.0 <= v < 1.0, "must be in [0, 1)", "0: no dropout"),
    (("{m}.lora.generation",), _one_of("merge", "forward"), "is not merge or forward", "merge"),
    (("{m}.lora.target_modules",), lambda v: v is None or (len(v) > 0 and all(n in TARGET_NAMES for n in v)),
     "names a module LoRA does not adapt", "qkv, proj, fc1, fc2, all, output, or q_proj ... down_proj, lm_head"),
    (("{m}.lora.init",), lambda v: v in ("kaiming", "gaussian") or (Path(str(v)).expanduser() /
                                                                   "adapter_config.json").is_file()
     or is_hub_reference(v), "is not kaiming, gaussian, a PEFT adapter folder (adapter_config.json) or a hub id",
     "kaiming"),
    (("trainer.signal_grace_s",), _above(0), "must be > 0",
     "seconds between the scheduler's stop signal and its SIGKILL: Slurm's KillWait, 30 by default"),
    (("trainer.start_timeout_s",), _optional(_above(0)), "must be > 0",
     "leave unset: 300 s + 30 s per billion parameters of the largest model"),
]


def _expand(option: str, sources: int = 0) -> list[str]:
    """An option pattern's options; `sources`: how many reward.sources the config lists."""
    models = tuple(f"reward.sources.{i}.model" for i in range(sources))
    groups = {"{m}": MODEL_ROLES, "{s}": SCORE_MODELS + models, "{r}": MODEL_ROLES + SCORE_MODELS + models + PLACED}
    for mark, sections in groups.items():
        if option.startswith(mark):
            return [section + option[len(mark):] for section in sections]
    if "*" in option:
        return [option.replace("*", str(i)) for i in range(sources)]
    return [option]


def _value(cfg: Any, option: str) -> Any:
    node = cfg
    for key in option.split("."):
        node = node[int(key)] if key.isdigit() else node[key]
    return node


def _check_registered_names(cfg: Any, sources: int) -> None:
    """Names that must be registered: each judge section's verdict parser (its module imported first), the
    distillation mode."""
    for section in _expand("{s}", sources):
        try:
            verdict_parser(_value(cfg, f"{section}.parser"), f"{section}.parser")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    try:
        check_distill_mode(cfg.algorithm.distill.mode)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def checked_options() -> list[str]:
    return [option for options, *_ in RULES for pattern in options for option in _expand(pattern)]


def check_values(cfg: Any) -> None:
    """Raise ConfigError for the first option whose value cannot work."""
    sources = len(cfg.reward.sources)
    for options, check, what, fix in RULES:
        for option in (o for pattern in options for o in _expand(pattern, sources)):
            value = _value(cfg, option)
            if not check(value):
                raise ConfigError(f"{option}={value!r}: {what} ({fix})")
    _check_registered_names(cfg, sources)
    estimator = cfg.algorithm.kl.estimator
    if estimator is not None and estimator not in KL_ESTIMATORS:
        raise ConfigError(f"algorithm.kl.estimator={estimator!r}: is not one of {list(KL_ESTIMATORS)} (k1)")
    unknown = [b for b in cfg.trainer.trackers if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"trainer.trackers={list(cfg.trainer.trackers)}: {unknown} unknown (choose from "
                          f"{list(BACKENDS)}, or [] for metrics.jsonl only)")
    for section in SCORE_MODELS:
        try:
            check_score_format(cfg[section].format, f"{section}.format")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    try:
        sampling_params_from_config(cfg.rollout)  # n, temperature, top_p, top_k, max_new_tokens
    except SamplingParamsError as exc:
        option = re.sub(r"^SamplingParams\.", "rollout.", str(exc))
        raise ConfigError(option) from None
