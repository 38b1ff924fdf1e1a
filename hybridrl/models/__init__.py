"""Megatron-Core GPT models from Hugging Face configs, and HF <-> Megatron conversion (the families of
families.py: Llama, Qwen2, Qwen3 and the MoE ones).

Public API:
    build_gpt_model(hf_config, head="lm"|"scalar", ...)          -> GPTModel shard for this rank
    load_hf_weights(model, folder, hf_config)                     streamed, each rank reads its slices
    export_hf_checkpoint(model, hf_config, out_dir)               gather shards, write safetensors + config
    save_dist_checkpoint / load_dist_checkpoint                   Megatron distributed checkpoints
    family_for(hf_config).to_hf(name, full_tensor, hf_config)     full Megatron tensor -> HF tensors
    tp_shard / tp_gather / tp_partition_dim                       full tensor <-> TP shards
    create_tiny_model(out_dir, family, ...)                       random-weight HF model for tests
"""
from hybridrl.models.builder import build_gpt_model, named_global_parameters
from hybridrl.models.checkpoint_hf import check_hf_checkpoint, export_hf_checkpoint, load_hf_weights
from hybridrl.models.config import CheckpointError, load_hf_config
from hybridrl.models.dist_ckpt import load_dist_checkpoint, save_dist_checkpoint
from hybridrl.models.families import (FAMILIES, ModelFamily, UnsupportedModelError, family_for, tp_gather,
                                      tp_partition_dim, tp_shard)
from hybridrl.models.tiny import create_tiny_model
from hybridrl.models import made  # noqa: F401,E402  registers the made models (tiny:charset_judge, tiny:opd_teacher)

__all__ = ["build_gpt_model", "named_global_parameters", "check_hf_checkpoint", "export_hf_checkpoint",
           "load_hf_weights", "CheckpointError", "load_hf_config", "load_dist_checkpoint", "save_dist_checkpoint",
           "FAMILIES", "ModelFamily", "UnsupportedModelError", "family_for", "tp_gather", "tp_partition_dim",
           "tp_shard", "create_tiny_model"]
