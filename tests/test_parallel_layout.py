"""ParallelLayout: rank arithmetic, its groups equal Megatron's parallel_state groups, clear errors."""
from __future__ import annotations

import itertools

import pytest

from hybridrl.parallel.layout import LayoutError, ParallelLayout, RankCoords

LAYOUTS = [ParallelLayout(tp, pp, dp) for tp, pp, dp in itertools.product([1, 2, 4], [1, 2, 3], [1, 2, 3])]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
def test_coords_rank_round_trip(layout):
    seen = set()
    for rank in layout.ranks():
        coords = layout.coords(rank)
        assert layout.rank(*coords) == rank
        seen.add(coords)
    assert len(seen) == layout.world_size


def test_megatron_rank_order():
    layout = ParallelLayout(tp=2, pp=2, dp=3)
    # tp fastest, then dp, then pp: rank = tp + t*(dp + d*pp)
    assert layout.coords(0) == RankCoords(pp=0, dp=0, tp=0)
    assert layout.coords(1) == RankCoords(pp=0, dp=0, tp=1)
    assert layout.coords(2) == RankCoords(pp=0, dp=1, tp=0)
    assert layout.coords(6) == RankCoords(pp=1, dp=0, tp=0)
    assert layout.rank(pp=1, dp=2, tp=1) == 11


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
def test_groups_partition_the_world(layout):
    world = list(range(layout.world_size))
    for groups, size in [(layout.tp_groups(), layout.tp), (layout.dp_groups(), layout.dp),
                         (layout.pp_groups(), layout.pp), (layout.model_parallel_groups(), layout.tp * layout.pp)]:
        assert sorted(r for g in groups for r in g) == world
        assert all(len(g) == size for g in groups)
    for rank in world:
        c = layout.coords(rank)
        assert all(layout.coords(r).tp == c.tp and layout.coords(r).pp == c.pp
                   for r in layout.group_of(rank, layout.dp_groups()))
        assert layout.model_parallel_rank(rank) == layout.group_of(rank, layout.model_parallel_groups()).index(rank)


def test_collect_ranks():
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    assert layout.collect_ranks() == [4, 6]
    assert [r for r in layout.ranks() if layout.is_collect_rank(r)] == [4, 6]


def test_world_size_mismatch_names_the_options():
    with pytest.raises(LayoutError, match=r"tp\*pp\*dp = 2\*2\*1 = 4 does not match the 8") as info:
        ParallelLayout(2, 2, 1).check_world_size(8)
    assert "parallel.tp/pp/dp" in str(info.value)
    ParallelLayout(2, 2, 2).check_world_size(8)


@pytest.mark.parametrize("kwargs,match", [
    ({"tp": 0}, "parallel.tp must be a positive integer"),
    ({"pp": -1}, "parallel.pp must be a positive integer"),
    ({"dp": 1.5}, "parallel.dp must be a positive integer"),
    ({"tp": 1, "sequence_parallel": True}, "sequence_parallel needs tp > 1"),
    ({"pp": 1, "vpp": 2}, "vpp .* needs pp > 1"),
])
def test_bad_sizes_refused(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        ParallelLayout(**kwargs)


def test_indivisible_model_refused_with_choices():
    layout = ParallelLayout(tp=4, pp=3)
    with pytest.raises(LayoutError, match=r"num_attention_heads=6 is not divisible by tp=4; choose tp in \[1, 2, 3, 6\]"):
        layout.check_model(num_attention_heads=6, num_query_groups=2, num_layers=6)
    with pytest.raises(LayoutError, match=r"num_key_value_heads=2 is not divisible by tp=4"):
        layout.check_model(num_attention_heads=8, num_query_groups=2, num_layers=6)
    with pytest.raises(LayoutError, match=r"num_layers=4 is not divisible by pp\*vpp=3"):
        layout.check_model(num_attention_heads=8, num_query_groups=4, num_layers=4)
    layout.check_model(num_attention_heads=8, num_query_groups=4, num_layers=6)
    with pytest.raises(LayoutError, match=r"pp\*vpp=4"):
        ParallelLayout(pp=2, vpp=2).check_model(num_attention_heads=4, num_query_groups=4, num_layers=6)


def test_out_of_range():
    layout = ParallelLayout(2, 1, 2)
    with pytest.raises(LayoutError, match="rank 4 outside world of size 4"):
        layout.coords(4)
    with pytest.raises(LayoutError, match="outside layout"):
        layout.rank(pp=1)


def megatron_groups(tp: int, pp: int, dp: int) -> dict:
    """This rank's groups and coordinates as Megatron's parallel_state reports them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridrl.parallel.distributed import initialize_model_parallel

    initialize_model_parallel(ParallelLayout(tp, pp, dp))
    return {
        "rank": dist.get_rank(),
        "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
        "mp": dist.get_process_group_ranks(ps.get_model_parallel_group()),
        "coords": RankCoords(ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(),
                             ps.get_tensor_model_parallel_rank()),
        "collect": ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0,
    }


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 2), (1, 2, 2), (2, 2, 1)])
def test_groups_equal_megatron_parallel_state(dist_pool, tp, pp, dp):
    layout = ParallelLayout(tp, pp, dp)
    for got in dist_pool(4).run(megatron_groups, tp, pp, dp):
        rank = got["rank"]
        assert got["tp"] == layout.group_of(rank, layout.tp_groups())
        assert got["pp"] == layout.group_of(rank, layout.pp_groups())
        assert got["dp"] == layout.group_of(rank, layout.dp_groups())
        assert got["mp"] == layout.group_of(rank, layout.model_parallel_groups())
        assert tuple(got["coords"]) == layout.coords(rank)
        assert got["collect"] == layout.is_collect_rank(rank)


def megatron_expert_groups(layout: ParallelLayout) -> dict:
    """This rank's expert groups and expert coordinates as Megatron's parallel_state reports them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridrl.parallel.distributed import initialize_model_parallel

    initialize_model_parallel(layout)
    return {"rank": dist.get_rank(),
            "ep": dist.get_process_group_ranks(ps.get_expert_model_parallel_group()),
            "etp": dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group()),
            "coords": (ps.get_expert_tensor_parallel_rank(), ps.get_expert_model_parallel_rank(),
                       ps.get_expert_data_parallel_rank())}


@pytest.mark.parametrize("layout", [ParallelLayout(tp=1, dp=4, ep=2), ParallelLayout(tp=2, dp=2, ep=2),
                                    ParallelLayout(tp=2, dp=2, ep=2, etp=1), ParallelLayout(tp=2, dp=2, ep=4, etp=1),
                                    ParallelLayout(tp=4, dp=1, ep=2, etp=2), ParallelLayout(tp=2, pp=2, ep=2, etp=1),
                                    ParallelLayout(tp=1, dp=4, ep=2, etp=2)],
                         ids=lambda layout: layout.describe())
def test_expert_groups_equal_megatron_parallel_state(dist_pool, layout):
    """Expert-parallel and expert-TP groups, with expert TP equal to TP, below it (experts spread over TP
    ranks, ep up to tp/etp*dp) and above it (an expert-TP group spans DP replicas)."""
    for got in dist_pool(4).run(megatron_expert_groups, layout):
        rank = got["rank"]
        assert got["ep"] == layout.group_of(rank, layout.expert_parallel_groups()), (layout, rank)
        assert got["etp"] == layout.group_of(rank, layout.expert_tp_groups()), (layout, rank)
        assert got["coords"] == tuple(layout.expert_coords(rank)), (layout, rank)


def test_expert_tp_is_checked():
    with pytest.raises(LayoutError, match=r"expert_tp=3 must divide tp=2 or be a multiple of it .*choose expert_tp "
                                          r"in \[1, 2\] or a multiple of 2"):
        ParallelLayout(tp=2, dp=2, etp=3)
    with pytest.raises(LayoutError, match=r"expert_tp=4 must divide tp\*dp = 2\*1 = 2 .*choose expert_tp in \[1, 2\]"):
        ParallelLayout(tp=2, dp=1, ep=2, etp=4)
    with pytest.raises(LayoutError, match=r"ep=2 must divide dp=1.*set expert_tp below tp"):
        ParallelLayout(tp=2, dp=1, ep=2)
    with pytest.raises(LayoutError, match=r"ep=3 must divide tp\*dp/expert_tp = 2\*1/1 = 2"):
        ParallelLayout(tp=2, dp=1, ep=3, etp=1)
    with pytest.raises(LayoutError, match=r"expert_tp=1 other than tp=2 needs ep > 1: .*set ep in \[2\]"):
        ParallelLayout(tp=2, dp=1, etp=1)
    with pytest.raises(LayoutError, match=r"expert_tp=2 other than tp=1 needs ep > 1: .*set ep in \[2\]"):
        ParallelLayout(tp=1, dp=4, etp=2)
    with pytest.raises(LayoutError, match=r"ep=4 must divide tp\*dp/expert_tp = 1\*4/2 = 2"):
        ParallelLayout(tp=1, dp=4, ep=4, etp=2)
    with pytest.raises(LayoutError, match="expert_tp must be a positive integer"):
        ParallelLayout(tp=2, etp=0)
    assert ParallelLayout(tp=2, dp=1, ep=2, etp=1).expert_tp == 1
    assert ParallelLayout(tp=2).expert_tp == 2
    wide = ParallelLayout(tp=2, dp=4, ep=2, etp=4)  # an expert-TP group spans two DP replicas
    assert wide.expert_replicas == 1 and wide.expert_shards_of_tp_shard(1) == [2, 3]
    assert ParallelLayout(tp=4, dp=1, ep=2, etp=2).expert_shards_of_tp_shard(3) == [1]
