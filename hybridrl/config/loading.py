"""Loading a config: the schema's defaults <- a YAML file <- key=value overrides <- the algorithm's defaults; and the
two ways settings become typed sections (typed(cfg.section), as_section(cls, keyword dict))."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.bundled import bundled_dir
from hybridrl.config import schema
from hybridrl.config.schema import ConfigError, HybridRLConfig

CONFIG_DIR = bundled_dir("configs")

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


_SECTIONS = {name: cls for name, cls in vars(schema).items()
             if isinstance(cls, type) and dataclasses.is_dataclass(cls) and name.endswith("Config")}


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
