"""PEFT LoRA adapter folders, in and out, without the peft package (safetensors + JSON).

A PEFT adapter folder holds adapter_config.json (r, lora_alpha, target_modules, base_model_name_or_path,
modules_to_save, task_type) and adapter_model.safetensors with one lora_A [r, in] / lora_B [out, r] pair per
adapted Hugging Face module, keyed `base_model.model.<module>.lora_{A,B}.weight`, plus the modules_to_save
tensors (e.g. a reward model's trained head, `base_model.model.score.weight`).

Such a folder can stand wherever a model can: `model_config(path)` / `model_weights(path)` give the config and a
weight reader of the base with every adapter merged in (W + (alpha / r) B A, computed on the slices each rank
reads: any TP / PP), and the saved modules in place of the base's. It can also be a LoRA role's starting
adapters (lora.init), and `write_peft_adapter` writes one (checkpoints, `hybridrl convert --to peft`).
`is_peft_adapter(folder)` is the one test; `base_model_folder` the one place the base is found (a local folder,
absolute or beside the adapter, or a `tiny:` name).
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridrl.models.checkpoint_hf import SafetensorsReader
from hybridrl.models.config import CheckpointError, load_hf_config
from hybridrl.models.hub import ModelReferenceError, adapter_base, is_hub_reference, resolve_reference
from hybridrl.models.tiny import TINY_PREFIX, resolve_model_path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
# adapted Hugging Face projection -> the part of a Megatron linear (models/lora.py PARTS_OF)
PART_OF_PROJECTION = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
                      "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down", "lm_head": "lm_head"}
# PEFT features whose adapters are no plain W + (alpha / r) B A on the projections above
_UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D)", "rank_pattern": "rank_pattern",
                "alpha_pattern": "alpha_pattern", "layers_to_transform": "layers_to_transform",
                "layer_replication": "layer_replication", "lora_bias": "lora_bias",
                "trainable_token_indices": "trainable_token_indices", "target_parameters": "target_parameters"}


def is_peft_adapter(folder: str | Path) -> bool:
    """A folder holding a PEFT adapter (adapter_config.json) rather than a model."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


@dataclass
class PeftAdapter:
    """A PEFT LoRA adapter folder, read lazily (tensors on demand, sliced)."""
    folder: Path
    rank: int
    alpha: float
    scaling: float
    dropout: float
    base: str | None  # base_model_name_or_path as written
    task_type: str | None
    modules: dict[str, str] = field(default_factory=dict)  # adapted HF module -> part (q, k, ..., down)
    saved: dict[str, str] = field(default_factory=dict)  # modules_to_save: HF tensor name -> key in the file

    @property
    def parts(self) -> frozenset[str]:
        return frozenset(self.modules.values())

    def _slice(self, key: str):
        from safetensors import safe_open

        if not hasattr(self, "_handle"):
            self._handle = safe_open(str(self.folder / ADAPTER_WEIGHTS), framework="pt")
        return self._handle.get_slice(key)

    def factor(self, module: str, which: str, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> torch.Tensor:
        """lora_A ([r, in]) or lora_B ([out, r]) of an adapted module, whole or a row / column range."""
        key = f"{KEY_PREFIX}{module}.lora_{which}.weight"
        piece = self._slice(key)
        if rows is not None:
            return piece[rows[0]:rows[1]]
        if cols is not None:
            return piece[:, cols[0]:cols[1]]
        return piece[:]

    def saved_tensor(self, hf_name: str) -> torch.Tensor:
        return self._slice(self.saved[hf_name])[:]


def read_peft_adapter(folder: str | Path) -> PeftAdapter:
    """The adapter's settings and tensor index; CheckpointError for anything this loader would get wrong."""
    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{folder / ADAPTER_CONFIG}: unreadable ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{folder}: a {config.get('peft_type')} adapter; only LoRA adapters are supported")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise CheckpointError(f"{folder}: the adapter uses {what}, which hybridrl does not load; merge it with "
                                  f"peft (merge_and_unload) and pass the merged model folder")
    if config.get("bias", "none") != "none":
        raise CheckpointError(f"{folder}: bias={config['bias']!r} adapters train biases too; only bias='none' loads")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(f"{folder}: no {ADAPTER_WEIGHTS} (save the adapter with safe_serialization=True)")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = PeftAdapter(folder, rank, alpha, scaling, float(config.get("lora_dropout", 0.0)),
                          config.get("base_model_name_or_path"), config.get("task_type"))
    _index(adapter, config)
    return adapter


def _index(adapter: PeftAdapter, config: dict) -> None:
    from safetensors import safe_open

    with safe_open(str(adapter.folder / ADAPTER_WEIGHTS), framework="pt") as handle:
        keys = list(handle.keys())
    saved_heads = set(config.get("modules_to_save") or [])
    for key in keys:
        if not key.startswith(KEY_PREFIX):
            raise CheckpointError(f"{adapter.folder}: unexpected tensor {key!r} (not a PEFT LoRA key)")
        name = key[len(KEY_PREFIX):]
        if ".lora_A." in name or ".lora_B." in name:
            module = name.split(".lora_")[0]
            part = PART_OF_PROJECTION.get(module.rsplit(".", 1)[-1])
            if part is None:
                raise CheckpointError(f"{adapter.folder}: adapter on {module}, which is no attention or MLP "
                                      f"projection hybridrl adapts ({sorted(PART_OF_PROJECTION)})")
            adapter.modules[module] = part
        elif name.split(".")[0] in saved_heads or any(name.startswith(f"{m}.") for m in saved_heads):
            adapter.saved[name] = key
        else:
            raise CheckpointError(f"{adapter.folder}: tensor {key!r} is neither a LoRA factor nor one of "
                                  f"modules_to_save {sorted(saved_heads)}")
    if not adapter.modules:
        raise CheckpointError(f"{adapter.folder}: no LoRA factors in {ADAPTER_WEIGHTS}")


def base_model_folder(adapter: PeftAdapter, base: str | None = None) -> str:
    """The base model's local folder: `base` when given, else the adapter's base_model_name_or_path."""
    return _base_folder(adapter.folder, base or adapter.base)


def _base_folder(folder: Path, name: str | None) -> str:
    """The local folder of an adapter's base reference: a folder (absolute or relative to the adapter's), a tiny:
    name, or a hub id (its HF cache folder, models/hub.py: the driver fetched it, a worker reads the cache)."""
    if not name:
        raise CheckpointError(f"{folder}: {ADAPTER_CONFIG} names no base_model_name_or_path; give the "
                              f"base model folder")
    if str(name).startswith(TINY_PREFIX):
        return resolve_model_path(name)
    for candidate in (Path(name).expanduser(), folder / name):
        if (candidate / "config.json").is_file() or is_peft_adapter(candidate):  # an adapter over an adapter too
            return str(candidate)
    if is_hub_reference(name):
        try:
            return resolve_reference(name, f"{folder}/{ADAPTER_CONFIG} base_model_name_or_path")
        except ModelReferenceError as exc:
            raise CheckpointError(str(exc)) from None
    raise CheckpointError(f"{folder}: its base model {name!r} is no local model folder (config.json) and "
                          f"no hub id; set base_model_name_or_path to the base's folder or hub id")


# ---- a PEFT folder as a model: the base with the adapter merged in --------------------------------------
def merged_config(adapter: PeftAdapter, base_config: Any) -> Any:
    """The merged model's HF config: a sequence-classification adapter (task_type SEQ_CLS, its head among
    modules_to_save) turns a causal-LM base into *ForSequenceClassification with the head's labels."""
    config = copy.deepcopy(base_config)
    if adapter.task_type == "SEQ_CLS":
        if "score.weight" not in adapter.saved:
            raise CheckpointError(f"{adapter.folder}: a SEQ_CLS adapter without a trained score head "
                                  f"(modules_to_save: score)")
        labels = int(adapter._slice(adapter.saved["score.weight"]).get_shape()[0])
        architectures = [a.replace("ForCausalLM", "ForSequenceClassification")
                         for a in (getattr(config, "architectures", None) or [])]
        config.architectures = architectures
        config.num_labels = labels
    return config


class MergedReader:
    """SafetensorsReader's interface over base + adapter: an adapted projection's weight reads as
    W + scaling * B A (only the requested rows / columns computed), a saved module as the adapter's copy."""

    def __init__(self, base: SafetensorsReader, adapter: PeftAdapter) -> None:
        self.base, self.adapter = base, adapter
        self.weights = {f"{module}.weight": module for module in adapter.modules}
        self.weight_map = {**base.weight_map, **{name: "adapter" for name in adapter.saved}}

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.adapter.saved:
            return tuple(self.adapter._slice(self.adapter.saved[name]).get_shape())
        return self.base.shape(name)

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
             ) -> torch.Tensor:
        if name in self.adapter.saved:
            full = self.adapter.saved_tensor(name)
            return full[rows[0]:rows[1]] if rows else full[:, cols[0]:cols[1]] if cols else full
        weight = self.base.read(name, rows=rows, cols=cols)
        module = self.weights.get(name)
        if module is None:
            return weight
        a = self.adapter.factor(module, "A", cols=cols).float()
        b = self.adapter.factor(module, "B", rows=rows).float()
        return (weight.float() + self.adapter.scaling * (b @ a)).to(weight.dtype)


def model_config(path: str | Path) -> Any:
    """The HF config of a model folder, or of a PEFT adapter folder's merged model."""
    if not is_peft_adapter(path):
        return load_hf_config(path)
    adapter = read_peft_adapter(path)
    return merged_config(adapter, model_config(base_model_folder(adapter)))


def model_weights(path: str | Path) -> str | MergedReader:
    """What load_hf_weights reads: a model folder, or a PEFT adapter folder's base with the adapter merged."""
    if not is_peft_adapter(path):
        return str(path)
    adapter = read_peft_adapter(path)
    base = model_weights(base_model_folder(adapter))
    return MergedReader(SafetensorsReader(base) if isinstance(base, str) else base, adapter)


def model_files(path: str | Path) -> str:
    """The folder of HF files (config, tokenizer, safetensors) an engine that loads a folder itself starts
    from: the model folder, or a PEFT adapter's base (its merged weights are pushed after)."""
    return model_files(base_model_folder(read_peft_adapter(path))) if is_peft_adapter(path) else str(path)


# ---- writing ------------------------------------------------------------------------------------------------
def write_peft_adapter(out_dir: str | Path, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], *, rank: int,
                       alpha: float, base: str | None, dropout: float = 0.0, task_type: str | None = "CAUSAL_LM",
                       saved: dict[str, torch.Tensor] | None = None) -> None:
    """adapter_config.json + adapter_model.safetensors that peft's PeftModel.from_pretrained loads: `factors` maps
    an HF module to its (A [r, in], B [out, r]); `saved` holds modules_to_save tensors by HF name."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in sorted(factors.items()):
        tensors[f"{KEY_PREFIX}{module}.lora_A.weight"] = a.detach().contiguous().cpu()
        tensors[f"{KEY_PREFIX}{module}.lora_B.weight"] = b.detach().contiguous().cpu()
    for name, tensor in (saved or {}).items():
        tensors[f"{KEY_PREFIX}{name}"] = tensor.detach().contiguous().cpu()
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    projections = sorted({module.rsplit(".", 1)[-1] for module in factors})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "bias": "none",
              "target_modules": projections, "base_model_name_or_path": base, "task_type": task_type,
              "modules_to_save": sorted({n.split(".")[0] for n in saved}) if saved else None,
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "inference_mode": True}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def tokenizer_folder(path: str | Path) -> str:
    """Where a model's tokenizer files are: the folder itself, or (a PEFT adapter folder without them) its base's."""
    folder = Path(path)
    own = (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file()
    return str(folder) if own or not is_peft_adapter(folder) else tokenizer_folder(_base_folder(folder,
                                                                                                adapter_base(folder)))


def write_merged_model(adapter_folder: str | Path, out_dir: str | Path) -> None:
    """A Hugging Face model folder of a PEFT adapter merged into its base (W + scaling * B A; the saved modules,
    e.g. a score head, in place), written file by file as the base is stored, with its config and tokenizer."""
    import shutil

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader, config = model_weights(adapter_folder), model_config(adapter_folder)
    seq_cls = any(a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or [])
    files: dict[str, list[str]] = {}
    for name, file_name in reader.weight_map.items():
        if seq_cls and name == "lm_head.weight":
            continue  # the classification head replaces the LM head
        files.setdefault(file_name, []).append(name)
    if "adapter" in files:  # modules_to_save: stored with the first base file
        first = sorted(f for f in files if f != "adapter")[0]
        files[first] += files.pop("adapter")
    weight_map = {}
    for file_name, names in sorted(files.items()):
        save_file({name: reader.read(name).contiguous() for name in names}, str(out / file_name),
                  metadata={"format": "pt"})
        weight_map.update({name: file_name for name in names})
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(str(out))
    source = Path(tokenizer_folder(adapter_folder))
    for item in source.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(item, out / item.name)
