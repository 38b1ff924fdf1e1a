"""An offline Hugging Face hub cache for tests: model folders placed under hub ids the way huggingface_hub lays
out its cache (HF_HUB_CACHE/models--ORG--NAME/{refs/main, snapshots/<commit>/...}), read with HF_HUB_OFFLINE=1.
There is no network to the hub here; this is how a test serves `org/name` ids (FACTS.md, checked 2026-12-05)."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def commit_of(repo_id: str, salt: str = "") -> str:
    """A deterministic 40-hex commit id for a test repo."""
    return hashlib.sha1(f"{repo_id}{salt}".encode()).hexdigest()


def put_in_hub_cache(cache: Path, repo_id: str, source: Path, commit: str | None = None, main: bool = True) -> Path:
    """Copy the folder `source` into `cache` as `repo_id` at `commit` (refs/main points at it when main);
    returns the snapshot folder."""
    commit = commit or commit_of(repo_id)
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    if main:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snapshot


def offline_hub(monkeypatch, cache: Path) -> None:
    """Point this process (and the Ray workers it starts) at `cache`, offline."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
