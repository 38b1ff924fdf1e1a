"""HybridEngine (the actor's switch) on real Megatron GPT models over gloo, 4 ranks: the generation-layout
model's weights view the in-place generation buffer, its logits equal the training model's and transformers',
the training weights are freed while generating and bit-identical after the round trip (under Megatron DDP +
distributed optimizer too, and an optimizer step in between reaches the next generation), and the memory
held while generating is the accounting's zero-redundancy figure. A p_g = 2 generation model (two pipeline
stages on the generation PP groups) run stage by stage gives transformers' logits too."""
from __future__ import annotations

import pytest

# (t, p, d) -> (t_g, p_g); p_g = 1: the rollout engines generate with single-stage models
LAYOUTS = [((4, 1, 1), (2, 1)), ((2, 2, 1), (1, 1)), ((2, 2, 1), (2, 1)), ((1, 2, 2), (1, 1))]


def _gather_logits(model, input_ids, tp_group, tp: int, vocab: int):
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand(input_ids.shape[0], -1)
        local = model(input_ids, positions, attention_mask=None)
        if tp == 1:
            return local[..., :vocab]
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)[..., :vocab]


def _training_model(model_dir, train_tpd):
    """Megatron parallel state for (t, p, d) and this rank's training shard loaded from the HF folder."""
    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout

    t, p, d = train_tpd
    layout = ParallelLayout(tp=t, pp=p, dp=d)
    initialize_model_parallel(layout)
    hf_config = load_hf_config(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, model_dir, hf_config)
    return layout, hf_config, model


def _engine_round_trip(model_dir, train_tpd, gen_tp_pp, input_ids, strategy, bucket_mb):
    import torch
    import torch.distributed as dist

    from hybridrl.hybrid_engine.engine import HybridEngine
    from hybridrl.parallel.generation import GenerationLayout

    tg, pg = gen_tp_pp
    layout, hf_config, train_model = _training_model(model_dir, train_tpd)
    params = dict(train_model.named_parameters())
    before = {n: prm.detach().clone() for n, prm in params.items()}
    engine = HybridEngine(train_model, hf_config, layout, GenerationLayout(tp=tg, pp=pg), strategy=strategy,
                          bucket_mb=bucket_mb)
    results = {}
    for round_trip in range(2):
        gen_model = engine.to_generation()
        storages = {prm.untyped_storage().data_ptr() for prm in gen_model.parameters()}
        freed = sum(prm.untyped_storage().nbytes() == 0 for prm in params.values())
        logits = _gather_logits(gen_model, input_ids, engine.tp_group, tg, hf_config.vocab_size)
        stats = engine.last_stats
        engine.to_training()
        results[round_trip] = {
            "logits": logits, "same_model": gen_model is engine.gen_model, "one_storage": len(storages) == 1,
            "freed": freed, "n_params": len(params), "held": stats.held_bytes, "buffer": stats.buffer_bytes,
            "scratch": stats.scratch_bytes, "recv": stats.recv_payload_bytes,
            "gen_empty": all(prm.numel() == 0 for prm in gen_model.parameters()),
            "bit_identical": all(torch.equal(prm, before[n]) for n, prm in params.items())}
    results["gen_dp"] = (engine.gen_dp_rank, engine.gen_dp_size, engine.is_gen_collect_rank)
    results["rank"] = dist.get_rank()
    return results


@pytest.mark.parametrize("train,gen", LAYOUTS, ids=[f"{a}->{b}" for a, b in LAYOUTS])
def test_engine_in_place_round_trip(dist_pool, llama_8_heads, llama_8_heads_logits, train, gen):
    from hybridrl.hybrid_engine.accounting import account
    from hybridrl.hybrid_engine.model_shapes import model_shapes
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.parallel.generation import GenerationGroups, GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    input_ids, reference = llama_8_heads_logits
    bucket_mb = 1 / 1024  # 1 KiB: many pieces per tensor, the scratch stays within it
    results = dist_pool(4).run(_engine_round_trip, str(llama_8_heads), train, gen, input_ids, "hybrid", bucket_mb)
    layout, genl = ParallelLayout(tp=train[0], pp=train[1], dp=train[2]), GenerationLayout(tp=gen[0], pp=gen[1])
    plan = HybridEnginePlan(layout, genl, model_shapes(str(llama_8_heads)), dtype_bytes=4)
    costs = account(plan, "hybrid").ranks
    groups = GenerationGroups(layout, genl)
    for rank, res in enumerate(results):
        first, second = res[0], res[1]
        assert (first["logits"] - reference).abs().max().item() <= 1e-4, rank
        assert (second["logits"] - first["logits"]).abs().max().item() == 0.0, rank
        for r in (first, second):
            assert r["same_model"] and r["one_storage"] and r["gen_empty"] and r["bit_identical"], (rank, r)
            assert r["freed"] == r["n_params"], rank  # the generation buffer holds the only copy
            assert r["buffer"] == costs[rank].buffer_payload and r["recv"] == costs[rank].recv_payload, rank
            assert r["held"] == costs[rank].buffer_payload - plan.training_bytes(rank) + costs[rank].redundant
            assert r["scratch"] <= 1024, rank
        assert res["gen_dp"] == (groups.gen_dp_rank(rank), groups.gen_dp_size,
                                 groups.gen_shard(rank).gen_tp == 0), rank


def _ddp_step_between_generations(model_dir, input_ids):
    """(2,1,2) -> (1,1) under Megatron DDP + distributed optimizer: round trip, one Adam step, round trip."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from hybridrl.hybrid_engine.engine import HybridEngine
    from hybridrl.parallel.generation import GenerationLayout

    layout, hf_config, inner = _training_model(model_dir, (2, 1, 2))
    ddp = DistributedDataParallel(inner.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                  inner)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01,
                                                       use_distributed_optimizer=True), [ddp])
    tp_group, vocab = parallel_state.get_tensor_model_parallel_group(), hf_config.vocab_size
    engine = HybridEngine(ddp, hf_config, layout, GenerationLayout(tp=1))
    params = dict(inner.named_parameters())
    out = {}
    for step in range(2):
        train_logits = _gather_logits(inner, input_ids, tp_group, 2, vocab)
        before = {n: prm.detach().clone() for n, prm in params.items()}
        gen_logits = _gather_logits(engine.to_generation(), input_ids, None, 1, vocab)
        freed = all(prm.untyped_storage().nbytes() == 0 for prm in params.values())
        engine.to_training()
        out[step] = {"diff": (gen_logits - train_logits).abs().max().item(), "freed": freed,
                     "bit_identical": all(torch.equal(prm, before[n]) for n, prm in params.items()),
                     "logits": gen_logits}
        # one training step in the training layout (the restored storage is what DDP and the optimizer use)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand(input_ids.shape[0], -1)
        ddp(input_ids, positions, attention_mask=None).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        optimizer.step()
    return out


def test_engine_under_ddp_and_distributed_optimizer(dist_pool, llama_8_heads, llama_8_heads_logits):
    input_ids, _ = llama_8_heads_logits
    for rank, out in enumerate(dist_pool(4).run(_ddp_step_between_generations, str(llama_8_heads), input_ids)):
        for step in (0, 1):
            assert out[step]["freed"] and out[step]["bit_identical"], (rank, step)
            assert out[step]["diff"] <= 1e-5, (rank, step, out[step]["diff"])
        assert (out[1]["logits"] - out[0]["logits"]).abs().max().item() > 1e-3  # the step reached generation


def test_engine_refuses_bad_bucket(llama_8_heads):
    """Refused before any collective or model build, naming the option."""
    from hybridrl.hybrid_engine.engine import HybridEngine
    from hybridrl.models import load_hf_config
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    with pytest.raises(ValueError, match="bucket_mb"):
        HybridEngine(None, load_hf_config(str(llama_8_heads)), ParallelLayout(tp=4), GenerationLayout(tp=2), bucket_mb=0)


PP_LAYOUTS = [((2, 2, 1), (1, 2)), ((1, 4, 1), (1, 2))]


def _pipelined_generation_logits(model_dir, train_tpd, gen_tp_pp, input_ids):
    """A p_g = 2 generation model: stage 0 runs the embedding and its layers, sends the hidden states to stage
    1 over the generation PP group, stage 1 finishes; logits on the last stage."""
    import torch
    import torch.distributed as dist

    from hybridrl.hybrid_engine.engine import HybridEngine
    from hybridrl.parallel.generation import GenerationLayout

    tg, pg = gen_tp_pp
    layout, hf_config, train_model = _training_model(model_dir, train_tpd)
    before = {n: prm.detach().clone() for n, prm in train_model.named_parameters()}
    engine = HybridEngine(train_model, hf_config, layout, GenerationLayout(tp=tg, pp=pg), bucket_mb=1 / 256)
    gen_model = engine.to_generation()
    pp_group = gen_model.pg_collection.pp
    pp_ranks = dist.get_process_group_ranks(pp_group)
    stage = pp_group.rank()
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand(input_ids.shape[0], -1)
    logits = None
    with torch.no_grad():
        if stage > 0:
            hidden = torch.empty(input_ids.shape[1], input_ids.shape[0], hf_config.hidden_size)
            dist.recv(hidden, src=pp_ranks[stage - 1])
            gen_model.set_input_tensor(hidden)
        out = gen_model(input_ids, positions, attention_mask=None)
        if stage < pg - 1:
            dist.send(out.contiguous(), dst=pp_ranks[stage + 1])
        else:
            logits = out[..., :hf_config.vocab_size]
    layers = [m.layer_number for m in gen_model.decoder.layers]
    stats = engine.last_stats
    engine.to_training()
    identical = all(torch.equal(prm, before[n]) for n, prm in train_model.named_parameters())
    return {"stage": stage, "layers": layers, "logits": logits, "identical": identical, "held": stats.held_bytes}


@pytest.mark.parametrize("train,gen", PP_LAYOUTS, ids=[f"{a}->{b}" for a, b in PP_LAYOUTS])
def test_generation_model_with_two_stages(dist_pool, llama_8_heads, llama_8_heads_logits, train, gen):
    from hybridrl.hybrid_engine.accounting import account
    from hybridrl.hybrid_engine.model_shapes import model_shapes
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.parallel.generation import GenerationGroups, GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    input_ids, reference = llama_8_heads_logits
    results = dist_pool(4).run(_pipelined_generation_logits, str(llama_8_heads), train, gen, input_ids)
    layout, genl = ParallelLayout(tp=train[0], pp=train[1], dp=train[2]), GenerationLayout(tp=gen[0], pp=gen[1])
    plan = HybridEnginePlan(layout, genl, model_shapes(str(llama_8_heads)), dtype_bytes=4)
    costs, groups = account(plan, "hybrid").ranks, GenerationGroups(layout, genl)
    for rank, res in enumerate(results):
        shard = groups.gen_shard(rank)
        assert res["stage"] == shard.gen_pp and res["identical"], rank
        assert res["layers"] == [i + 1 for i in plan.gen_stage_layers(shard.gen_pp)], rank  # 1-based, global
        assert res["held"] == costs[rank].buffer_payload - plan.training_bytes(rank) + costs[rank].redundant
        if shard.gen_pp == gen[1] - 1:
            assert (res["logits"] - reference).abs().max().item() <= 1e-4, rank
