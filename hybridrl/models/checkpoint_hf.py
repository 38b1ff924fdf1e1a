"""Hugging Face safetensors <-> a sharded Megatron GPTModel.

Loading streams: each rank opens the safetensors files lazily and reads, with `get_slice`, only the
rows/columns of its own TP shard of the tensors its PP stage owns. Export gathers shards over TP
(all-gather) and PP (to global rank 0), converts to HF names and writes safetensors + config.json.
"""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any, Iterator

import torch

from hybridrl.models.builder import named_global_parameters, unwrap
from hybridrl.models.config import CheckpointError
from hybridrl.models.families import (GATE_UP, PLAIN, QKV, VOCAB, ModelDims, ModelFamily, expert_number, family_for,
                                      fuse_qkv, is_tied, tp_gather, tp_partition_dim)
from hybridrl.parallel.distributed import device

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsReader:
    """Lazy, sliceable access to a HF folder's tensors (single file or sharded with an index)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._handles: dict[str, Any] = {}
        self.weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: unreadable safetensors index ({exc}); re-save the model") from exc
            for file_name in sorted(set(weight_map.values())):
                if not (self.folder / file_name).is_file():
                    raise CheckpointError(f"{self.folder}: safetensors file {file_name} named in {INDEX_FILE} "
                                          f"is missing; copy the complete checkpoint")
            return weight_map
        if (self.folder / SINGLE_FILE).is_file():
            return {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        raise CheckpointError(f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE}; pass a folder saved with "
                              f"save_pretrained(safe_serialization=True)")

    def _open(self, file_name: str):
        if file_name not in self._handles:
            from safetensors import safe_open

            path = self.folder / file_name
            try:
                self._handles[file_name] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for a bad header
                raise CheckpointError(f"{path}: cannot open safetensors file ({exc}); it is truncated or "
                                      f"corrupt, copy it again") from exc
        return self._handles[file_name]

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        return self._open(self.weight_map[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only rows [a, b) / columns [a, b) of it."""
        tensor_slice = self._slice(name)
        try:
            if rows is not None:
                return tensor_slice[rows[0]:rows[1]]
            if cols is not None:
                return tensor_slice[:, cols[0]:cols[1]]
            return tensor_slice[:]
        except Exception as exc:
            raise CheckpointError(f"{self.folder}: reading {name!r} failed ({exc}); the file is truncated "
                                  f"or corrupt") from exc


def check_hf_checkpoint(folder: str | Path, hf_config: Any, head: str = "lm",
                        allow_missing_score: bool = False) -> None:
    """Every tensor the model needs is present with the right shape (reads headers only)."""
    reader = SafetensorsReader(folder)
    family = family_for(hf_config)
    for name, shape in family.expected_hf_tensors(hf_config, head).items():
        if name == "score.weight" and allow_missing_score and name not in reader.weight_map:
            continue
        if name not in reader.weight_map:
            raise CheckpointError(f"{folder}: tensor {name!r} is missing from the checkpoint; "
                                  f"it is truncated or not a {'/'.join(family.causal_lm_architectures)} checkpoint")
        actual = reader.shape(name)
        if actual != shape:
            raise CheckpointError(f"{folder}: tensor {name!r} has shape {list(actual)}, config.json implies "
                                  f"{list(shape)}; the weights do not match the config")
    for file_name in sorted(set(reader.weight_map.values())):
        _check_file_size(Path(folder) / file_name)


def _check_file_size(path: Path) -> None:
    """A truncated safetensors file: its header promises more bytes than the file has."""
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        try:
            header = json.loads(handle.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header; copy the file again") from exc
    data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if path.stat().st_size < 8 + header_len + data_end:
        raise CheckpointError(f"{path}: truncated ({path.stat().st_size} bytes, header needs "
                              f"{8 + header_len + data_end}); copy the file again")


def _tp_groups(model: Any) -> tuple[Any, Any]:
    """(TP group, expert-TP group) of a model: its own process groups, else Megatron's global ones. Experts are
    split over the expert-TP group, which is smaller than the TP group when expert_tp < tp."""
    from megatron.core import parallel_state

    pg = getattr(unwrap(model), "pg_collection", None)
    tp = getattr(pg, "tp", None) or parallel_state.get_tensor_model_parallel_group()
    expert_tp = getattr(pg, "expt_tp", None) if pg is not None else None
    return tp, expert_tp or parallel_state.get_expert_tensor_parallel_group()


def _rank_size(group: Any) -> tuple[int, int]:
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _read_shard(reader: SafetensorsReader, family: ModelFamily, mcore_name: str, param: torch.Tensor,
                hf_config: Any, head: str, padded_vocab_size: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's shard of one Megatron parameter, reading only the needed slices."""
    rule = family.rule(mcore_name, head, is_tied(hf_config, head))
    dim = tp_partition_dim(param) if tp_size > 1 else None
    d = ModelDims.from_hf(hf_config)
    if dim is None:  # replicated (or TP=1): the full tensor
        return family.from_hf(mcore_name, reader.read, hf_config, head, padded_vocab_size)
    if rule.kind == PLAIN:
        span = param.shape[dim]
        window = (tp_rank * span, (tp_rank + 1) * span)
        return reader.read(rule.hf_names[0], rows=window) if dim == 0 else reader.read(rule.hf_names[0], cols=window)
    if rule.kind == VOCAB:
        rows_per_rank = padded_vocab_size // tp_size
        start = tp_rank * rows_per_rank
        stop = min(start + rows_per_rank, d.vocab_size)
        part = reader.read(rule.hf_names[0], rows=(start, max(start, stop)))
        pad = part.new_zeros((rows_per_rank - part.shape[0], *param.shape[1:]))
        return torch.cat([part, pad], dim=0)
    if rule.kind == QKV:
        groups = d.num_query_groups // tp_size
        q_rows = groups * d.heads_per_group * d.head_dim
        kv_rows = groups * d.head_dim
        q = reader.read(rule.hf_names[0], rows=(tp_rank * q_rows, (tp_rank + 1) * q_rows))
        k = reader.read(rule.hf_names[1], rows=(tp_rank * kv_rows, (tp_rank + 1) * kv_rows))
        v = reader.read(rule.hf_names[2], rows=(tp_rank * kv_rows, (tp_rank + 1) * kv_rows))
        return fuse_qkv(q, k, v, num_query_groups=groups, head_dim=d.head_dim)
    if rule.kind == GATE_UP:  # this rank's gate rows then its up rows (dense, expert or shared-expert sizes)
        rows = param.shape[0] // 2
        window = (tp_rank * rows, (tp_rank + 1) * rows)
        return torch.cat([reader.read(name, rows=window) for name in rule.hf_names], dim=0)
    raise AssertionError(rule.kind)


@torch.no_grad()
def load_hf_weights(model: Any, folder: Any, hf_config: Any, *, init_missing_score: bool = False) -> None:
    """Fill this rank's Megatron shard from a HF folder, reading only this shard's slices. `folder` may also be
    a reader with SafetensorsReader's read / shape / weight_map (models/peft.py: a base with an adapter merged).

    init_missing_score: a scalar-head model built from a causal-LM checkpoint (critic) keeps its
    freshly initialised value head instead of failing on the missing `score.weight`.
    """
    inner = unwrap(model)
    family, head = inner.hybridrl_family, inner.hybridrl_head
    padded = inner.hybridrl_args.padded_vocab_size
    reader = SafetensorsReader(folder) if isinstance(folder, (str, Path)) else folder
    tp_group, expert_tp_group = _tp_groups(inner)
    tp_rank, tp_size = _rank_size(tp_group)
    expert_tp = _rank_size(expert_tp_group)
    for name, param in named_global_parameters(inner):
        if head == "scalar" and name == "output_layer.weight" and "score.weight" not in reader.weight_map:
            if init_missing_score:
                logger.info("%s has no score.weight: the value head keeps its initialisation", folder)
                continue
            raise CheckpointError(f"{folder}: tensor 'score.weight' is missing (not a *ForSequenceClassification "
                                  f"checkpoint); pass init_missing_score=True to start a fresh value head")
        rank, size = expert_tp if expert_number(name) is not None else (tp_rank, tp_size)
        shard = _read_shard(reader, family, name, param, hf_config, head, padded, rank, size)
        if tuple(shard.shape) != tuple(param.shape):
            raise CheckpointError(f"{folder}: {name} shard has shape {list(shard.shape)}, the model expects "
                                  f"{list(param.shape)}; the weights do not match the config")
        param.copy_(shard.to(param.dtype))
    logger.debug("loaded HF weights from %s (tp rank %d/%d)", folder, tp_rank, tp_size)


# ---- export -------------------------------------------------------------------------------------
def _gather_tp(name: str, param: torch.Tensor, tp_group: Any) -> torch.Tensor:
    dim = tp_partition_dim(param)
    size = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    if dim is None or size == 1:
        return param.detach()
    shards = [torch.empty_like(param) for _ in range(size)]
    torch.distributed.all_gather(shards, param.detach().contiguous(), group=tp_group)
    return tp_gather(name, shards, dim)


def iter_full_hf_tensors(model: Any, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's parameters as FULL tensors with HF names (collective over the TP group; experts over the
    expert-TP group).

    A tied output layer is skipped (HF ties lm_head to embed_tokens).
    """
    inner = unwrap(model)
    groups = _tp_groups(inner)
    tied = inner.share_embeddings_and_output_weights
    for name, param in named_global_parameters(inner):
        if tied and name == "output_layer.weight":
            continue
        full = _gather_tp(name, param, groups[expert_number(name) is not None])
        yield from inner.hybridrl_family.to_hf(name, full, hf_config, inner.hybridrl_head)


@torch.no_grad()
def gather_hf_state_dict(model: Any, hf_config: Any) -> dict[str, torch.Tensor] | None:
    """The whole HF state dict on global rank 0's host memory (None elsewhere); collective over all ranks.

    Each tensor comes from one place: the dense ones from data-parallel replica 0, each expert from the
    expert-parallel rank holding it in expert-data-parallel replica 0; TP shards (experts: expert-TP shards) are
    gathered first. Rank 0 then receives the other holders' tensors one at a time on the collective device (NCCL
    on GPUs) and moves each to host memory before the next: its device holds one tensor, not world x a rank's part
    (a gather_object of whole state dicts stages every rank's pickled part on rank 0's device at once).
    """
    from megatron.core import parallel_state as ps

    inner = unwrap(model)
    groups = _tp_groups(inner)
    wanted = {False: ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0,
              True: ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0}
    gathers = {False: ps.get_data_parallel_rank() == 0, True: ps.get_expert_data_parallel_rank() == 0}
    tied = inner.share_embeddings_and_output_weights
    local: dict[str, torch.Tensor] = {}
    for name, param in named_global_parameters(inner):
        is_expert = expert_number(name) is not None
        if not gathers[is_expert] or (tied and name == "output_layer.weight"):
            continue
        full = _gather_tp(name, param, groups[is_expert])  # the same names on every rank of that group
        if wanted[is_expert]:
            for hf_name, tensor in inner.hybridrl_family.to_hf(name, full, hf_config, inner.hybridrl_head):
                local[hf_name] = tensor.cpu().clone()
    return _collect_on_root(local)


def _collect_on_root(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every rank's named host tensors on rank 0: the names, shapes and dtypes by gather_object (small), then the
    tensors point to point on the collective device, one at a time."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    manifest = [(name, tuple(t.shape), t.dtype) for name, t in local.items()]
    manifests = [None] * world if rank == 0 else None
    torch.distributed.gather_object(manifest, manifests, dst=0)
    where = device()
    if rank != 0:
        for tensor in local.values():
            staged = tensor.to(where)
            torch.distributed.send(staged, dst=0)
            if where.type == "cuda":  # the send completes before the next tensor is staged: one on the device
                torch.cuda.current_stream().synchronize()
        return None
    state = dict(local)
    for source in range(1, world):
        for name, shape, dtype in manifests[source]:
            buffer = torch.empty(shape, dtype=dtype, device=where)
            torch.distributed.recv(buffer, src=source)
            state[name] = buffer.cpu()
    return state


def export_hf_config(hf_config: Any, out_dir: Path, dtype: torch.dtype | None = None) -> None:
    """config.json, recording the dtype the weights were written in."""
    config = copy.deepcopy(hf_config)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(str(out_dir))


@torch.no_grad()
def export_hf_checkpoint(model: Any, hf_config: Any, out_dir: str | Path,
                         max_shard_bytes: int = 5 << 30) -> None:
    """Write model.safetensors (sharded with an index above max_shard_bytes) + config.json on rank 0."""
    state = gather_hf_state_dict(model, hf_config)
    if state is None:
        torch.distributed.barrier()
        return
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    family_for(hf_config)  # refuse before writing anything
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        tensor = state[name].contiguous()
        if files[-1] and size + tensor.nbytes > max_shard_bytes:
            files.append({})
            size = 0
        files[-1][name] = tensor
        size += tensor.nbytes
    if len(files) == 1:
        save_file(files[0], str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, part in enumerate(files):
            file_name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            save_file(part, str(out_dir / file_name), metadata={"format": "pt"})
            weight_map.update({name: file_name for name in part})
        total = sum(t.nbytes for t in state.values())
        (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2))
    export_hf_config(hf_config, out_dir, next(iter(state.values())).dtype if state else None)
    logger.info("wrote HF checkpoint (%d tensors) to %s", len(state), out_dir)
    torch.distributed.barrier()
