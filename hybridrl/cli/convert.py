"""`hybridrl convert`: Hugging Face <-> Megatron distributed checkpoints (hybridrl/models/convert.py does it).

    hybridrl convert --from hf --to mcore --tp 2 --pp 2 [--ep E [--expert-tp T]] SRC_HF DST_MCORE_DIR
    hybridrl convert --from mcore --to hf [--tp T --pp P] SRC_MCORE_DIR DST_HF_DIR
    hybridrl convert --from ckpt --to hf [--tp T --pp P] RUN/ckpt/step_N DST_HF_DIR   (a training run's actor)
    hybridrl convert --from ckpt --to peft RUN/ckpt/step_N DST              (a LoRA run's adapters, PEFT folder)
    hybridrl convert --from ckpt|peft --to hf --merge-lora SRC DST_HF_DIR   (LoRA adapters merged into the base)

SRC_HF: a Hugging Face folder, a hub id org/name[@revision] (fetched into the HF cache first) or tiny:<name>.
"""
from __future__ import annotations

import argparse
import sys

from hybridrl.parallel.layout import LayoutError

FORMATS = ("hf", "mcore", "ckpt", "peft")  # ckpt: a `hybridrl train` checkpoint folder (source only); peft: an adapter
# models/convert.py's DTYPES, by name: that module imports torch, which `hybridrl --help` does without
DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source_format", choices=FORMATS, required=True, help="source format")
    parser.add_argument("--to", dest="target_format", choices=FORMATS, required=True, help="target format")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the conversion (and of the "
                        "written Megatron checkpoint)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the conversion")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models): the "
                        "conversion runs on tp*pp*dp processes, dp the fewest DP replicas that make whole expert grids "
                        "(ep*expert_tp/gcd(ep*expert_tp, tp)), each holding "
                        "1/ep of every MoE layer's experts")
    parser.add_argument("--expert-tp", type=int, default=None, help="the experts' tensor-parallel size, dividing "
                        "--tp or a multiple of it (default: --tp); below --tp the expert-parallel ranks include TP "
                        "ranks, above it an expert is split over ranks of several DP replicas")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                        help="parameter dtype (auto: the HF config's dtype, else float32)")
    parser.add_argument("--merge-lora", action="store_true", help="LoRA adapters (a LoRA run's checkpoint, a PEFT "
                        "folder) -> a Hugging Face model with W + (alpha / r) B A merged in")
    parser.add_argument("src", help="source folder (--from hf: also a hub id org/name[@revision] or tiny:<name>)")
    parser.add_argument("dst", help="destination folder (must not exist or be empty)")


def _actor_checkpoint(folder: str) -> str:
    """The actor's Megatron checkpoint inside a training checkpoint (RUN/ckpt/step_N; trainer/checkpoint.py)."""
    # start-up time: torch (see run)
    from hybridrl.models.config import CheckpointError
    from hybridrl.trainer.checkpoint import CheckpointNotFoundError, actor_adapter_dir, actor_model_dir

    if actor_adapter_dir(folder) is not None:
        raise CheckpointError(f"{folder}: a LoRA run's checkpoint (adapters only): add --merge-lora for the merged "
                              f"model, or convert --to peft for the adapters")
    try:
        return str(actor_model_dir(folder))
    except CheckpointNotFoundError as exc:
        raise CheckpointError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    # start-up time: these import torch, which every `hybridrl` command would load with the parser otherwise
    from hybridrl.models.config import CheckpointError
    from hybridrl.models.convert import ConvertError, convert, plan
    from hybridrl.models.families import UnsupportedModelError
    from hybridrl.models.hub import ModelReferenceError, resolve_model

    if is_lora_conversion(args.source_format, args.target_format, getattr(args, "merge_lora", False)):
        return _run_lora(args)
    try:
        if args.source_format == "hf":
            args.src = resolve_model(args.src, "SRC")
        job = plan(args.source_format, args.target_format, args.src, args.dst, args.tp, args.pp, args.dtype, args.ep,
                   getattr(args, "expert_tp", None), actor_checkpoint=_actor_checkpoint)
    except (ConvertError, CheckpointError, UnsupportedModelError, LayoutError, ModelReferenceError) as exc:
        print(f"hybridrl convert: error: {exc}", file=sys.stderr)
        return 2
    convert(job)
    print(f"converted {job.source} -> {job.destination} ({job.layout.describe()})")
    return 0


def is_lora_conversion(source_format: str, target_format: str, merge_lora: bool) -> bool:
    """Adapters in or out (models/convert_lora.py), no Megatron processes."""
    return target_format == "peft" or source_format == "peft" or merge_lora


def _run_lora(args: argparse.Namespace) -> int:
    # start-up time: torch (see run)
    from hybridrl.models.config import CheckpointError
    from hybridrl.models.convert import ConvertError
    from hybridrl.models.convert_lora import convert_lora
    from hybridrl.trainer.checkpoint import actor_adapter_dir

    try:
        done = convert_lora(args.source_format, args.target_format, args.src, args.dst, args.merge_lora,
                            adapter_of_checkpoint=actor_adapter_dir)
    except (ConvertError, CheckpointError) as exc:
        print(f"hybridrl convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"converted {done}")
    return 0
