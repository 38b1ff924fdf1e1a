"""OmegaConf structured configs: the schema (schema.py: every option declared once) and loading (loading.py: YAML +
key=value overrides + the algorithm's defaults). Everything is imported from here: `from hybridrl.config import
load_config, RolloutConfig`."""
from hybridrl.config.loading import (CONFIG_DIR, MOVED_OPTIONS, apply_algorithm_defaults, as_section, find_config,
                                     load_config, to_yaml, typed)
from hybridrl.config.schema import (LORA_INITS, ROLE_SECTIONS, AlgorithmConfig, ConfigError, DataConfig, DistillConfig,
                                    EndpointConfig, HybridRLConfig, JudgeGenerationConfig, KLConfig, LoraConfig,
                                    MachineError, ModelConfig, MoeConfig, OffloadConfig, OptimConfig, ParallelConfig,
                                    ResourcesConfig, RewardConfig, RewardSourceConfig, RoleConfig, RolloutConfig,
                                    ScoreModelConfig, TrainerConfig, VerdictParserConfig, VllmConfig, check_config,
                                    dtype_holder, role_section)

__all__ = [
    "CONFIG_DIR", "LORA_INITS", "MOVED_OPTIONS", "ROLE_SECTIONS", "AlgorithmConfig", "ConfigError", "DataConfig",
    "DistillConfig", "EndpointConfig", "HybridRLConfig", "JudgeGenerationConfig", "KLConfig", "LoraConfig",
    "MachineError", "ModelConfig", "MoeConfig", "OffloadConfig", "OptimConfig", "ParallelConfig", "ResourcesConfig",
    "RewardConfig", "RewardSourceConfig", "RoleConfig", "RolloutConfig", "ScoreModelConfig", "TrainerConfig",
    "VerdictParserConfig", "VllmConfig", "apply_algorithm_defaults", "as_section", "check_config", "find_config",
    "load_config",
    "dtype_holder", "role_section", "to_yaml", "typed",
]
