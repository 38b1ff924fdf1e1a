"""Model references: what a user may write wherever a model is named, resolved to a local folder on the driver.

A reference is one of
    None / "tiny:<name>"        a bundled tiny model (models/tiny.py), created on first use
    a local folder               a Hugging Face folder (config.json) or a PEFT adapter (adapter_config.json)
    "org/name" or "org/name@rev" a Hugging Face hub id, optionally at a branch, tag or commit

A hub id is resolved through huggingface_hub into its cache (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub): downloaded when the hub is reachable, read from the cache when it is not or with
HF_HUB_OFFLINE=1. Everything downstream (the plan, the workers, the converters) sees the local folder only, so a
worker never touches the network. An id that is neither cached nor reachable is a ModelReferenceError naming the
id and the cache searched.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from hybridrl.models.tiny import TINY_PREFIX, resolve_model_path

logger = logging.getLogger(__name__)

# org/name[@revision]: the hub's own name rules (letters, digits, - _ .), a revision may hold slashes (branches)
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
MODEL_FILES = ("config.json", "adapter_config.json")  # a model folder holds one of them
# what a model needs from its repo: config, tokenizer, chat template, adapter config, and one weight format
_SMALL_FILES = ("*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja")


class ModelReferenceError(ValueError):
    """A model reference that names no folder and no model the hub or its cache has."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process reads and writes, from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set to a true value: the cache only, no request to the hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def parse_hub_id(ref: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `ref` is written as a hub id, else None."""
    match = _HUB_ID.match(str(ref))
    return (match["repo"], match["revision"]) if match else None


def is_hub_reference(ref: str | None) -> bool:
    """True when `ref` would be resolved through the hub (a hub id that is not a local folder)."""
    return ref is not None and not Path(str(ref)).expanduser().exists() and parse_hub_id(str(ref)) is not None


def resolve_model(ref: str | Path | None, where: str = "model", cache_only: bool = False) -> str:
    """The local folder of a model reference (module docstring); `where` names the option in errors. The folder
    holds config.json or, for a PEFT adapter, adapter_config.json. cache_only: no download, as HF_HUB_OFFLINE=1."""
    folder = resolve_reference(ref, where, cache_only)
    if not any((Path(folder) / name).is_file() for name in MODEL_FILES):
        raise ModelReferenceError(f"{where}={str(ref)!r}: no config.json in {folder} (a Hugging Face model folder "
                                  f"has one; a PEFT adapter has adapter_config.json)")
    return folder


def resolve_reference(ref: str | Path | None, where: str = "model", cache_only: bool = False) -> str:
    """The local folder of a reference, whatever it holds (a tokenizer folder or repo, too)."""
    if ref is None or str(ref).startswith(TINY_PREFIX):
        try:
            return resolve_model_path(None if ref is None else str(ref))
        except ValueError as exc:
            raise ModelReferenceError(f"{where}={ref!r}: {exc}") from None
    folder = Path(str(ref)).expanduser()
    if folder.is_dir():
        return str(folder)
    parsed = parse_hub_id(str(ref))
    if folder.exists() or parsed is None:
        raise ModelReferenceError(f"{where}={str(ref)!r}: no Hugging Face model folder there, and not a hub id "
                                  f"(org/name[@revision]); give a local folder, a hub id or a tiny:<name>")
    return _snapshot(*parsed, where=where, offline=cache_only or hub_offline())


def adapter_base(folder: str | Path) -> str | None:
    """The base model reference a PEFT adapter folder names (adapter_config.json base_model_name_or_path)."""
    config = Path(folder) / "adapter_config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("base_model_name_or_path") or None
    except (OSError, ValueError):
        return None


def snapshot_revision(folder: str | Path) -> str | None:
    """The commit a resolved hub snapshot folder holds (its folder name under snapshots/), else None."""
    path = Path(folder)
    return path.name if path.parent.name == "snapshots" and _COMMIT.match(path.name) else None


def pinned_reference(ref: str) -> str:
    """A hub id pinned to the commit it resolves to now (`org/name@<sha>`), so a later resolution (another node,
    a requeued job) reads the same files; other references unchanged."""
    parsed = parse_hub_id(ref) if is_hub_reference(ref) else None
    if parsed is None:
        return ref
    commit = snapshot_revision(resolve_reference(ref))
    return f"{parsed[0]}@{commit}" if commit else ref


def _snapshot(repo_id: str, revision: str | None, where: str, offline: bool) -> str:
    """The cached snapshot of repo_id at revision, downloaded first when the hub is reachable."""
    # huggingface_hub: only when a hub id is named (its import pulls an HTTP stack)
    import huggingface_hub
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    cache = hub_cache_dir()
    name = repo_id + (f"@{revision}" if revision else "")
    try:
        if offline:
            return huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=str(cache),
                                                     local_files_only=True)
        return huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=str(cache),
                                                 allow_patterns=_download_patterns(repo_id, revision))
    except LocalEntryNotFoundError:
        why = "no download (HF_HUB_OFFLINE=1 or a dry run)" if offline else "the hub is not reachable"
        raise ModelReferenceError(
            f"{where}={name!r}: no local folder of that name, not in the Hugging Face cache {cache}, and {why}; "
            f"download it where the hub is "
            f"reachable (`hf download {repo_id}{f' --revision {revision}' if revision else ''}` with HF_HUB_CACHE="
            f"{cache}) or set HF_HUB_CACHE / HF_HOME to a cache that holds it") from None
    except GatedRepoError:
        raise ModelReferenceError(f"{where}={name!r}: a gated model; accept its license on huggingface.co and set "
                                  f"HF_TOKEN (or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ModelReferenceError(f"{where}={name!r}: the hub has no revision {revision!r} of {repo_id}") from None
    except RepositoryNotFoundError:
        raise ModelReferenceError(f"{where}={name!r}: no local folder of that name and no such model on the hub (a "
                                  f"private one needs HF_TOKEN); check the path or id") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelReferenceError(f"{where}={name!r}: download into {cache} failed: "
                                  f"{' '.join(str(exc).split())}") from None


def _download_patterns(repo_id: str, revision: str | None) -> list[str] | None:
    """The files a model needs: configs, tokenizer, and one weight format (safetensors when the repo has them,
    else PyTorch .bin); None (everything) when the listing fails, so the download reports the real error."""
    import huggingface_hub  # see _snapshot

    try:
        files = huggingface_hub.list_repo_files(repo_id, revision=revision)
    except Exception:  # noqa: BLE001 - any failure (network, auth): snapshot_download raises the one to report
        return None
    weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["*.bin"]
    return [*_SMALL_FILES, *weights]
