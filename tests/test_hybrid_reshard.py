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


# ---- end to end on a real Megatron GPT: training layout -> reshard -> generation-layout model ----------
SEQ, BATCH = 12, 2
E2E_LAYOUTS = [((2, 1, 2), (1, 1)), ((4, 1, 1), (2, 1)), ((2, 2, 1), (2, 1)), ((1, 2, 2), (1, 1))]


def _generation_logits_on_rank(model_dir, train_tpd, gen_tp_pp, input_ids):
    import torch
    import torch.distributed as dist

    from hybridrl.hybrid_engine.megatron_adapter import (generation_pg_collection, load_generation_weights,
                                                         training_params)
    from hybridrl.hybrid_engine.reshard import Resharder
    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.generation import GenerationGroups, GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    (t, p, d), (tg, pg) = train_tpd, gen_tp_pp
    layout = ParallelLayout(tp=t, pp=p, dp=d)
    initialize_model_parallel(layout)
    hf_config = load_hf_config(model_dir)
    train_model = build_gpt_model(hf_config)
    load_hf_weights(train_model, model_dir, hf_config)
    groups = GenerationGroups(layout, GenerationLayout(tp=tg, pp=pg))
    rank = dist.get_rank()
    resharder = Resharder(groups, training_params(train_model, layout.coords(rank).pp), "hybrid")
    tensors = resharder.to_generation()
    pgs = generation_pg_collection(groups)
    gen_model = build_gpt_model(hf_config, pg_collection=pgs,
                                padded_vocab_size=train_model.hybridrl_args.padded_vocab_size)
    unused = load_generation_weights(gen_model, tensors)
    with torch.no_grad():
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        local = gen_model(input_ids, positions, attention_mask=None)  # [b, s, vocab / t_g]
        parts = [torch.empty_like(local) for _ in range(tg)]
        dist.all_gather(parts, local.contiguous(), group=pgs.tp)
    resharder.to_training()
    local_numel = sum(prm.tensor.numel() for prm in training_params(train_model, layout.coords(rank).pp))
    return (torch.cat(parts, dim=-1)[..., :hf_config.vocab_size], unused, resharder.last_stats.recv_payload_bytes,
            local_numel)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from hybridrl.models.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("reshard") / "llama", "llama", layers=4, heads=8, kv_heads=4)


@pytest.fixture(scope="module")
def hf_logits(tiny_llama):
    import torch

    from hybridrl.models.reference import hf_reference

    input_ids = torch.randint(3, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return input_ids, hf_reference(tiny_llama, input_ids).logits


@pytest.mark.parametrize("train,gen", E2E_LAYOUTS, ids=[f"{a}->{b}" for a, b in E2E_LAYOUTS])
def test_generation_model_from_reshard_matches_hf(dist_pool, tiny_llama, hf_logits, train, gen):
    input_ids, reference = hf_logits
    from hybridrl.hybrid_engine.accounting import account
    from hybridrl.hybrid_engine.model_shapes import model_shapes
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    input_ids, reference = hf_logits
    results = dist_pool(4).run(_generation_logits_on_rank, str(tiny_llama), train, gen, input_ids)
    # the plan's shapes (HF model on meta + rule table) against the real Megatron shards and bytes moved
    plan = HybridEnginePlan(ParallelLayout(tp=train[0], pp=train[1], dp=train[2]),
                            GenerationLayout(tp=gen[0], pp=gen[1]), model_shapes(str(tiny_llama)), dtype_bytes=4)
    costs = account(plan, "hybrid").ranks
    for rank, (logits, unused, recv, local_numel) in enumerate(results):
        assert unused == [], rank
        assert (logits - reference).abs().max().item() <= 1e-4, rank
        assert 4 * local_numel == plan.training_bytes(rank), rank
        assert recv == costs[rank].recv_payload, rank
    if train[0] * train[1] > gen[0] * gen[1]:
        assert all(r[2] > 0 for r in results)  # weights really moved between ranks
