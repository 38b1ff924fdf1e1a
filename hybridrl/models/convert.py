"""Hugging Face <-> Megatron distributed checkpoints, on T*P local processes (`hybridrl convert`, the command
in hybridrl/cli/convert.py): `plan` checks a conversion and describes it, `convert` runs it.

    hybridrl convert --from hf --to mcore --tp 2 --pp 2 [--ep E [--expert-tp T]] SRC_HF_DIR DST_MCORE_DIR
    hybridrl convert --from mcore --to hf [--tp T --pp P] SRC_MCORE_DIR DST_HF_DIR
    hybridrl convert --from ckpt --to hf [--tp T --pp P] RUN/ckpt/step_N DST_HF_DIR   (a training run's actor)

Everything that can be checked without Megatron (formats, architecture, layout divisibility,
checkpoint completeness) is checked before any process starts.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridrl.models.builder import build_gpt_model
from hybridrl.models.checkpoint_hf import check_hf_checkpoint, export_hf_checkpoint, load_hf_weights
from hybridrl.models.config import CheckpointError, check_supported, load_hf_config
from hybridrl.models.dist_ckpt import load_dist_checkpoint, read_dist_checkpoint_info, save_dist_checkpoint
from hybridrl.models.families import ModelDims, family_for, head_of
from hybridrl.parallel.distributed import (destroy_model_parallel, free_port, init_distributed,
                                           initialize_model_parallel)
from hybridrl.parallel.layout import LayoutError, ParallelLayout

logger = logging.getLogger(__name__)

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConvertError(ValueError):
    """Bad `hybridrl convert` arguments."""


@dataclass
class ConvertJob:
    source_format: str
    source: str
    destination: str
    layout: ParallelLayout
    head: str
    dtype: torch.dtype


def _config_dtype(hf_config: Any) -> torch.dtype:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def plan(source_format: str, target_format: str, src: str, dst: str, tp: int = 1, pp: int = 1,
         dtype: str = "auto", ep: int = 1, expert_tp: int | None = None,
         actor_checkpoint: Callable[[str], str] | None = None) -> ConvertJob:
    """Validate everything and describe the job; raises a clear error on any bad input.

    A `ckpt` source is a training checkpoint folder; `actor_checkpoint(folder)` finds the actor's Megatron
    checkpoint inside it (the trainer owns that layout: the command passes trainer/checkpoint.py's), raising
    CheckpointError when there is none."""
    if (source_format, target_format) not in (("hf", "mcore"), ("mcore", "hf"), ("ckpt", "hf")):
        raise ConvertError(f"--from {source_format} --to {target_format} is not a conversion; use "
                           f"--from hf --to mcore, --from mcore --to hf or --from ckpt --to hf")
    if source_format == "ckpt":  # the actor's Megatron checkpoint inside RUN/ckpt/step_N
        if actor_checkpoint is None:
            raise ConvertError("a training checkpoint source needs actor_checkpoint= (how to find the actor's "
                               "checkpoint in it)")
        if not Path(src).is_dir():
            raise CheckpointError(f"source {src} does not exist or is not a folder")
        src = actor_checkpoint(src)
        source_format = "mcore"
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    # the expert grid re-splits a stage's tp*dp ranks into ep * expert_tp-sized groups: the fewest DP replicas
    # whose ranks make a whole number of them
    grid = (expert_tp or tp) * ep
    dp = grid // math.gcd(grid, tp) if grid > 0 and tp > 0 else 1  # bad sizes: the layout names them
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep, etp=expert_tp)
    src_path, dst_path = Path(src), Path(dst)
    if not src_path.is_dir():
        raise CheckpointError(f"source {src} does not exist or is not a folder")
    if dst_path.exists() and (not dst_path.is_dir() or any(dst_path.iterdir())):
        raise ConvertError(f"destination {dst} exists and is not an empty folder; choose a new folder")
    if source_format == "hf":
        hf_config = load_hf_config(src_path)
    else:
        hf_config, _ = read_dist_checkpoint_info(src_path)
    family_for(hf_config)
    check_supported(hf_config)
    dims = ModelDims.from_hf(hf_config)
    layout.check_model(dims.num_heads, dims.num_query_groups, dims.num_layers, dims.vocab_size,
                       dims.moe.num_experts if dims.moe else 0, dims.moe.ffn_hidden if dims.moe else 0)
    head = "scalar" if head_of(hf_config) == "scalar" else "lm"
    if source_format == "hf":
        check_hf_checkpoint(src_path, hf_config, head)
    return ConvertJob(source_format, str(src_path), str(dst_path), layout, head,
                      DTYPES[dtype] or _config_dtype(hf_config))


def _worker(rank: int, job: ConvertJob, port: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["LOCAL_RANK"] = str(rank)  # prepare_process picks the GPU from it
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    init_distributed(rank, job.layout.world_size, "127.0.0.1", port)
    try:
        initialize_model_parallel(job.layout)
        if job.source_format == "hf":
            hf_config = load_hf_config(job.source)
            model = build_gpt_model(hf_config, head=job.head, dtype=job.dtype)
            load_hf_weights(model, job.source, hf_config)
            save_dist_checkpoint(model, hf_config, job.destination)
        else:
            hf_config, _ = read_dist_checkpoint_info(job.source)
            model = build_gpt_model(hf_config, head=job.head, dtype=job.dtype)
            load_dist_checkpoint(model, job.source)
            export_hf_checkpoint(model, hf_config, job.destination)
        destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()


def convert(job: ConvertJob) -> None:
    """Run a planned job on the layout's local processes (gloo on CPU, one GPU each when CUDA is present)."""
    import torch.multiprocessing as tmp

    if torch.cuda.is_available() and torch.cuda.device_count() < job.layout.world_size:
        raise LayoutError(f"{job.layout.describe()} needs {job.layout.world_size} processes but only {torch.cuda.device_count()} "
                          f"GPUs; lower --tp/--pp/--ep")
    logger.info("converting %s (%s) -> %s with %d processes (%s)", job.source, job.source_format,
                job.destination, job.layout.world_size, job.layout.describe())
    tmp.spawn(_worker, args=(job, free_port()), nprocs=job.layout.world_size, join=True)
