"""What every role object shares: a WorkerGroup of one worker class on a ResourcePool, with Ray started on
demand, a layout checked like the trainer's plan checks it, and metrics averaged over data-parallel ranks."""
from __future__ import annotations

from typing import Any

from hybridrl.config import LoraConfig, ParallelConfig, as_section
from hybridrl.controller import ResourcePool, WorkerGroup, ensure_ray
from hybridrl.models.lora_io import resolve_lora_config
from hybridrl.parallel.layout import ParallelLayout, role_layout

# Micro-batches pack sequences up to this many tokens (None: micro_batch_size sequences, one per row).
DEFAULT_MAX_TOKENS_PER_MICRO_BATCH = 8192


class Role:
    """A WorkerGroup of one worker class on a pool; `layout` is the role's (tp, pp, dp)."""

    def __init__(self, worker_cls: type, role: str, resource_pool: ResourcePool | None,
                 parallel: ParallelLayout | ParallelConfig | dict | None, init_kwargs: dict, seed: int,
                 call_timeout_s: float | None) -> None:
        self.pool = start_pool(resource_pool)
        self.layout = layout_on(self.pool, parallel, role)
        self.group = WorkerGroup(self.pool, worker_cls, layout=self.layout, role=role, init_kwargs=init_kwargs,
                                 seed=seed, call_timeout_s=call_timeout_s)

    def close(self) -> None:
        self.group.close()


def start_pool(pool: ResourcePool | None, ray_address: str | None = None) -> ResourcePool:
    """The role's pool (ResourcePool.default(), shared by every role created without one), with Ray running: a
    local cluster with enough devices for it when none runs yet."""
    import ray  # ray's import costs seconds: only when a role starts

    pool = pool or ResourcePool.default()
    ensure_ray(num_devices=None if ray.is_initialized() else pool.world_size, address=ray_address)
    return pool


def parallel_argument(parallel: Any, parallel_config: Any, where: str) -> ParallelConfig | ParallelLayout | None:
    """The role's parallel settings from either keyword, `parallel=` or `parallel_config=` (the seed program's
    name for the same dict / ParallelConfig; both given is an error), a dict checked and typed here, before Ray
    or any worker starts."""
    if parallel is not None and parallel_config is not None:
        raise ValueError(f"{where}: give parallel= or parallel_config= (the same settings), not both")
    name, value = ("parallel_config", parallel_config) if parallel is None else ("parallel", parallel)
    if value is None or isinstance(value, ParallelLayout):
        return value
    return as_section(ParallelConfig, value, f"{where}({name}=...)")


def layout_on(pool: ResourcePool, parallel: ParallelLayout | ParallelConfig | dict | None, role: str
              ) -> ParallelLayout:
    """The role's layout: a ParallelLayout as given (the trainer's plan checked it); explicit tp/pp (dp fills
    the pool), checked as the plan checks them; none: the layout the pool's processes already hold."""
    if isinstance(parallel, ParallelLayout):
        return parallel
    held = pool.layout
    if parallel is None:
        return held or ParallelLayout(dp=pool.world_size)
    settings = as_section(ParallelConfig, parallel, f"{role}(parallel=...)")
    return role_layout(settings, pool.world_size, role, pool.name, None if held is None else ("the pool", held))


def average_metrics(results: list[dict]) -> dict[str, float]:
    """Per-DP-rank metric dicts -> one dict: per-token metrics weighted by each rank's token count, so they
    read the same at any DP size (rank-identical values such as grad_norm are unchanged)."""
    results = [dict(r) for r in results if r]
    if not results:
        return {}
    weights = [float(r.pop("tokens", 1.0)) for r in results]
    if not any(weights):  # no rank had a token (every sample dropped): the ranks weigh the same
        weights = [1.0] * len(results)
    total = sum(weights)
    return {k: sum(w * r[k] for w, r in zip(weights, results)) / total for k in results[0]}


def checked_lora(lora: dict | LoraConfig | None, where: str) -> LoraConfig:
    """A role's LoRA settings from the short API (None: off), resolved and checked as the trainer's plan does
    (models/lora_io.py resolve_lora_config): a ValueError names the key."""
    settings = as_section(LoraConfig, lora, where)
    if not settings.enabled:
        return settings
    try:
        return resolve_lora_config(settings)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
