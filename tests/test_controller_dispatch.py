"""Dispatch planning without Ray: which rank gets which arguments, and how results are collected."""
import pickle

import pytest
import torch

from hybridrl.controller.dispatch import (CallPlan, Dispatch, MethodSpec, plan_call, register,
                                         register_dispatch_mode, registered_methods)
from hybridrl.controller.resource_pool import ResourcePool, ResourcePoolError
from hybridrl.controller.worker import Worker
from hybridrl.parallel.layout import ParallelLayout
from hybridrl.protocol import Batch

LAYOUTS = [ParallelLayout(tp=2, pp=1, dp=2), ParallelLayout(tp=1, pp=2, dp=2), ParallelLayout(tp=2, pp=2, dp=1),
           ParallelLayout(tp=1, pp=1, dp=4), ParallelLayout(tp=1, pp=1, dp=3)]


def batch(n: int) -> Batch:
    return Batch({"x": torch.arange(n)}, {"text": [f"p{i}" for i in range(n)]})


def fake_worker_output(layout: ParallelLayout, rank: int, shard: Batch, per_row: int = 1) -> Batch:
    """What a rank would return: its shard (times per_row), tagged with its coordinates."""
    out = shard.repeat_interleave(per_row)
    out["rank"] = torch.full((len(out),), rank)
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
@pytest.mark.parametrize("n", [1, 3, 5, 8])
@pytest.mark.parametrize("pad", [True, False])
def test_dp_compute_split_and_collect(layout: ParallelLayout, n: int, pad: bool):
    spec = MethodSpec(Dispatch.DP_COMPUTE, pad=pad)
    plan = plan_call(spec, layout, "score", (batch(n), 0.5), {"extra": batch(n)})
    assert sorted(plan.rank_args) == list(range(layout.world_size))
    assert plan.keep_ranks == set(layout.collect_ranks())  # only collected ranks send data back
    shards = {}
    for rank, (args, kwargs) in plan.rank_args.items():
        dp = layout.coords(rank).dp
        assert args[1] == 0.5 and kwargs["extra"].equals(args[0])
        shards.setdefault(dp, args[0])
        assert args[0] is shards[dp]  # every TP/PP rank of a replica gets the same shard object
    sizes = [len(shards[d]) for d in range(layout.dp)]
    assert max(sizes) - min(sizes) <= (0 if pad else 1)
    for per_row in (1, 2):
        results = {r: fake_worker_output(layout, r, plan.rank_args[r][0][0], per_row) for r in plan.rank_args}
        out = plan.collect(results)
        assert out["x"].tolist() == [i for i in range(n) for _ in range(per_row)]
        assert out["text"].tolist() == [f"p{i}" for i in range(n) for _ in range(per_row)]
        # rows come from TP rank 0 of the last PP stage of their DP replica
        assert all(layout.is_collect_rank(int(r)) for r in out["rank"])
    assert plan.collect({r: len(plan.rank_args[r][0][0]) if r in plan.keep_ranks else None
                         for r in plan.rank_args}) == sizes


def test_dp_compute_rejects_bad_input():
    layout = ParallelLayout(dp=2)
    with pytest.raises(ValueError, match="needs at least one Batch"):
        plan_call(MethodSpec(Dispatch.DP_COMPUTE), layout, "f", (1,), {})
    with pytest.raises(ValueError, match="different row counts"):
        plan_call(MethodSpec(Dispatch.DP_COMPUTE), layout, "f", (batch(2), batch(3)), {})
    plan = plan_call(MethodSpec(Dispatch.DP_COMPUTE), layout, "f", (batch(3),), {})
    with pytest.raises(ValueError, match="cannot drop the padding"):
        plan.collect({0: batch(3), 1: batch(2)})


def test_other_modes():
    layout = ParallelLayout(tp=2, dp=2)
    plan = plan_call(MethodSpec(Dispatch.ONE_TO_ALL), layout, "f", (7,), {"k": 1})
    assert all(v == ((7,), {"k": 1}) for v in plan.rank_args.values()) and len(plan.rank_args) == 4
    assert plan.collect({r: r * 10 for r in range(4)}) == [0, 10, 20, 30]
    plan = plan_call(MethodSpec(Dispatch.ALL_TO_ALL), layout, "f", ([0, 1, 2, 3],), {"k": list("abcd")})
    assert [plan.rank_args[r] for r in range(4)] == [((r,), {"k": "abcd"[r]}) for r in range(4)]
    with pytest.raises(ValueError, match="list of 4 items"):
        plan_call(MethodSpec(Dispatch.ALL_TO_ALL), layout, "f", ([0, 1],), {})
    plan = plan_call(MethodSpec(Dispatch.RANK_ZERO), layout, "f", (5,), {})
    assert list(plan.rank_args) == [0] and plan.collect({0: "r0"}) == "r0"


def test_register_marks_methods():
    class W(Worker):
        @register(Dispatch.DP_COMPUTE, blocking=False, timeout_s=3.0)
        def score(self, b):
            return b

        @register("rank_zero")
        def save(self):
            pass

        def plain(self):
            pass

    specs = registered_methods(W)
    assert specs == {"score": MethodSpec(Dispatch.DP_COMPUTE, False, 3.0, True), "save": MethodSpec(Dispatch.RANK_ZERO)}


@register_dispatch_mode("test_last_stage")
def last_stage(spec: MethodSpec, layout: ParallelLayout, method: str, args: tuple, kwargs: dict) -> CallPlan:
    """A user's mode: only the last pipeline stage runs, each rank told its (dp, tp); the result is the TP-0
    rank's per DP replica, in DP order."""
    stage = [r for r in range(layout.world_size) if layout.coords(r).pp == layout.pp - 1]
    rank_args = {r: (args, {**kwargs, "dp": layout.coords(r).dp, "tp": layout.coords(r).tp}) for r in stage}
    heads = [r for r in stage if layout.coords(r).tp == 0]
    return CallPlan(rank_args, lambda res: [res[r] for r in heads], frozenset(heads))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
def test_user_dispatch_mode_by_name(layout: ParallelLayout):
    class W(Worker):
        @register("test_last_stage", blocking=False)
        def head(self, x, dp, tp):
            return x, dp, tp

    spec = registered_methods(W)["head"]
    assert spec == MethodSpec("test_last_stage", blocking=False) and type(spec.dispatch) is str
    for spec in (spec, MethodSpec("test_last_stage")):  # the latter is what WorkerGroup.call(dispatch=...) builds
        plan = plan_call(spec, layout, "head", ("x",), {})
        assert sorted(plan.rank_args) == [r for r in range(layout.world_size) if layout.coords(r).pp == layout.pp - 1]
        results = {r: W.head(None, *a, **k) for r, (a, k) in plan.rank_args.items()}
        assert plan.collect(results) == [("x", d, 0) for d in range(layout.dp)]
        assert plan.keep_ranks == set(layout.collect_ranks())


def test_unknown_and_duplicate_dispatch_modes_are_refused():
    with pytest.raises(ValueError, match="dispatch mode 'no_such_mode' is unknown; registered: all_to_all, "
                                         "dp_compute, one_to_all, rank_zero, .*test_last_stage"):
        register("no_such_mode")
    with pytest.raises(ValueError, match="dispatch mode 'no_such_mode' is unknown"):
        plan_call(MethodSpec("no_such_mode"), ParallelLayout(dp=2), "f", (), {})
    register_dispatch_mode("test_last_stage")(last_stage)  # the same function again (a re-import) is fine
    with pytest.raises(ValueError, match="'dp_compute' is already registered by hybridrl.controller.dispatch"):
        @register_dispatch_mode(Dispatch.DP_COMPUTE)
        def my_dp_compute(spec, layout, method, args, kwargs):
            return CallPlan({0: (args, kwargs)}, lambda res: res[0])


def test_user_planner_output_is_checked():
    @register_dispatch_mode("test_bad_ranks")
    def bad_ranks(spec, layout, method, args, kwargs):
        return CallPlan({layout.world_size: (args, kwargs)}, lambda res: None)

    with pytest.raises(ValueError, match=r"f: dispatch mode 'test_bad_ranks' planned ranks \[2\]; plan at least one "
                                         r"rank in 0..1"):
        plan_call(MethodSpec("test_bad_ranks"), ParallelLayout(dp=2), "f", (), {})


def test_dispatch_stays_a_str_enum():
    assert Dispatch.ONE_TO_ALL == "one_to_all" and MethodSpec().dispatch == "one_to_all"
    assert MethodSpec(Dispatch.DP_COMPUTE, pad=False) == MethodSpec("dp_compute", pad=False)
    assert pickle.loads(pickle.dumps(MethodSpec(Dispatch.RANK_ZERO))).dispatch == "rank_zero"
    with pytest.raises(ValueError, match="must be a mode name"):
        MethodSpec(3)


def test_resource_pool_shapes():
    assert ResourcePool(devices=4).world_size == 4 and ResourcePool(devices=4).devices_per_node == 4
    pool = ResourcePool(nodes=2, devices_per_node=8)
    assert pool.world_size == 16 and pool.device_labels[8] == "cuda:0"
    assert ResourcePool(devices=["cuda:0", "cuda:1"]).world_size == 2
    assert ResourcePool(devices=6, nodes=2).devices_per_node == 3
    for bad, match in [(dict(devices=0), "positive"), (dict(devices=5, nodes=2), "split evenly"),
                       (dict(devices=["gpu0"]), "like 'cuda:0'"), (dict(devices=["cuda:0", "cuda:0"]), "twice"),
                       (dict(), "give devices"), (dict(devices=4, nodes=2, devices_per_node=3), "!=")]:
        with pytest.raises(ResourcePoolError, match=match):
            ResourcePool(**bad)
