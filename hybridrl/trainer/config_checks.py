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

from hybridrl.algorithms.losses import KL_ESTIMATORS
from hybridrl.config import ConfigError
from hybridrl.models.tiny import TINY_PREFIX
from hybridrl.rollout import sampling_params_from_config
from hybridrl.rollout.base import SamplingParamsError
from hybridrl.trainer.tracking import BACKENDS

MODEL_ROLES = ("actor", "ref", "critic")  # sections with model / parallel / optim
SCORE_MODELS = ("reward_model", "cost_model")
DTYPES = ("float32", "bfloat16", "float16")
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
    return v is None or str(v).startswith(TINY_PREFIX) or Path(str(v)).expanduser().exists()


def _betas(v: Any) -> bool:
    return v is not None and len(v) == 2 and all(0.0 <= b < 1.0 for b in v)


def _names(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


# (options, check, what the value must be, how to fix it); "{m}" expands over MODEL_ROLES, "{s}" over
# SCORE_MODELS, "{r}" over both
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
     "give a Hugging Face model folder, a bundled tiny:<name>, or leave it unset"),
    (("{m}.model.dtype", "{s}.dtype"), _one_of(*DTYPES), f"is not one of {list(DTYPES)}", "float32 on CPU"),
    (("{r}.parallel.tp", "{r}.parallel.pp"), _at_least(1), "must be >= 1", "1 means no split"),
    (("{r}.parallel.dp",), _optional(_at_least(1)), "must be >= 1", "leave unset: the pool's devices / (tp * pp)"),
    (("{r}.parallel.ep",), _at_least(1), "must be >= 1", "1: every rank holds all experts"),
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
    (("rollout.pool",), _names, "must name a pool", "the actor's pool (colocated) or a name in resources.pools"),
    (("algorithm.max_staleness",), _at_least(0), "must be >= 0", "0: every sample from the current weights"),
    (("trainer.mode",), _one_of("sync", "one_step_off", "async"), "is not sync, one_step_off or async", "sync"),
    (("rollout.env",), _optional(_names), "must name an environment", "charset_turns, tool_answer or pkg.mod:Class"),
    (("rollout.max_turns",), _at_least(1), "must be >= 1", "model turns per episode"),
    (("rollout.max_episode_tokens",), _optional(_at_least(1)), "must be >= 1",
     "leave unset: 2 * max_turns * max_new_tokens"),
    (("rollout.turn_discount",), _unit, "must be in [0, 1]", "1.0 sums the turn rewards"),
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
    (("trainer.start_timeout_s",), _optional(_above(0)), "must be > 0",
     "leave unset: 300 s + 30 s per billion parameters of the largest model"),
]


def _expand(option: str) -> list[str]:
    groups = {"{m}": MODEL_ROLES, "{s}": SCORE_MODELS, "{r}": MODEL_ROLES + SCORE_MODELS}
    for mark, sections in groups.items():
        if option.startswith(mark):
            return [section + option[len(mark):] for section in sections]
    return [option]


def _value(cfg: Any, option: str) -> Any:
    node = cfg
    for key in option.split("."):
        node = node[key]
    return node


def checked_options() -> list[str]:
    return [option for options, *_ in RULES for pattern in options for option in _expand(pattern)]


def check_values(cfg: Any) -> None:
    """Raise ConfigError for the first option whose value cannot work."""
    for options, check, what, fix in RULES:
        for option in (o for pattern in options for o in _expand(pattern)):
            value = _value(cfg, option)
            if not check(value):
                raise ConfigError(f"{option}={value!r}: {what} ({fix})")
    estimator = cfg.algorithm.kl.estimator
    if estimator is not None and estimator not in KL_ESTIMATORS:
        raise ConfigError(f"algorithm.kl.estimator={estimator!r}: is not one of {list(KL_ESTIMATORS)} (k1)")
    unknown = [b for b in cfg.trainer.trackers if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"trainer.trackers={list(cfg.trainer.trackers)}: {unknown} unknown (choose from "
                          f"{list(BACKENDS)}, or [] for metrics.jsonl only)")
    try:
        sampling_params_from_config(cfg.rollout)  # n, temperature, top_p, top_k, max_new_tokens
    except SamplingParamsError as exc:
        option = re.sub(r"^SamplingParams\.", "rollout.", str(exc))
        raise ConfigError(option) from None
