"""Reshard with real data movement (gloo, 4 ranks): every generation shard equals the Megatron-style slice of
the full tensors, for every strategy, and the bytes moved equal the accounting's."""
from __future__ import annotations

import pytest

from hybridrl.hybrid_engine.model_shapes import CONCAT, GATED_HALVES, ModelShapes, ParamSpec

HIDDEN, VOCAB, FFN, LAYERS = 8, 16, 16, 4
LAYOUTS = [((2, 2, 1), (1, 1)), ((2, 2, 1), (2, 1)), ((2, 2, 1), (1, 2)), ((2, 2, 1), (2, 2)),
           ((4, 1, 1), (2, 1)), ((4, 1, 1), (1, 1)), ((4, 1, 1), (4, 1)), ((2, 1, 2), (1, 1)),
           ((1, 2, 2), (1, 1)), ((1, 4, 1), (1, 2))]


def _specs() -> list[ParamSpec]:
    specs = [ParamSpec("embedding.word_embeddings.weight", (VOCAB, HIDDEN), 0, None, "embedding")]
    for layer in range(LAYERS):
        pre = f"decoder.layers.{layer}."
        specs += [ParamSpec(pre + "input_layernorm.weight", (HIDDEN,), None, layer, "layer"),
                  ParamSpec(pre + "self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), 0, layer, "layer"),
                  ParamSpec(pre + "self_attention.linear_proj.weight", (HIDDEN, HIDDEN), 1, layer, "layer"),
                  ParamSpec(pre + "mlp.linear_fc1.weight", (2 * FFN, HIDDEN), 0, layer, "layer", GATED_HALVES),
                  ParamSpec(pre + "mlp.linear_fc2.weight", (HIDDEN, FFN), 1, layer, "layer")]
    specs += [ParamSpec("decoder.final_layernorm.weight", (HIDDEN,), None, None, "final"),
              ParamSpec("output_layer.weight", (VOCAB, HIDDEN), 0, None, "final")]
    return specs


def _full_tensors():
    import torch

    gen = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=gen) for s in _specs()}


def _megatron_shard(full, spec: ParamSpec, tp: int, rank: int):
    """How Megatron holds TP rank `rank` of `tp` (gated fc1: [gate_rank; up_rank])."""
    import torch

    if spec.partition_dim is None:
        return full
    if spec.regroup == GATED_HALVES:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return full.chunk(tp, dim=spec.partition_dim)[rank]


def _stage(spec: ParamSpec, pp: int) -> int:
    if spec.section == "embedding":
        return 0
    if spec.section == "final":
        return pp - 1
    return spec.layer // (LAYERS // pp)


def _reshard_on_rank(train_tpd, gen_tp_pp):
    import torch
    import torch.distributed as dist

    from hybridrl.hybrid_engine.reshard import Resharder, ShardedParam
    from hybridrl.parallel.generation import GenerationGroups, GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    (t, p, d), (tg, pg) = train_tpd, gen_tp_pp
    groups = GenerationGroups(ParallelLayout(tp=t, pp=p, dp=d), GenerationLayout(tp=tg, pp=pg))
    rank = dist.get_rank()
    c = groups.train.coords(rank)
    full = _full_tensors()
    params = [ShardedParam(s.name, _megatron_shard(full[s.name], s, t, c.tp).clone(), s.partition_dim,
                           _stage(s, p), s.regroup) for s in _specs() if _stage(s, p) == c.pp]
    shard = groups.gen_shard(rank)
    expected = {s.name: _megatron_shard(full[s.name], s, tg, shard.gen_tp) for s in _specs()
                if _stage(s, pg) == shard.gen_pp}
    report = {}
    for strategy in ("hybrid", "ds_chat", "hybridflow_v"):
        resharder = Resharder(groups, params, strategy)
        got = resharder.to_generation()
        mismatched = sorted(n for n in expected if n not in got or not torch.equal(got[n], expected[n]))
        extra = sorted(set(got) - set(expected))
        stats = resharder.last_stats
        resharder.to_training()
        report[strategy] = {"mismatched": mismatched, "extra": extra, "recv_payload": stats.recv_payload_bytes,
                            "recv_wire": stats.recv_wire_bytes, "buffer": stats.buffer_bytes}
    untouched = all(torch.equal(prm.tensor, _megatron_shard(full[prm.name], next(s for s in _specs()
                                                                                 if s.name == prm.name), t, c.tp))
                    for prm in params)
    return report, untouched


@pytest.mark.parametrize("train,gen", LAYOUTS, ids=[f"{a}->{b}" for a, b in LAYOUTS])
def test_reshard_matches_megatron_slices_and_accounting(dist_pool, train, gen):
    from hybridrl.hybrid_engine.accounting import account
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    results = dist_pool(4).run(_reshard_on_rank, train, gen)
    (t, p, d), (tg, pg) = train, gen
    plan = HybridEnginePlan(ParallelLayout(tp=t, pp=p, dp=d), GenerationLayout(tp=tg, pp=pg),
                            ModelShapes("synthetic", tuple(_specs()), LAYERS, 8, 8), dtype_bytes=4)
    for strategy in ("hybrid", "ds_chat", "hybridflow_v"):
        costs = account(plan, strategy).ranks
        for rank, (report, untouched) in enumerate(results):
            got = report[strategy]
            assert untouched, f"rank {rank}: training shards changed"
            assert got["mismatched"] == [] and got["extra"] == [], (strategy, rank, got)
            assert got["recv_payload"] == costs[rank].recv_payload, (strategy, rank)
            assert got["recv_wire"] == costs[rank].recv_payload + costs[rank].recv_padding, (strategy, rank)
            assert got["buffer"] == costs[rank].buffer_payload + costs[rank].buffer_padding, (strategy, rank)


def test_specs_cover_concat_rule():
    assert any(s.regroup == CONCAT and s.partition_dim == 1 for s in _specs())
