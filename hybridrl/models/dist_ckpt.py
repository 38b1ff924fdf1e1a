"""Megatron distributed checkpoints of a hybridrl GPT model, loadable at any TP/PP layout.

Layout of a checkpoint folder:
    metadata.json, *.distcp ...   Megatron dist_checkpointing (torch_dist) of `model.sharded_state_dict()`
    hybridrl_model.json           what to rebuild: family, head, saved layout
    hf_config/config.json         the Hugging Face config the model was built from
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from hybridrl.models.builder import unwrap
from hybridrl.models.config import CheckpointError, load_hf_config

logger = logging.getLogger(__name__)

MODEL_METADATA = "hybridrl_model.json"
HF_CONFIG_DIR = "hf_config"
MEGATRON_METADATA = "metadata.json"


def save_dist_checkpoint(model: Any, hf_config: Any, out_dir: str | Path) -> None:
    """Collective over all ranks: write this model's shards plus the metadata needed to rebuild it."""
    from megatron.core import dist_checkpointing, parallel_state

    out_dir = Path(out_dir)
    inner = unwrap(model)
    if torch.distributed.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        if any(out_dir.iterdir()):
            raise CheckpointError(f"{out_dir} is not empty; choose a new output folder")
    torch.distributed.barrier()
    dist_checkpointing.save(inner.sharded_state_dict(), str(out_dir))
    if torch.distributed.get_rank() == 0:
        hf_config.save_pretrained(str(out_dir / HF_CONFIG_DIR))
        meta = {"family": inner.hybridrl_family.name, "head": inner.hybridrl_head,
                "saved_tp": parallel_state.get_tensor_model_parallel_world_size(),
                "saved_pp": parallel_state.get_pipeline_model_parallel_world_size(),
                "padded_vocab_size": inner.hybridrl_args.padded_vocab_size}
        (out_dir / MODEL_METADATA).write_text(json.dumps(meta, indent=2))
    torch.distributed.barrier()
    logger.info("saved Megatron distributed checkpoint to %s", out_dir)


def read_dist_checkpoint_info(ckpt_dir: str | Path) -> tuple[Any, dict]:
    """(HF config, hybridrl metadata) of a checkpoint folder, or a clear error if it is incomplete."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: no such Megatron checkpoint folder")
    if not (ckpt_dir / MEGATRON_METADATA).is_file():
        raise CheckpointError(f"{ckpt_dir}: missing Megatron checkpoint metadata ({MEGATRON_METADATA}); the "
                              f"checkpoint is incomplete or not a Megatron distributed checkpoint")
    if not (ckpt_dir / MODEL_METADATA).is_file():
        raise CheckpointError(f"{ckpt_dir}: missing {MODEL_METADATA} (written by hybridrl next to the shards); "
                              f"save the checkpoint with `hybridrl convert --from hf --to mcore`")
    try:
        meta = json.loads((ckpt_dir / MODEL_METADATA).read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{ckpt_dir / MODEL_METADATA}: not valid JSON ({exc})") from exc
    return load_hf_config(ckpt_dir / HF_CONFIG_DIR), meta


def load_dist_checkpoint(model: Any, ckpt_dir: str | Path) -> None:
    """Collective over all ranks: fill this rank's shard from a checkpoint saved at any layout."""
    from megatron.core import dist_checkpointing

    read_dist_checkpoint_info(ckpt_dir)
    inner = unwrap(model)
    try:
        state = dist_checkpointing.load(inner.sharded_state_dict(), str(ckpt_dir))
    except Exception as exc:  # dist_checkpointing raises several types for missing/mismatched shards
        raise CheckpointError(f"{ckpt_dir}: loading the Megatron checkpoint failed: {exc}") from exc
    inner.load_state_dict(state)
    logger.info("loaded Megatron distributed checkpoint from %s", ckpt_dir)
