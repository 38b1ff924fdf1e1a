"""The model files a Slurm job reads, checked by `hybridrl submit` on the submitting machine before anything is
queued (launch/submit.py calls `prepare_model_files`).

The job's driver resolves every model reference to a local folder and hands that path to workers on every
node, so each node must see the same files at the same path. Two ways work:
- shared (default): the folders (the Hugging Face cache for hub ids) live on a filesystem every node mounts
  (NFS, Lustre, GPFS, ...). Checked here: a folder on a filesystem only this machine has (ext4, xfs, tmpfs,
  overlay, ...) is refused, naming the option and the filesystem.
- staged: every node holds the same files at the same path (a node-local cache filled on each node, e.g.
  `hf download org/name --revision <sha>` per node). Not checkable from here; `python -m
  hybridrl.launch.cluster_check --models FOLDER ...` checks it on every node of a running job.
Either way hub ids are resolved here (downloaded when the hub is reachable: compute nodes often have no
internet) and pinned to the commit they resolved to (`org/name@<sha>`), and the job runs with HF_HUB_OFFLINE=1
and this machine's HF_HUB_CACHE, so every node, and a requeued job hours later, reads the same revision.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.config import LORA_INITS

logger = logging.getLogger(__name__)

# config options that name a model (or a tokenizer, resolved the same way)
MODEL_OPTIONS = ("actor.model.path", "ref.model.path", "critic.model.path", "reward_model.model", "cost_model.model",
                 "algorithm.distill.teacher")
TOKENIZER_OPTIONS = ("reward_model.tokenizer", "cost_model.tokenizer")
# starting adapters: a PEFT adapter folder or hub id (else kaiming / gaussian); their base is the role's model
LORA_INIT_OPTIONS = ("actor.lora.init", "critic.lora.init")
# filesystems that live on one machine: another node never sees their files
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "ramfs", "overlay",
                               "vfat", "exfat", "squashfs"})
MODEL_FILES_MODES = ("shared", "staged")


class ModelFilesError(ValueError):
    """A model the job names that its nodes cannot read."""


@dataclass
class ModelFiles:
    folders: dict[str, str] = field(default_factory=dict)  # option -> the local folder it resolved to
    overrides: list[str] = field(default_factory=list)  # hub ids pinned to their commit, as key=value overrides
    env: dict[str, str] = field(default_factory=dict)  # the job's HF_HUB_CACHE / HF_HUB_OFFLINE
    notes: list[str] = field(default_factory=list)  # what a dry run left unresolved


def mount_of(path: str | Path, mounts_file: str = "/proc/mounts") -> tuple[str, str]:
    """(mount point, filesystem type) of the filesystem holding `path` (the longest mount point above it)."""
    target = os.path.realpath(path)
    best = ("/", "unknown")
    try:
        lines = Path(mounts_file).read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ").replace("\\011", "\t")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, parts[2])
    return best


def node_local_filesystem(path: str | Path, mounts_file: str = "/proc/mounts") -> str | None:
    """'<type> at <mount point>' when `path` is on a filesystem of this machine only, else None (shared or
    unknown)."""
    point, fs_type = mount_of(path, mounts_file)
    return f"{fs_type} at {point}" if fs_type in LOCAL_FILESYSTEMS else None


def prepare_model_files(cfg: Any, mode: str = "shared", download: bool = True) -> ModelFiles:
    """Resolve every model of `cfg` here (download=False: from the cache only, as a dry run does), pin hub ids to
    their commits and, in shared mode, refuse folders on a node-local filesystem. ModelFilesError names the
    option."""
    # start-up time: hybridrl.models imports torch; `hybridrl submit --help` and --command jobs do without
    from hybridrl.models.hub import (adapter_base, hub_cache_dir, is_hub_reference, parse_hub_id, resolve_model,
                                     resolve_reference, snapshot_revision)
    from hybridrl.models.tiny import TINY_PREFIX

    if mode not in MODEL_FILES_MODES:
        raise ModelFilesError(f"--model-files {mode!r}: choose one of {list(MODEL_FILES_MODES)}")
    files = ModelFiles()
    wanted = [(o, _select(cfg, o), resolve_model) for o in MODEL_OPTIONS] + \
        [(o, _select(cfg, o), resolve_reference) for o in TOKENIZER_OPTIONS] + \
        [(o, _select(cfg, o), resolve_model) for o in LORA_INIT_OPTIONS if _select(cfg, o) not in LORA_INITS]
    for option, ref, resolve in wanted:
        if ref is None and option != "actor.model.path":  # unset: the actor's model, or no such model
            continue
        folder = _resolve_or_note(files, resolve, ref, option, download)
        if folder is None:
            continue
        files.folders[option] = folder
        commit = snapshot_revision(folder) if is_hub_reference(ref) else None
        if commit:
            files.overrides.append(f"{option}={parse_hub_id(ref)[0]}@{commit}")
        base = adapter_base(folder) if option not in LORA_INIT_OPTIONS else None
        if base is not None:  # a PEFT adapter: the job reads its base model too
            base_folder = _resolve_or_note(files, resolve_model, base, f"{option} (adapter base)", download)
            if base_folder is not None:
                files.folders[f"{option} (adapter base)"] = base_folder
    if files.notes or any(snapshot_revision(folder) for folder in files.folders.values()):
        files.env = {"HF_HUB_CACHE": str(hub_cache_dir()), "HF_HUB_OFFLINE": "1"}
    if mode == "shared":
        tiny = {o for o, ref, _ in wanted if o in files.folders and (ref is None or str(ref).startswith(TINY_PREFIX))}
        _check_shared({o: f for o, f in files.folders.items() if o not in tiny})
        files.notes += [f"{o}: the bundled tiny model is created on first use under {files.folders[o]}, on "
                        f"{node_local_filesystem(files.folders[o])}; nodes that do not share it need HYBRIDRL_CACHE "
                        f"on a shared filesystem" for o in sorted(tiny) if node_local_filesystem(files.folders[o])]
    return files


def _resolve_or_note(files: ModelFiles, resolve, ref: Any, option: str, download: bool) -> str | None:
    """The folder of `ref`; without download a hub id missing from the cache is a note (None), not an error."""
    # start-up time: see prepare_model_files
    from hybridrl.models.hub import ModelReferenceError, hub_cache_dir, is_hub_reference

    cache_only = not download and is_hub_reference(ref)
    try:
        return resolve(ref, option, cache_only)
    except ModelReferenceError as exc:
        if not cache_only:
            raise ModelFilesError(str(exc)) from None
        files.notes.append(f"{option}={ref}: not in the Hugging Face cache {hub_cache_dir()} yet; submitting "
                           f"(without --dry-run) downloads it")
        return None


def _check_shared(folders: dict[str, str]) -> None:
    for option, folder in folders.items():
        local = node_local_filesystem(folder)
        if local:
            raise ModelFilesError(
                f"{option}: its files ({folder}) are on {local}, a filesystem of this machine only, so the job's "
                f"nodes will not see them; put them (HF_HUB_CACHE / HF_HOME for hub ids) on a filesystem every "
                f"node mounts, or stage the same files on every node and pass --model-files staged")


def _select(cfg: Any, option: str) -> Any:
    node = cfg
    for key in option.split("."):
        node = node[key]
    return node
