"""@register and the dispatch modes: how a group call's arguments go out and its results come back.

The data movement is declared next to the method (verl's idea); the driver then reads like
serial code. Rank arithmetic comes from ParallelLayout only (coords, collect_ranks).

A dispatch mode is one registered planner, `@register_dispatch_mode(name)` on a function
(spec, layout, method, args, kwargs) -> CallPlan; the four built-in modes below are registered the same
way, and a user's mode is then usable by name: `@register("my_mode")`, `group.call(..., dispatch="my_mode")`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hybridrl.parallel.layout import ParallelLayout
from hybridrl.protocol import Batch
from hybridrl.registry import Registry

REGISTER_ATTR = "__hybridrl_register__"


class Dispatch(str, Enum):
    """Names of the built-in modes (a str: Dispatch.RANK_ZERO == "rank_zero"); any registered name works too."""

    ONE_TO_ALL = "one_to_all"  # same arguments to every rank; list of every rank's result
    ALL_TO_ALL = "all_to_all"  # argument i (a list of world_size items) goes to rank i; list of results
    RANK_ZERO = "rank_zero"    # only rank 0 runs; its result
    DP_COMPUTE = "dp_compute"  # Batch args split over DP ranks; results of TP0 / last PP stage, in order


def dispatch_name(dispatch: Dispatch | str) -> str:
    """The plain mode name of a Dispatch member or a str (what MethodSpec holds: pickles without the registry)."""
    if isinstance(dispatch, Enum):
        dispatch = dispatch.value
    if not isinstance(dispatch, str):
        raise ValueError(f"dispatch={dispatch!r} must be a mode name (str) or a Dispatch member")
    return str(dispatch)


@dataclass(frozen=True)
class MethodSpec:
    dispatch: str = Dispatch.ONE_TO_ALL.value  # a registered dispatch mode's name
    blocking: bool = True            # False: the call returns a GroupFuture
    timeout_s: float | None = None   # None: the group's call_timeout_s
    pad: bool = True                 # DP_COMPUTE, uneven batch: pad to a multiple of dp (else uneven chunks)

    def __post_init__(self) -> None:
        # a plain str, not the Enum: a Ray worker unpickling the class needs neither Dispatch nor the registry
        object.__setattr__(self, "dispatch", dispatch_name(self.dispatch))


def register(dispatch: Dispatch | str = Dispatch.ONE_TO_ALL, blocking: bool = True,
             timeout_s: float | None = None, pad: bool = True) -> Callable:
    """Mark a Worker method as a group call with the given dispatch mode (a Dispatch member or the name of a
    mode registered by @register_dispatch_mode before this line runs)."""
    spec = MethodSpec(dispatch, blocking, timeout_s, pad)
    get_dispatch_mode(spec.dispatch)  # refuse a typo where it is written, not at the first call

    def decorate(fn: Callable) -> Callable:
        setattr(fn, REGISTER_ATTR, spec)
        return fn

    return decorate


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    out = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), REGISTER_ATTR, None)
        if isinstance(spec, MethodSpec):
            out[name] = spec
    return out


@dataclass
class CallPlan:
    """Per-rank arguments of one group call and how to turn the per-rank results into one value."""

    rank_args: dict[int, tuple[tuple, dict]]  # only ranks that run
    collect: Callable[[dict[int, Any]], Any]   # results of the ranks in rank_args -> the call's value
    keep_ranks: frozenset[int] | None = None   # ranks whose return value is needed (None: all); the others
                                               # send back only success or failure, not their data


Planner = Callable[[MethodSpec, ParallelLayout, str, tuple, dict], CallPlan]
DISPATCH_MODES = Registry("dispatch mode", "@register_dispatch_mode, in a module imported before its use")


def register_dispatch_mode(name: Dispatch | str) -> Callable[[Planner], Planner]:
    """Decorator: register the decorated planner (spec, layout, method, args, kwargs) -> CallPlan as dispatch
    mode `name`. It runs on the driver only (plan_call). A name registered twice by different code is refused."""
    name = dispatch_name(name)

    def decorate(planner: Planner) -> Planner:
        DISPATCH_MODES.add(name, planner, planner)
        return planner

    return decorate


def get_dispatch_mode(name: Dispatch | str) -> Planner:
    return DISPATCH_MODES.lookup(dispatch_name(name))


def plan_call(spec: MethodSpec, layout: ParallelLayout, method: str, args: tuple, kwargs: dict) -> CallPlan:
    """The per-rank arguments and the collection of one group call, by the registered planner of spec.dispatch."""
    plan = get_dispatch_mode(spec.dispatch)(spec, layout, method, args, kwargs)
    # a user's planner is checked here, on the driver, before anything is sent to a rank
    if not isinstance(plan, CallPlan):
        raise ValueError(f"{method}: dispatch mode {spec.dispatch!r} returned {type(plan).__name__}, not a CallPlan")
    bad = sorted(r for r in plan.rank_args if not (isinstance(r, int) and 0 <= r < layout.world_size))
    if bad or not plan.rank_args:
        raise ValueError(f"{method}: dispatch mode {spec.dispatch!r} planned ranks {bad or 'none'}; plan at "
                         f"least one rank in 0..{layout.world_size - 1}")
    return plan


@register_dispatch_mode(Dispatch.ONE_TO_ALL)
def _plan_one_to_all(spec: MethodSpec, layout: ParallelLayout, method: str, args: tuple, kwargs: dict) -> CallPlan:
    world = layout.world_size
    return CallPlan({r: (args, kwargs) for r in range(world)}, lambda res: [res[r] for r in range(world)])


@register_dispatch_mode(Dispatch.RANK_ZERO)
def _plan_rank_zero(spec: MethodSpec, layout: ParallelLayout, method: str, args: tuple, kwargs: dict) -> CallPlan:
    return CallPlan({0: (args, kwargs)}, lambda res: res[0])


@register_dispatch_mode(Dispatch.ALL_TO_ALL)
def _plan_all_to_all(spec: MethodSpec, layout: ParallelLayout, method: str, args: tuple, kwargs: dict) -> CallPlan:
    world = layout.world_size
    for i, value in [*enumerate(args), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != world:
            raise ValueError(f"{method}: ALL_TO_ALL argument {i!r} must be a list of {world} items "
                             f"(one per rank), got {type(value).__name__}"
                             + (f" of {len(value)}" if isinstance(value, (list, tuple)) else ""))
    rank_args = {r: (tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world)}
    return CallPlan(rank_args, lambda res: [res[r] for r in range(world)])


@register_dispatch_mode(Dispatch.DP_COMPUTE)
def _plan_dp_compute(spec: MethodSpec, layout: ParallelLayout, method: str, args: tuple, kwargs: dict) -> CallPlan:
    batches = [v for v in [*args, *kwargs.values()] if isinstance(v, Batch)]
    if not batches:
        raise ValueError(f"{method}: DP_COMPUTE needs at least one Batch argument to split over dp={layout.dp}")
    rows = {len(b) for b in batches}
    if len(rows) != 1:
        raise ValueError(f"{method}: DP_COMPUTE Batch arguments have different row counts {sorted(rows)}")
    pad = 0

    def shards(batch: Batch) -> list[Batch]:
        nonlocal pad
        if spec.pad:
            batch, pad = batch.pad_to_multiple(layout.dp)
        return batch.chunk(layout.dp)

    split = {id(b): shards(b) for b in batches}
    padded_rows = rows.pop() + pad
    per_dp = []
    for d in range(layout.dp):
        shard_args = tuple(split[id(a)][d] if isinstance(a, Batch) else a for a in args)
        shard_kwargs = {k: split[id(v)][d] if isinstance(v, Batch) else v for k, v in kwargs.items()}
        per_dp.append((shard_args, shard_kwargs))
    # every TP/PP rank of a DP replica gets that replica's shard (the same objects)
    rank_args = {r: per_dp[layout.coords(r).dp] for r in range(layout.world_size)}
    collect_ranks = layout.collect_ranks()

    def collect(results: dict[int, Any]) -> Any:
        outputs = [results[r] for r in collect_ranks]
        if all(isinstance(o, Batch) for o in outputs):
            merged = Batch.concat(outputs)
            if pad:
                if len(merged) % padded_rows:
                    raise ValueError(f"{method}: returned {len(merged)} rows for {padded_rows} padded input rows; "
                                     "cannot drop the padding (return a whole number of rows per input row "
                                     "or register with pad=False)")
                merged = merged.unpad(pad * (len(merged) // padded_rows))
            return merged
        return outputs

    return CallPlan(rank_args, collect, frozenset(collect_ranks))
