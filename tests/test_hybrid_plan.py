"""3D-HybridEngine plan: generation groups, shard composition, regroup rules, accounting vs Table 2.

Pure arithmetic and small tensors; no processes are started.
"""
from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch

from hybridrl.hybrid_engine.accounting import account, account_all, hybrid_effective_bytes, table2
from hybridrl.hybrid_engine.model_shapes import CONCAT, GATED_HALVES, ModelShapes, ParamSpec, model_shapes
from hybridrl.hybrid_engine.plan import (STRATEGIES, HybridEnginePlan, generation_shard_from_training,
                                         training_shard_from_generation)
from hybridrl.parallel.generation import (GenerationGroups, GenerationLayout, GenShard,
                                          check_generation_layout)
from hybridrl.parallel.layout import LayoutError, ParallelLayout, divisors


def groups(t: int, p: int, d: int, tg: int, pg: int) -> GenerationGroups:
    return GenerationGroups(ParallelLayout(tp=t, pp=p, dp=d), GenerationLayout(tp=tg, pp=pg))


# ---- groups: hand-worked cases (rank = tp + t*(dp + d*pp)) -----------------------------------------------
# (t, p, d) -> (t_g, p_g): micro-DP groups, generation TP groups, generation PP groups
CASES = {
    ((4, 1, 2), (2, 1)): ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]],
                          [[0], [2], [1], [3], [4], [6], [5], [7]]),  # HybridFlow §5's example (1-4-2)
    ((2, 1, 1), (1, 1)): ([[0, 1]], [[0], [1]], [[0], [1]]),
    ((2, 1, 2), (1, 1)): ([[0, 1], [2, 3]], [[0], [1], [2], [3]], [[0], [1], [2], [3]]),
    ((1, 2, 1), (1, 1)): ([[0, 1]], [[0], [1]], [[0], [1]]),
    ((2, 2, 1), (1, 1)): ([[0, 1, 2, 3]], [[0], [1], [2], [3]], [[0], [1], [2], [3]]),
    ((2, 2, 1), (2, 1)): ([[0, 2], [1, 3]], [[0, 1], [2, 3]], [[0], [1], [2], [3]]),
    ((2, 2, 1), (1, 2)): ([[0, 1], [2, 3]], [[0], [2], [1], [3]], [[0, 2], [1, 3]]),
    ((4, 1, 1), (2, 1)): ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0], [2], [1], [3]]),
    ((2, 2, 2), (1, 1)): ([[0, 1, 4, 5], [2, 3, 6, 7]], [[r] for r in (0, 1, 4, 5, 2, 3, 6, 7)],
                          [[r] for r in (0, 1, 4, 5, 2, 3, 6, 7)]),
    ((4, 2, 1), (2, 1)): ([[0, 1, 4, 5], [2, 3, 6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]],
                          [[0], [2], [1], [3], [4], [6], [5], [7]]),
    ((2, 4, 1), (2, 2)): ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 1], [4, 5], [2, 3], [6, 7]],
                          [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ((8, 1, 1), (2, 1)): ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]],
                          [[0], [4], [1], [5], [2], [6], [3], [7]]),
}


@pytest.mark.parametrize("train,gen", list(CASES), ids=[f"{a}->{b}" for a, b in CASES])
def test_groups_hand_worked(train, gen):
    g = groups(*train, *gen)
    micro, gen_tp, gen_pp = CASES[(train, gen)]
    assert g.micro_dp_groups() == micro
    assert g.gen_tp_groups() == gen_tp
    assert g.gen_pp_groups() == gen_pp


def test_facts_example_shards_and_composition():
    g = groups(4, 1, 2, 2, 1)
    assert [g.gen_shard(r) for r in range(4)] == [GenShard(0, 0), GenShard(0, 0), GenShard(0, 1), GenShard(0, 1)]
    assert [g.micro_dp_rank(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert g.training_shards_of(GenShard(0, 1)) == [(0, 2), (0, 3)]  # (pp, tp): training TP shards 2,3
    assert g.gen_dp_size == 4 and g.micro_dp_size == 2
    assert g.gen_dp_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [g.gen_dp_rank(r) for r in (0, 1, 4, 5)] == [0, 1, 2, 3]


def _all_valid_pairs(max_world: int = 16):
    for t, p, d in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2)):
        if t * p * d > max_world:
            continue
        for tg, pg in itertools.product(divisors(t), divisors(p)):
            yield t, p, d, tg, pg


@pytest.mark.parametrize("t,p,d,tg,pg", list(_all_valid_pairs()))
def test_group_invariants(t, p, d, tg, pg):
    g = groups(t, p, d, tg, pg)
    train, world = g.train, t * p * d
    st, sp = t // tg, p // pg
    for family in (g.micro_dp_groups(), g.gen_tp_groups(), g.gen_pp_groups(), g.gen_dp_groups()):
        assert sorted(r for grp in family for r in grp) == list(range(world))  # a partition of the ranks
    for grp in g.micro_dp_groups():
        shards = {g.gen_shard(r) for r in grp}
        assert len(shards) == 1 and len(grp) == st * sp == g.micro_dp_size
        assert [g.micro_dp_rank(r) for r in grp] == list(range(len(grp)))
        assert len({train.coords(r).dp for r in grp}) == 1
        # the members' training shards are exactly the ones composing the generation shard
        assert [(train.coords(r).pp, train.coords(r).tp) for r in grp] == g.training_shards_of(shards.pop())
    for grp in g.gen_tp_groups():
        assert [g.gen_shard(r).gen_tp for r in grp] == list(range(tg))
        assert len({(train.coords(r).dp, g.micro_dp_rank(r), g.gen_shard(r).gen_pp) for r in grp}) == 1
        assert all(train.coords(b).tp - train.coords(a).tp == st for a, b in zip(grp, grp[1:]))  # stride t/t_g
    for grp in g.gen_pp_groups():
        assert [g.gen_shard(r).gen_pp for r in grp] == list(range(pg))
        assert all(train.coords(b).pp - train.coords(a).pp == sp for a, b in zip(grp, grp[1:]))  # stride p/p_g
    for grp in g.gen_dp_groups():
        assert len({g.gen_shard(r) for r in grp}) == 1 and len(grp) == d * g.micro_dp_size
        assert [g.gen_dp_rank(r) for r in grp] == list(range(len(grp)))


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t,p,tg,pg,heads,kv,layers,needles", [
    (2, 1, 4, 1, None, None, None, ["--gen-tp 4 is larger than --train-tp 2", "Nearest valid --gen-tp: [2]"]),
    (4, 1, 3, 1, None, None, None, ["--train-tp 4 is not divisible by --gen-tp 3", "nearest valid --gen-tp: [2, 4]"]),
    (1, 4, 1, 3, None, None, None, ["--train-pp 4 is not divisible by --gen-pp 3", "nearest valid --gen-pp: [2, 4]"]),
    (1, 2, 1, 4, None, None, None, ["--gen-pp 4 is larger than --train-pp 2", "nearest valid --gen-pp: [2]"]),
    (4, 1, 4, 1, 6, 6, None, ["num_attention_heads=6 is not divisible by --gen-tp 4", "nearest valid --gen-tp: [2]"]),
    (8, 1, 8, 1, 16, 4, None, ["num_key_value_heads=4 is not divisible by --gen-tp 8", "nearest valid --gen-tp: [4]"]),
    (1, 4, 1, 4, None, None, 6, ["num_layers=6 is not divisible by --gen-pp 4", "nearest valid --gen-pp: [2]"]),
])
def test_invalid_generation_layouts(t, p, tg, pg, heads, kv, layers, needles):
    with pytest.raises(LayoutError) as info:
        check_generation_layout(ParallelLayout(tp=t, pp=p), GenerationLayout(tp=tg, pp=pg),
                                num_attention_heads=heads, num_query_groups=kv, num_layers=layers)
    message = str(info.value).lower()
    for needle in needles:
        assert needle.lower() in message


def test_plan_refuses_model_that_training_layout_cannot_split():
    shapes = _synthetic(num_layers=4, heads=6)
    with pytest.raises(LayoutError, match="num_attention_heads=6 is not divisible by tp=4"):
        HybridEnginePlan(ParallelLayout(tp=4), GenerationLayout(tp=2), shapes)
    with pytest.raises(LayoutError, match="not divisible by pp"):
        HybridEnginePlan(ParallelLayout(pp=8), GenerationLayout(), shapes)
    with pytest.raises(ValueError, match="unknown transition strategy 'zero3'"):
        account(HybridEnginePlan(ParallelLayout(tp=2), GenerationLayout(), shapes), "zero3")


# ---- regroup rules against Megatron-style sharding of the full tensor ----------------------------------
def _megatron_fc1_shard(gate: torch.Tensor, up: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Megatron's gated fc1 keeps [gate_rank; up_rank] on each TP rank."""
    return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])


def _megatron_qkv_full(q, k, v, groups_: int) -> torch.Tensor:
    """Megatron's fused QKV: per query group, its query heads' rows then its k rows then its v rows."""
    return torch.cat([torch.cat([qg, kg, vg]) for qg, kg, vg in zip(q.chunk(groups_), k.chunk(groups_),
                                                                   v.chunk(groups_))])


@pytest.mark.parametrize("t,tg", [(2, 1), (4, 2), (4, 1), (8, 2)])
def test_gated_fc1_needs_half_regroup(t, tg):
    ffn, hidden = 16, 3
    gate, up = torch.randn(ffn, hidden), torch.randn(ffn, hidden)
    spec = ParamSpec("mlp.linear_fc1.weight", (2 * ffn, hidden), 0, 0, "layer", GATED_HALVES)
    st = t // tg
    train_shards = [_megatron_fc1_shard(gate, up, t, r) for r in range(t)]
    for j in range(tg):
        expected = _megatron_fc1_shard(gate, up, tg, j)
        got = generation_shard_from_training(train_shards[j * st:(j + 1) * st], spec)
        assert torch.equal(got, expected)
        naive = torch.cat(train_shards[j * st:(j + 1) * st])
        assert not torch.equal(naive, expected)  # why the rule exists: a plain concat interleaves g/u
        for i in range(st):
            assert torch.equal(training_shard_from_generation(got, spec, st, i), train_shards[j * st + i])


@pytest.mark.parametrize("t,tg", [(2, 1), (4, 2), (4, 1)])
def test_fused_qkv_plain_concat_is_correct(t, tg):
    heads, kv_groups, head_dim, hidden = 8, 4, 2, 5
    q = torch.randn(heads * head_dim, hidden)
    k, v = torch.randn(kv_groups * head_dim, hidden), torch.randn(kv_groups * head_dim, hidden)
    full = _megatron_qkv_full(q, k, v, kv_groups)
    spec = ParamSpec("self_attention.linear_qkv.weight", tuple(full.shape), 0, 0, "layer", CONCAT)
    st = t // tg
    train_shards = list(full.chunk(t))
    for j in range(tg):
        # reference: the fused QKV built from only the query groups that generation TP rank j owns
        g0, g1 = j * kv_groups // tg, (j + 1) * kv_groups // tg
        per = heads // kv_groups * head_dim
        ref = _megatron_qkv_full(q[g0 * per:g1 * per], k[g0 * head_dim:g1 * head_dim],
                                 v[g0 * head_dim:g1 * head_dim], g1 - g0)
        got = generation_shard_from_training(train_shards[j * st:(j + 1) * st], spec)
        assert torch.equal(got, ref)
        for i in range(st):
            assert torch.equal(training_shard_from_generation(got, spec, st, i), train_shards[j * st + i])


# ---- accounting -----------------------------------------------------------------------------------------
def _synthetic(num_layers: int = 8, heads: int = 8, hidden: int = 16, with_ends: bool = False,
               vocab: int = 64) -> ModelShapes:
    """Every tensor TP-partitioned and every stage equal (Table 2's setting), unless with_ends."""
    params = []
    for layer in range(num_layers):
        params += [ParamSpec(f"layers.{layer}.qkv", (3 * hidden, hidden), 0, layer, "layer"),
                   ParamSpec(f"layers.{layer}.proj", (hidden, hidden), 1, layer, "layer"),
                   ParamSpec(f"layers.{layer}.fc1", (8 * hidden, hidden), 0, layer, "layer", GATED_HALVES),
                   ParamSpec(f"layers.{layer}.fc2", (hidden, 4 * hidden), 1, layer, "layer")]
        if with_ends:
            params.append(ParamSpec(f"layers.{layer}.norm", (hidden,), None, layer, "layer"))
    if with_ends:
        params = [ParamSpec("embed", (vocab, hidden), 0, None, "embedding")] + params + [
            ParamSpec("final_norm", (hidden,), None, None, "final"),
            ParamSpec("lm_head", (vocab, hidden), 0, None, "final")]
    return ModelShapes("synthetic", tuple(params), num_layers, heads, heads)


@pytest.mark.parametrize("t,p,d,tg,pg", list(_all_valid_pairs(max_world=32)))
def test_accounting_reproduces_table2_exactly(t, p, d, tg, pg):
    train, gen = ParallelLayout(tp=t, pp=p, dp=d), GenerationLayout(tp=tg, pp=pg)
    plan = HybridEnginePlan(train, gen, _synthetic(), dtype_bytes=2)
    m = plan.model_bytes
    assert m == 8 * (3 + 1 + 8 + 4) * 16 * 16 * 2
    for strategy, cost in account_all(plan).items():
        want = table2(strategy, m, train, gen)
        for field, key in (("recv_payload", "comm"), ("buffer_payload", "peak"), ("redundant", "redundancy")):
            # every rank, not only the mean: shards are equal in Table 2's setting
            assert {Fraction(getattr(r, field)) for r in cost.ranks} == {want[key]}, (strategy, field)
        assert cost.max("recv_padding") == 0 and cost.max("buffer_padding") == 0
        assert cost.mean("sent_payload") == want["comm"]


@pytest.mark.parametrize("t,p,d,tg,pg", [(2, 2, 1, 1, 1), (4, 2, 2, 2, 1), (2, 4, 1, 1, 2), (4, 4, 2, 2, 2),
                                         (8, 2, 1, 8, 1), (4, 1, 2, 1, 1)])
def test_accounting_means_with_real_model_structure(t, p, d, tg, pg):
    """Embedding/output on the end stages, replicated norms, a vocab that does not divide: the means stay
    exact (baselines with M, hybrid with M' = P + t_g*R); maxima and padding show the imbalance."""
    train, gen = ParallelLayout(tp=t, pp=p, dp=d), GenerationLayout(tp=tg, pp=pg)
    plan = HybridEnginePlan(train, gen, _synthetic(with_ends=True, vocab=101), dtype_bytes=2)
    costs = account_all(plan)
    for strategy in ("ds_chat", "hybridflow_v"):
        want = table2(strategy, plan.model_bytes, train, gen)
        assert costs[strategy].mean("recv_payload") == want["comm"]
        assert costs[strategy].mean("buffer_payload") == want["peak"]
    want = table2("hybrid", hybrid_effective_bytes(plan), train, gen)
    assert costs["hybrid"].mean("recv_payload") == want["comm"]
    assert costs["hybrid"].mean("buffer_payload") == want["peak"]
    for cost in costs.values():
        assert cost.max("recv_payload") >= cost.mean("recv_payload")
        assert cost.max("recv_padding") > 0  # stages are unequal, vocab 101 does not divide t
    hybrid, hfv = costs["hybrid"].mean("recv_payload"), costs["hybridflow_v"].mean("recv_payload")
    assert (hybrid < hfv) if tg * pg > 1 else (hybrid == hfv)  # t_g = p_g = 1: both gather the whole model
    assert costs["hybrid"].mean("redundant") < costs["hybridflow_v"].mean("redundant")


def test_accounting_hand_computed():
    """t=2, p=2 -> t_g=p_g=1: one micro-DP group [0,1,2,3] (rank = tp + 2*pp), element counts by hand."""
    params = (ParamSpec("embed", (16, 4), 0, None, "embedding"),
              ParamSpec("layers.0.w", (8, 4), 0, 0, "layer"), ParamSpec("layers.1.w", (8, 4), 0, 1, "layer"),
              ParamSpec("final_norm", (4,), None, None, "final"))
    plan = HybridEnginePlan(ParallelLayout(tp=2, pp=2), GenerationLayout(), ModelShapes("hand", params, 2, 2, 2), 2)
    # contributions (elements): rank0 = 32 embed + 16 layer0 = 48, rank1 = 48, rank2 = 16 + 4 norm, rank3 = 16
    assert [plan.contribution(r, "hybrid") for r in range(4)] == [(96, 0), (96, 0), (40, 0), (32, 0)]
    cost = account(plan, "hybrid")
    assert [r.recv_payload for r in cost.ranks] == [2 * 84, 2 * 84, 2 * 112, 2 * 116]
    assert [r.recv_padding for r in cost.ranks] == [2 * 60, 2 * 60, 2 * 32, 2 * 28]  # slot = 48 elements
    assert {r.buffer_payload for r in cost.ranks} == {2 * 132} and plan.model_bytes == 2 * 132
    assert [r.redundant for r in cost.ranks] == [0, 0, 0, 2 * 4]  # rank3 holds the norm it does not own
    assert [r.sent_payload for r in cost.ranks] == [2 * 84, 2 * 112, 2 * 116, 2 * 84]  # ring: all but successor's


def test_llama_preset_shapes_and_plan():
    shapes = model_shapes("llama-7b")
    assert shapes.numel == 6_738_415_616  # Llama-2-7B parameter count
    plan = HybridEnginePlan(ParallelLayout(tp=8), GenerationLayout(tp=2), shapes)
    assert plan.describe_rank(5) == {"rank": 5, "train": {"pp": 0, "dp": 0, "tp": 5},
                                     "gen": {"pp": 0, "tp": 1, "dp": 1, "micro_dp_rank": 1},
                                     "gen_layers": [0, 32], "composed_of_ranks": [4, 5, 6, 7]}
    hybrid = account(plan, "hybrid")
    assert hybrid.mean("recv_payload") == table2("hybrid", hybrid_effective_bytes(plan), plan.train, plan.gen)["comm"]
    assert set(STRATEGIES) == set(account_all(plan))


def _synthetic_moe(num_layers: int = 4, experts: int = 8, hidden: int = 16) -> ModelShapes:
    """Dense attention + `experts` SwiGLU experts per layer, every tensor TP-partitioned, equal stages."""
    params = []
    for layer in range(num_layers):
        params += [ParamSpec(f"layers.{layer}.qkv", (3 * hidden, hidden), 0, layer, "layer"),
                   ParamSpec(f"layers.{layer}.proj", (hidden, hidden), 1, layer, "layer")]
        params += [spec for e in range(experts) for spec in (
            ParamSpec(f"layers.{layer}.experts.{e}.fc1", (4 * hidden, hidden), 0, layer, "layer", GATED_HALVES, e),
            ParamSpec(f"layers.{layer}.experts.{e}.fc2", (hidden, 2 * hidden), 1, layer, "layer", CONCAT, e))]
    return ModelShapes("synthetic_moe", tuple(params), num_layers, 8, 8, num_experts=experts)


def _moe_layouts():
    for t, p, d in itertools.product((1, 2, 4), (1, 2), (1, 2, 4, 8)):
        if t * p * d > 32:
            continue
        for ep, tg, pg in itertools.product(divisors(d), divisors(t), divisors(p)):
            for eg in divisors(ep):
                yield t, p, d, ep, tg, pg, eg


@pytest.mark.parametrize("t,p,d,ep,tg,pg,eg", list(_moe_layouts()))
def test_accounting_with_experts_is_table2_on_dense_and_expert_parts(t, p, d, ep, tg, pg, eg):
    """Training (t, p, ep) -> generation (t_g, p_g, e_g): every rank's bytes received, generation buffer and
    redundancy equal Table 2 applied to the dense part (t p -> t_g p_g) and to the experts (t p ep ->
    t_g p_g e_g) apart; hybrid holds nothing twice; the experts' first stage is inside ep / e_g ranks."""
    train, gen = ParallelLayout(tp=t, pp=p, dp=d, ep=ep), GenerationLayout(tp=tg, pp=pg, ep=eg)
    plan = HybridEnginePlan(train, gen, _synthetic_moe(), dtype_bytes=2)
    m, e = plan.model_bytes, plan.expert_bytes
    assert e == 4 * 8 * 6 * 16 * 16 * 2 and m == e + 4 * 4 * 16 * 16 * 2
    costs = account_all(plan)
    for strategy, cost in costs.items():
        want = table2(strategy, m, train, gen, expert_bytes=e)
        assert cost.mean("recv_payload") == want["comm"], strategy
        assert cost.mean("sent_payload") == want["comm"], strategy
        assert {Fraction(r.buffer_payload) for r in cost.ranks} == {want["peak"]}, strategy
        assert {Fraction(r.redundant) for r in cost.ranks} == {want["redundancy"]}, strategy
        assert cost.max("recv_padding") == 0 and cost.max("buffer_padding") == 0, strategy
    # every rank ends with its generation shard: training bytes + what it received
    for r in costs["hybrid"].ranks:
        assert r.buffer_payload == plan.training_bytes(r.rank) + r.recv_payload
    first = plan.expert_gather_groups("hybrid")
    assert {len(g) for g in first} == ({ep // eg} if ep > eg else set())
    for group in first:  # same TP shard and stage, consecutive expert blocks
        coords = [train.coords(r) for r in group]
        assert len({(c.pp, c.tp) for c in coords}) == 1
        assert [c.dp % ep for c in coords] == list(range(coords[0].dp % ep, coords[0].dp % ep + len(group)))


def test_moe_presets_are_the_real_models():
    """Meta-device shapes of the MoE presets: the published parameter counts, experts split one by one."""
    want = {"qwen3-30b-a3b": (30_532_122_624, 128, 48), "mixtral-8x7b": (46_702_792_704, 8, 32),
            "deepseek-v3": (671_026_404_352, 256, 61)}
    for name, (numel, experts, layers) in want.items():
        shapes = model_shapes(name)
        assert (shapes.numel, shapes.num_experts, shapes.num_layers) == (numel, experts, layers), name
        by_expert = {p.expert for p in shapes.params if p.expert is not None}
        assert by_expert == set(range(experts)), name
    deepseek = model_shapes("deepseek-v3")
    kinds = {p.name.split(".")[-2]: p.partition_dim for p in deepseek.params if ".layers.5." in p.name}
    assert kinds["q_a_proj"] is None and kinds["kv_a_proj_with_mqa"] is None  # MLA down projections
    assert kinds["q_b_proj"] == 0 and kinds["kv_b_proj"] == 0 and kinds["o_proj"] == 1
    # 3 dense layers then 58 MoE layers of 256 experts, each 3 x 7168 x 2048
    assert deepseek.expert_numel == 58 * 256 * 3 * 7168 * 2048


def test_generation_expert_parallelism_must_divide_training_ep():
    with pytest.raises(LayoutError, match="--gen-ep 4 does not divide --train-ep 2"):
        check_generation_layout(ParallelLayout(dp=2, ep=2), GenerationLayout(ep=4))
    with pytest.raises(LayoutError, match="ep=2 needs a mixture-of-experts model"):
        HybridEnginePlan(ParallelLayout(dp=2, ep=2), GenerationLayout(), _synthetic(), 2)


def test_cost_model_hand_computed():
    from hybridrl.hybrid_engine.cost_model import Hardware, groups_crossing_nodes, transition_time

    hw = Hardware(gpus_per_node=8, nvlink_GBps=600.0, inter_node_Gbps=200.0)
    # t=8, p=2 on 2 nodes (node = pp stage) -> t_g=8, p_g=1: micro-DP groups [r, r+8] cross nodes
    plan = HybridEnginePlan(ParallelLayout(tp=8, pp=2), GenerationLayout(tp=8), _synthetic(num_layers=2), 2)
    slot = plan.model_bytes // 16  # every tensor partitioned, equal stages
    hybrid = transition_time(plan, "hybrid", hw)
    assert (hybrid.groups, hybrid.groups_crossing_nodes) == (8, 8)
    assert (hybrid.intra_node_bytes, hybrid.inter_node_bytes) == (0, slot)
    assert hybrid.seconds == pytest.approx(slot / (25e9 / 8), rel=1e-12)  # 8 GPUs share the node's link
    hfv = transition_time(plan, "hybridflow_v", hw)  # one group of 16: 7 slots over NVLink, 8 across
    assert (hfv.intra_node_bytes, hfv.inter_node_bytes) == (7 * slot, 8 * slot)
    assert hfv.seconds == pytest.approx(7 * slot / 600e9 + 8 * slot / (25e9 / 8), rel=1e-12)
    assert groups_crossing_nodes(plan.groups.gen_tp_groups(), hw) == 0
    one_node = HybridEnginePlan(ParallelLayout(tp=8), GenerationLayout(tp=2), _synthetic(num_layers=2), 2)
    t = transition_time(one_node, "hybrid", hw)
    assert t.groups_crossing_nodes == 0 and t.seconds == pytest.approx(3 * one_node.model_bytes / 8 / 600e9)
