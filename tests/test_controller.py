"""The single controller on a real local Ray cluster (4 fake GPUs): dispatch modes over real Megatron
parallel state, colocation, isolation of pools, and failures surfacing with rank and cause."""
import os
import signal
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from hybridrl.controller import (Dispatch, ResourcePool, ResourcePoolError, Worker, WorkerDiedError, WorkerError,
                                 WorkerGroup, WorkerTimeoutError, create_colocated_worker_group, init_local_ray,
                                 register, shutdown_ray, wait_all)
from hybridrl.parallel.layout import LayoutError, ParallelLayout
from hybridrl.protocol import Batch

pytestmark = pytest.mark.slow  # one Ray start + 3 pool starts: ~1 min on an idle 2-core machine

LAYOUTS = [ParallelLayout(tp=2, pp=1, dp=2), ParallelLayout(tp=1, pp=2, dp=2), ParallelLayout(tp=2, pp=2, dp=1)]


def _freed_memory_kept() -> bool:
    """Whether 64 MiB a tensor touched and freed stays in the process for reuse (CPU workers, controller/worker.py
    reuse_freed_heap_memory) instead of going back to the OS (glibc's default above its mmap threshold)."""
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * page

    block = torch.ones(16 << 20)
    holding = rss()
    del block
    return holding - rss() < 32 << 20


class ProbeWorker(Worker):
    """Reports where it runs and transforms batches in a way that names the rank that did it."""

    def __init__(self, scale: int = 2) -> None:
        self.scale = scale
        self.rank_zero_calls = 0

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        from megatron.core import parallel_state as ps

        return {"rank": self.rank, "world": self.world_size, "local_rank": self.local_rank,
                "coords": tuple(self.coords), "pid": os.getpid(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "megatron": (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(),
                             ps.get_tensor_model_parallel_rank()),
                "group": id(dist.distributed_c10d._get_default_group()), "master_port": self.context.master_port,
                "threads": torch.get_num_threads(), "dist_world": dist.get_world_size(),
                "freed_memory_kept": _freed_memory_kept()}

    @register(Dispatch.ALL_TO_ALL)
    def add_rank(self, value: int) -> int:
        return value + self.rank

    @register(Dispatch.RANK_ZERO)
    def on_rank_zero(self, value: int) -> tuple:
        self.rank_zero_calls += 1
        return self.rank, value

    @register(Dispatch.ONE_TO_ALL)
    def count_rank_zero_calls(self) -> int:
        return self.rank_zero_calls

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        tensor = torch.tensor([value + self.rank], dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.item()

    @register(Dispatch.DP_COMPUTE)
    def score(self, batch: Batch, offset: float) -> Batch:
        from megatron.core import parallel_state as ps

        # a TP all-reduce over Megatron's group proves every TP rank got the call and the group works
        tp_sum = torch.tensor([1.0])
        dist.all_reduce(tp_sum, group=ps.get_tensor_model_parallel_group())
        n, c = len(batch), self.coords
        return Batch({"value": batch["x"].float() * self.scale + offset, "h": batch["h"],
                      "tp_sum": tp_sum.expand(n).clone(), "from_rank": torch.full((n,), self.rank)},
                     {"text": batch["text"]}, {"dp": c.dp})

    @register(Dispatch.DP_COMPUTE)
    def two_samples(self, batch: Batch) -> Batch:
        return batch.select("x", "text").repeat_interleave(2)

    @register(Dispatch.DP_COMPUTE, pad=False)
    def shard_rows(self, batch: Batch) -> int:
        return len(batch)

    @register(Dispatch.ONE_TO_ALL)
    def span(self, seconds: float) -> tuple:
        start = time.time()
        time.sleep(seconds)
        return start, time.time()

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int, then_all_reduce: bool = False) -> int:
        if self.rank == rank:
            raise ValueError(f"boom at rank {rank}")
        if then_all_reduce:  # the others wait in a collective the failed rank never joins
            dist.all_reduce(torch.ones(1))
        return self.rank


class BrokenWorker(Worker):
    def __init__(self) -> None:
        if self.rank == 1:
            raise RuntimeError("cannot load checkpoint on rank 1")


def make_batch(n: int) -> Batch:
    return Batch({"x": torch.arange(n), "h": torch.randn(n, 3).to(torch.bfloat16)},
                 {"text": [f"prompt {i}" for i in range(n)]})


@pytest.fixture(scope="module")
def ray_cluster():
    init_local_ray(4)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def main_pool(ray_cluster):
    pool = ResourcePool(devices=4, name="main")
    yield pool
    pool.shutdown()


def test_bad_config_refused_before_start(ray_cluster):
    pool = ResourcePool(devices=4, name="unused")
    with pytest.raises(LayoutError, match="does not match the 4"):
        WorkerGroup(pool, ProbeWorker, layout=ParallelLayout(tp=2, dp=1))
    with pytest.raises(TypeError, match="must subclass"):
        WorkerGroup(pool, object)
    assert pool._hosts is None and pool.layout is None and not pool._placement_groups  # nothing was started
    with pytest.raises(ResourcePoolError, match="Ray has 4 GPUs"):
        ResourcePool(devices=8).placement_groups()


def test_default_pool_takes_every_device_of_the_running_cluster(ray_cluster, monkeypatch):
    """Roles without a pool share ResourcePool.default(): with Ray running, all of its devices; a pool placed on a
    cluster that has since stopped is replaced by a fresh one."""
    from hybridrl.controller import resource_pool

    monkeypatch.setattr(resource_pool, "_default_pool", None)
    monkeypatch.delenv("HYBRIDRL_DEVICES", raising=False)
    pool = ResourcePool.default()
    assert (pool.nodes, pool.devices_per_node, pool.name) == (1, 4, "default") and ResourcePool.default() is pool
    pool._cluster = "127.0.0.1:1"  # as if placed on an earlier cluster
    assert pool.placed_elsewhere() and ResourcePool.default() is not pool


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe().replace(", ", "-"))
def test_dispatch_modes(main_pool, layout: ParallelLayout):
    group = WorkerGroup(main_pool, ProbeWorker, layout=layout, role="probe")
    try:
        info = group.whoami()
        assert [i["rank"] for i in info] == [0, 1, 2, 3] and {i["world"] for i in info} == {4}
        for rank, i in enumerate(info):
            assert i["coords"] == tuple(layout.coords(rank)) == i["megatron"]  # real Megatron parallel state
            assert i["dist_world"] == 4 and i["local_rank"] == rank and i["threads"] == 1
            assert i["freed_memory_kept"]  # large blocks are reused, not page-faulted in again
        assert len({i["cuda"] for i in info}) == 4  # one device each

        assert group.add_rank([10, 20, 30, 40]) == [10, 21, 32, 43]
        assert group.on_rank_zero(5) == (0, 5)
        assert group.count_rank_zero_calls() == [1, 0, 0, 0]
        assert group.all_reduce(1.0) == [10.0] * 4

        for n in (1, 3, 5, 8):  # uneven sizes: padded to a multiple of dp, padding dropped
            batch = make_batch(n)
            out = group.score(batch, 0.5)
            assert len(out) == n
            assert torch.equal(out["value"], torch.arange(n).float() * 2 + 0.5)
            assert torch.equal(out["h"], batch["h"]) and out["text"].tolist() == batch["text"].tolist()
            assert torch.all(out["tp_sum"] == layout.tp)
            assert all(layout.is_collect_rank(int(r)) for r in out["from_rank"])
            # row i was computed by the DP replica that owns it after padding+chunking
            per_replica = -(-n // layout.dp)
            assert [layout.coords(int(r)).dp for r in out["from_rank"]] == [i // per_replica for i in range(n)]
            twice = group.two_samples(batch)
            assert twice["x"].tolist() == [i for i in range(n) for _ in (0, 1)]
            assert twice["text"].tolist() == [f"prompt {i}" for i in range(n) for _ in (0, 1)]
            sizes = group.shard_rows(batch)
            assert len(sizes) == layout.dp and sum(sizes) == n and max(sizes) - min(sizes) <= 1
    finally:
        group.close()


def test_colocated_roles_share_processes_and_group(main_pool):
    layout = ParallelLayout(tp=2, dp=2)
    roles = create_colocated_worker_group(main_pool, {"actor": ProbeWorker, "ref": (ProbeWorker, (3,))}, layout)
    try:
        assert main_pool.layout == layout  # what a role placed on the pool next must use
        actor, ref = roles["actor"].whoami(), roles["ref"].whoami()
        for a, r in zip(actor, ref):
            for key in ("pid", "cuda", "group", "master_port", "megatron"):
                assert a[key] == r[key], key
        assert len({a["pid"] for a in actor}) == 4
        assert roles["actor"].all_reduce(0.0) == roles["ref"].all_reduce(0.0) == [6.0] * 4
        batch = make_batch(5)
        assert torch.equal(roles["ref"].score(batch, 0.0)["value"], torch.arange(5).float() * 3)
        assert torch.equal(roles["actor"].score(batch, 0.0)["value"], torch.arange(5).float() * 2)
        with pytest.raises(ValueError, match="already has a role named 'ref'"):
            WorkerGroup(main_pool, ProbeWorker, layout=layout, role="ref")
        with pytest.raises(ValueError, match="colocated roles share one layout"):
            WorkerGroup(main_pool, ProbeWorker, layout=ParallelLayout(dp=4), role="critic")
    finally:
        for group in roles.values():
            group.close()


@pytest.fixture(scope="module")
def two_pools(main_pool):
    main_pool.shutdown()  # free its 4 devices for two 2-device pools
    pools = [ResourcePool(devices=2, name="a"), ResourcePool(devices=2, name="b")]
    yield pools
    for pool in pools:
        pool.shutdown()


def test_separate_pools_are_isolated_and_overlap(two_pools):
    group_a = WorkerGroup(two_pools[0], ProbeWorker, role="reward")
    group_b = WorkerGroup(two_pools[1], ProbeWorker, role="ref")
    info_a, info_b = group_a.whoami(), group_b.whoami()
    assert {i["dist_world"] for i in info_a + info_b} == {2}
    assert not {i["pid"] for i in info_a} & {i["pid"] for i in info_b}
    assert not {i["cuda"] for i in info_a} & {i["cuda"] for i in info_b}
    assert info_a[0]["master_port"] != info_b[0]["master_port"]
    assert group_a.all_reduce(0.0) == [1.0, 1.0] and group_b.all_reduce(1.0) == [3.0, 3.0]
    # non-blocking calls on the two pools run at the same time
    spans = wait_all([group_a.span.remote(1.0), group_b.span.remote(1.0)])
    starts, ends = [s for spans_of in spans for s, _ in spans_of], [e for spans_of in spans for _, e in spans_of]
    assert max(starts) < min(ends)
    with pytest.raises(ResourcePoolError, match="free devices not found"):
        ResourcePool(devices=1, name="none-left", placement_timeout_s=2).placement_groups()


def test_failures_surface_with_rank_and_cause(two_pools):
    with pytest.raises(WorkerError, match="role 'broken' rank 1: __init__ failed: RuntimeError: cannot load"):
        WorkerGroup(two_pools[0], BrokenWorker, role="broken")
    group = WorkerGroup(two_pools[0], ProbeWorker, role="failing")
    with pytest.raises(WorkerError, match="boom at rank 1") as raised:
        group.fail_on(1)
    assert raised.value.rank == 1 and raised.value.role == "failing" and raised.value.method == "fail_on"
    assert "ValueError" in str(raised.value) and "in fail_on" in raised.value.remote_traceback
    assert group.add_rank([1, 1]) == [1, 2]  # the group still works after a plain exception

    with pytest.raises(WorkerTimeoutError, match=r"ranks \[0, 1\] did not finish within 0.5s"):
        group.call("span", 2.0, timeout_s=0.5).result()

    # rank 1 raises while rank 0 waits in a collective for it: the error arrives, not a hang
    stuck = WorkerGroup(two_pools[1], ProbeWorker, role="stuck", call_timeout_s=20)
    with pytest.raises(WorkerError, match="boom at rank 1"):
        stuck.call("fail_on", 1, True, timeout_s=30).result()
    pids = [info["pid"] for info in stuck.worker_info]
    # rank 0 is still blocked in the collective: closing kills the pool's processes instead of queueing a
    # removal behind the collective (which would time out after call_timeout_s and raise here)
    stuck.close()
    assert two_pools[1]._hosts.actors == []
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=30)
    assert not alive
    two_pools[1].shutdown()

    # a killed worker process: the pending call and later calls name the dead rank
    future = group.span.remote(60.0)
    os.kill(group.worker_info[1]["pid"], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="role 'failing' rank 1") as died:
        future.result(timeout_s=30)
    assert "died" in str(died.value)
    with pytest.raises(WorkerDiedError, match="rank 1"):
        group.call("whoami", timeout_s=30).result()
