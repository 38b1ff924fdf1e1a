"""`hybridrl convert` for LoRA adapters (cli/convert.py): no Megatron processes, the adapters are whole tensors.

    hybridrl convert --from ckpt --to peft RUN/ckpt/step_N DST              a LoRA run's actor adapters (PEFT)
    hybridrl convert --from ckpt --to hf --merge-lora RUN/ckpt/step_N DST   its policy merged into the base
    hybridrl convert --from peft --to hf --merge-lora ADAPTER_DIR DST       any PEFT LoRA adapter merged
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from hybridrl.models.config import CheckpointError
from hybridrl.models.convert import ConvertError
from hybridrl.models.peft import is_peft_adapter, model_config, read_peft_adapter, write_merged_model


def convert_lora(source_format: str, target_format: str, src: str, dst: str, merge_lora: bool,
                 adapter_of_checkpoint: Callable[[str], Path | None]) -> str:
    """Check and run one adapter conversion; returns what was written. `adapter_of_checkpoint(folder)`: a run
    checkpoint's actor adapter folder, None for a full fine-tuning checkpoint (trainer/checkpoint.py's)."""
    if (source_format, target_format) not in (("ckpt", "peft"), ("ckpt", "hf"), ("peft", "hf")):
        raise ConvertError(f"--from {source_format} --to {target_format}: adapters convert --from ckpt --to peft, "
                           f"--from ckpt --to hf --merge-lora or --from peft --to hf --merge-lora")
    if target_format == "hf" and not merge_lora:
        raise ConvertError("--to hf from adapters writes the merged model: add --merge-lora")
    if target_format == "peft" and merge_lora:
        raise ConvertError("--merge-lora writes a whole model: use --to hf (--to peft keeps the adapters apart)")
    if not Path(src).is_dir():
        raise CheckpointError(f"source {src} does not exist or is not a folder")
    dst_path = Path(dst)
    if dst_path.exists() and (not dst_path.is_dir() or any(dst_path.iterdir())):
        raise ConvertError(f"destination {dst} exists and is not an empty folder; choose a new folder")
    adapter = Path(src) if source_format == "peft" else adapter_of_checkpoint(src)
    if adapter is None or not is_peft_adapter(adapter):
        raise CheckpointError(f"{src}: no LoRA adapters there (a full fine-tuning checkpoint converts with --to hf)"
                              if source_format == "ckpt" else f"{src}: no PEFT adapter (adapter_config.json)")
    read_peft_adapter(adapter)
    model_config(adapter)  # the base must be there before anything is written
    if target_format == "peft":
        dst_path.mkdir(parents=True, exist_ok=True)
        for item in adapter.iterdir():
            shutil.copy(item, dst_path / item.name)
        return f"adapters of {adapter} -> {dst} (PEFT adapter folder)"
    write_merged_model(adapter, dst_path)
    return f"{adapter} merged into its base -> {dst} (Hugging Face model folder)"
