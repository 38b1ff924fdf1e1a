"""Fully sharded data parallel (`parallel.fsdp`): Megatron-Core's FSDP2 wrapper through gloo.

- the 3D-HybridEngine gathers fully sharded training shards (each TP shard cut in DP row blocks) straight into the
  generation buffer: every generation shard equals the Megatron slice, bytes received equal the plan's accounting,
  the training shards are bit-identical after the round trip (synthetic tensors, then a real Megatron GPT whose
  generation-layout logits equal the trained model's);
- one update under full_shard / shard_grad_op equals the no_shard update; resident parameter + gradient + optimizer
  bytes per rank are 1/dp of no_shard's;
- a fully sharded checkpoint resumes exactly, and resumes at tp=2 (no_shard) and back;
- settings: values, combinations refused with one line.
"""
from __future__ import annotations

import pytest

from hybridrl.hybrid_engine.model_shapes import GATED_HALVES, ModelShapes, ParamSpec
from test_hybrid_reshard import _megatron_shard  # how Megatron holds a TP shard of a full tensor

HIDDEN, FFN, LAYERS = 8, 16, 2
# (tp, dp) -> generation tp, on 4 or 2 ranks; VOCAB rows per TP shard do not always divide by dp (uneven pieces)
SYNTHETIC = [((2, 2), 1, 18), ((2, 2), 2, 16), ((1, 4), 1, 18), ((4, 1), 2, 16)]
SYNTHETIC_2 = [((1, 2), 1, 16), ((2, 1), 1, 16)]


def _specs(vocab: int) -> list[ParamSpec]:
    specs = [ParamSpec("embedding.word_embeddings.weight", (vocab, HIDDEN), 0, None, "embedding")]
    for layer in range(LAYERS):
        pre = f"decoder.layers.{layer}."
        specs += [ParamSpec(pre + "input_layernorm.weight", (HIDDEN,), None, layer, "layer"),
                  ParamSpec(pre + "self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), 0, layer, "layer"),
                  ParamSpec(pre + "self_attention.linear_proj.weight", (HIDDEN, HIDDEN), 1, layer, "layer"),
                  ParamSpec(pre + "mlp.linear_fc1.weight", (2 * FFN, HIDDEN), 0, layer, "layer", GATED_HALVES),
                  ParamSpec(pre + "mlp.linear_fc2.weight", (HIDDEN, FFN), 1, layer, "layer")]
    return specs + [ParamSpec("decoder.final_layernorm.weight", (HIDDEN,), None, None, "final"),
                    ParamSpec("output_layer.weight", (vocab, HIDDEN), 0, None, "final")]


def _reshard_fully_sharded(tp_dp, gen_tp, vocab, transport="auto", bucket_bytes=32 << 20):
    """This rank's FSDP2 rows of each TP shard -> the hybrid reshard -> its generation shard."""
    import torch
    import torch.distributed as dist

    from hybridrl.hybrid_engine.reshard import Resharder, ShardedParam
    from hybridrl.parallel.generation import GenerationGroups, GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    (t, d), specs = tp_dp, _specs(vocab)
    layout = ParallelLayout(tp=t, dp=d, fsdp="full_shard")
    groups = GenerationGroups(layout, GenerationLayout(tp=gen_tp))
    c = layout.coords(dist.get_rank())
    gen = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=gen) for s in specs}
    params = []
    for s in specs:
        whole = _megatron_shard(full[s.name], s, t, c.tp)
        first, rows = layout.fsdp_rows(whole.shape[0], c.dp)
        piece = whole[first:first + rows].clone()
        params.append(ShardedParam(s.name, piece, s.partition_dim, 0, s.regroup,
                                   (first, tuple(whole.shape)) if layout.dp_shards > 1 else None))
    originals = [p.tensor.clone() for p in params]
    shard = groups.gen_shard(dist.get_rank())
    expected = {s.name: _megatron_shard(full[s.name], s, gen_tp, shard.gen_tp) for s in specs}
    resharder = Resharder(groups, params, "hybrid", transport=transport, bucket_bytes=bucket_bytes)
    got = resharder.to_generation()
    report = {"mismatched": sorted(n for n in expected if not torch.equal(got[n], expected[n])),
              "recv": resharder.last_stats.recv_payload_bytes, "held": resharder.last_stats.held_bytes,
              "freed": sum(p.tensor.untyped_storage().nbytes() == 0 for p in params), "params": len(params)}
    resharder.to_training()
    report["bit_identical"] = all(torch.equal(p.tensor, o) for p, o in zip(params, originals))
    return report


def _check_synthetic(results, tp_dp, gen_tp, vocab):
    from hybridrl.hybrid_engine.accounting import account
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    layout = ParallelLayout(tp=tp_dp[0], dp=tp_dp[1], fsdp="full_shard")
    plan = HybridEnginePlan(layout, GenerationLayout(tp=gen_tp), ModelShapes("synthetic", tuple(_specs(vocab)),
                                                                            LAYERS, 8, 8), dtype_bytes=4)
    costs = account(plan, "hybrid").ranks
    for rank, got in enumerate(results):
        assert got["mismatched"] == [] and got["bit_identical"], (rank, got)
        assert got["recv"] == costs[rank].recv_payload, (rank, got["recv"], costs[rank])
        assert got["freed"] == got["params"], rank  # its rows' slot is the only copy while generating
        # extra memory while generating: the generation shard minus the rows it held (plus norms it does not own)
        assert got["held"] == costs[rank].buffer_payload - plan.training_bytes(rank) + costs[rank].redundant


@pytest.mark.parametrize("tp_dp,gen_tp,vocab", SYNTHETIC, ids=[f"{a}->{b}v{c}" for a, b, c in SYNTHETIC])
def test_fully_sharded_reshard_matches_slices_and_accounting(dist_pool, tp_dp, gen_tp, vocab):
    results = dist_pool(4).run(_reshard_fully_sharded, tp_dp, gen_tp, vocab)
    _check_synthetic(results, tp_dp, gen_tp, vocab)
    if tp_dp == (2, 2):  # the collectives NCCL runs, and row pieces smaller than a bucket
        results = dist_pool(4).run(_reshard_fully_sharded, tp_dp, gen_tp, vocab, "collective", 256)
        _check_synthetic(results, tp_dp, gen_tp, vocab)


@pytest.mark.parametrize("tp_dp,gen_tp,vocab", SYNTHETIC_2, ids=[f"{a}->{b}" for a, b, _ in SYNTHETIC_2])
def test_fully_sharded_reshard_two_ranks(dist_pool, tp_dp, gen_tp, vocab):
    _check_synthetic(dist_pool(2).run(_reshard_fully_sharded, tp_dp, gen_tp, vocab), tp_dp, gen_tp, vocab)


# ---- settings and the plan (no process started) ---------------------------------------------------------------
def _plan(*overrides: str):
    from hybridrl.cli.train import DEFAULT_CONFIG
    from hybridrl.config import load_config
    from hybridrl.trainer.plan import plan_run

    return plan_run(load_config(DEFAULT_CONFIG, ["resources.devices=4", *overrides]))


def test_plan_places_fully_sharded_roles():
    run = _plan("actor.parallel.fsdp=full_shard", "ref.parallel.fsdp=full_shard")
    actor, ref = run.roles["actor"].layout, run.roles["ref"].layout
    assert (actor.tp, actor.dp, actor.fsdp, actor.dp_shards) == (2, 2, "full_shard", 2)
    assert ref.fsdp == "full_shard" and ref == actor  # the same processes: fsdp is how each role wraps its model
    run = _plan("actor.parallel.fsdp=shard_grad_op")
    assert run.roles["actor"].layout.fsdp == "shard_grad_op" and run.roles["ref"].layout.fsdp == "no_shard"


@pytest.mark.parametrize("overrides,message", [
    (["actor.parallel.fsdp=zero3"], r"actor.parallel.fsdp='zero3': is not one of \['no_shard', 'shard_grad_op'"),
    (["actor.parallel.fsdp=full_shard", "actor.parallel.tp=1", "actor.parallel.pp=2"],
     "fsdp=full_shard with pp=2: Megatron-Core's fully sharded data parallel does not run with pipeline"),
    (["actor.parallel.fsdp=full_shard", "rollout.reshard=ds_chat"], "rollout.reshard=ds_chat with actor.parallel.fsdp"),
    (["actor.parallel.fsdp=full_shard", "resources.pools={gen: 2}", "rollout.pool=gen", "actor.parallel.tp=1",
      "resources.devices=2"], "rollout.pool='gen' with actor.parallel.fsdp=full_shard"),
    (["actor.model.path=tiny:qwen3_moe", "actor.parallel.fsdp=full_shard", "actor.parallel.sequence_parallel=true"],
     "mixture-of-experts model"),
    (["actor.parallel.fsdp=full_shard", "actor.lora.rank=4"], "actor.lora with actor.parallel.fsdp=full_shard"),
    (["actor.parallel.fsdp=shard_grad_op", "actor.offload.optimizer=true"],
     r"actor.offload \(grads / optimizer\) with actor.parallel.fsdp=shard_grad_op"),
])
def test_fully_sharded_combinations_refused_in_one_line(overrides, message):
    from hybridrl.config import ConfigError

    with pytest.raises(ConfigError, match=message) as info:
        _plan(*overrides)
    assert "\n" not in str(info.value)


def test_short_api_layout_and_refusals():
    from hybridrl.config import ParallelConfig
    from hybridrl.parallel.layout import LayoutError, ParallelLayout, role_layout
    from hybridrl.roles.actor import check_generation
    from hybridrl.config import RolloutConfig

    held = ("actor", role_layout(ParallelConfig(tp=2, fsdp="full_shard"), 4, "actor", "pool"))
    ref = role_layout(ParallelConfig(), 4, "ref", "pool", held)
    assert ref == held[1] and ref.fsdp == "no_shard" and held[1].fsdp == "full_shard"
    with pytest.raises(LayoutError, match="expert parallelism"):
        ParallelLayout(dp=4, ep=2, fsdp="full_shard")
    with pytest.raises(ValueError, match="rollout.reshard=hybridflow_v"):
        check_generation(RolloutConfig(reshard="hybridflow_v"), held[1])
    # the short API refuses what the plan refuses, before Ray starts
    import ray

    import hybridrl

    with pytest.raises(ValueError, match="actor.lora with actor.parallel.fsdp=full_shard"):
        hybridrl.Actor(parallel_config={"fsdp": "full_shard"}, lora={"rank": 4})
    with pytest.raises(ValueError, match=r"critic.offload \(grads / optimizer\) with critic.parallel.fsdp=shard_grad_op"):
        hybridrl.Critic(parallel={"fsdp": "shard_grad_op"}, offload={"grads": True})
    assert not ray.is_initialized()


def test_plan_accounts_the_dp_shard_dimension(capsys):
    """`hybridrl plan --train-fsdp`: a rank receives its generation shard minus its own rows (Table 2 with d)."""
    import json
    from fractions import Fraction

    from hybridrl.cli import main
    from hybridrl.hybrid_engine.accounting import account, table2
    from hybridrl.hybrid_engine.model_shapes import ModelShapes
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    assert main(["plan", "--model", "llama-7b", "--train-tp", "8", "--train-dp", "2", "--gen-tp", "2",
                 "--train-fsdp", "full_shard", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["model_bytes"]
    hybrid = report["strategies"]["hybrid"]
    assert report["train"]["fsdp"] == "full_shard" and set(report["strategies"]) == {"hybrid", "ds_chat"}
    assert report["fsdp_gather_groups"][0] == [0, 1, 2, 3, 8, 9, 10, 11]  # the d micro-DP groups of a gen shard
    assert hybrid["redundant_bytes_per_gpu_max"] < 1e-4 * m  # only norms another TP rank contributes
    assert hybrid["peak_extra_bytes_per_gpu"] == pytest.approx(m / 2, rel=1e-3)  # M' (norms once per t_g rank)
    assert hybrid["bytes_per_gpu_mean"] == pytest.approx(m / 2 - m / 16, rel=1e-3)
    # every tensor partitioned: the per-rank means are Table 2's fully sharded formula exactly
    specs = tuple(s for s in _specs(16) if s.partition_dim is not None and s.section == "layer")
    train, gen = ParallelLayout(tp=2, dp=2, fsdp="full_shard"), GenerationLayout(tp=1)
    plan = HybridEnginePlan(train, gen, ModelShapes("synthetic", specs, LAYERS, 8, 8), dtype_bytes=2)
    cost = account(plan, "hybrid")
    want = table2("hybrid", plan.model_bytes, train, gen)
    assert cost.mean("recv_payload") == want["comm"] == Fraction(3, 4) * plan.model_bytes
    assert cost.mean("buffer_payload") == want["peak"] and cost.max("redundant") == 0


# ---- a real Megatron GPT (the embedded tiny Llama) through Megatron-Core's FSDP2 wrapper -----------------------
def _rollout_batch(rows: int = 8, seed: int = 0):
    """Rollout-shaped rows (prompts, responses, masks) with per-token advantages."""
    import torch

    from hybridrl.protocol import Batch

    gen = torch.Generator().manual_seed(seed)
    prompts, responses = torch.randint(3, 64, (rows, 5), generator=gen), torch.randint(3, 64, (rows, 6), generator=gen)
    mask = torch.ones(rows, 11, dtype=torch.long)
    mask[1, 9:], mask[3, :2] = 0, 0  # a short response, a left-padded prompt
    response_mask = mask[:, 5:].clone()
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, 6) * response_mask
    return Batch({"prompts": prompts, "responses": responses, "attention_mask": mask, "response_mask": response_mask,
                  "advantages": advantages.contiguous()})


def _actor(tp: int, fsdp: str, optimizer: str = "adam", lr: float = 1e-2, distributed: bool = True):
    import torch

    from hybridrl.config import OptimConfig
    from hybridrl.models.tiny import default_model_dir
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.workers.megatron_model import MegatronModel

    layout = ParallelLayout(tp=tp, dp=torch.distributed.get_world_size() // tp, fsdp=fsdp)
    initialize_model_parallel(layout)
    optim = OptimConfig(optimizer=optimizer, lr=lr, clip_grad=1e9, use_distributed_optimizer=distributed)
    return layout, MegatronModel(str(default_model_dir()), optim=optim, fsdp=fsdp, max_tokens_per_micro_batch=24)


def _step(layout, model, seed: int) -> dict:
    import torch

    from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms

    data = _rollout_batch(seed=seed).chunk(layout.dp)[layout.coords(torch.distributed.get_rank()).dp]
    tp_group = model.tp_group if model.tp > 1 else None
    return model.train_epochs(data, lambda mb, out: actor_loss_terms(mb, out, model.vocab_size, tp_group,
                                                                     PolicyLossConfig()), ["response_mask", "advantages"])


def _weights(model) -> dict:
    """The whole model as Hugging Face tensors on rank 0 (collective)."""
    from hybridrl.models.checkpoint_hf import gather_hf_state_dict
    from hybridrl.workers.sharding import gathered_parameters

    with gathered_parameters(model.model):
        return gather_hf_state_dict(model.model, model.hf_config)


def _update(tp: int, fsdp: str):
    """One SGD step (lr 1: the weight change is the gradient) and the bytes the rank holds for the model."""
    from hybridrl.workers.sharding import resident_bytes

    layout, model = _actor(tp, fsdp, optimizer="sgd", lr=1.0, distributed=False)
    metrics = _step(layout, model, seed=0)
    return metrics, _weights(model), resident_bytes(model.model, model.optimizer)


def _max_rel(got: dict, want: dict) -> float:
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)


def test_fully_sharded_update_equals_no_shard(dist_pool):
    pool = dist_pool(4)
    unsharded = pool.run(_update, 1, "no_shard")  # Megatron DDP, plain SGD: every rank holds it all
    reference = unsharded[0]
    initial = _initial_weights()
    for tp, fsdp in [(1, "full_shard"), (2, "full_shard"), (1, "shard_grad_op")]:
        results = pool.run(_update, tp, fsdp)
        metrics, weights, _ = results[0]
        if tp == 1:  # parameters + gradients resident per rank: 1/dp of the unsharded run's (dp = 4)
            for (*_, held), (*_, full) in zip(results, unsharded):
                assert held / full == pytest.approx(1 / 4, rel=0.02), (fsdp, held, full)
        assert metrics["update_ok"] == 1.0
        assert metrics["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-6)
        steps = {k: initial[k] - weights[k] for k in initial}
        want = {k: initial[k] - reference[1][k] for k in initial}
        assert _max_rel(steps, want) <= 1e-5, (tp, fsdp)


def _initial_weights() -> dict:
    from hybridrl.models.tiny import default_model_dir
    from safetensors.torch import load_file
    import glob

    out = {}
    for f in glob.glob(f"{default_model_dir()}/*.safetensors"):
        out.update(load_file(f))
    return out


def _engine(tp: int, gen_tp: int):
    """An Adam step at fsdp, then the hybrid engine: generation-layout logits, bytes, the round trip."""
    import torch
    import torch.distributed as dist

    from hybridrl.hybrid_engine.engine import HybridEngine
    from hybridrl.hybrid_engine.megatron_adapter import training_params
    from hybridrl.parallel.generation import GenerationLayout

    layout, model = _actor(tp, "full_shard")
    _step(layout, model, seed=0)
    engine = HybridEngine(model.model, model.hf_config, layout, GenerationLayout(tp=gen_tp))
    before = [p.tensor.clone() for p in training_params(model.model, 0)]
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        trained = model.model(ids, positions, attention_mask=None)  # the training layout (FSDP2 gathers per layer)
        gen_model = engine.to_generation()
        generated = gen_model(ids, positions, attention_mask=None)
    stats = engine.last_stats
    parts = [torch.empty_like(generated) for _ in range(gen_tp)]
    dist.all_gather(parts, generated.contiguous(), group=engine.tp_group)
    full_trained = [torch.empty_like(trained) for _ in range(tp)]
    dist.all_gather(full_trained, trained.contiguous(), group=model.tp_group)
    engine.to_training()
    after = [p.tensor for p in training_params(model.model, 0)]
    return {"diff": float((torch.cat(parts, -1) - torch.cat(full_trained, -1)).abs().max()),
            "recv": stats.recv_payload_bytes, "held": stats.held_bytes, "identity": engine.identity,
            "bit_identical": all(torch.equal(a, b) for a, b in zip(before, after)),
            "local_bytes": sum(t.numel() * t.element_size() for t in before)}


@pytest.mark.parametrize("tp,gen_tp", [(2, 1), (1, 1)])
def test_engine_gathers_fully_sharded_megatron_shards(dist_pool, tp, gen_tp):
    from hybridrl.hybrid_engine.accounting import account
    from hybridrl.hybrid_engine.model_shapes import model_shapes
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.models.tiny import default_model_dir
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout

    results = dist_pool(4).run(_engine, tp, gen_tp)
    layout = ParallelLayout(tp=tp, dp=4 // tp, fsdp="full_shard")
    plan = HybridEnginePlan(layout, GenerationLayout(tp=gen_tp), model_shapes(str(default_model_dir())),
                            dtype_bytes=4)
    costs = account(plan, "hybrid").ranks
    for rank, got in enumerate(results):
        assert not got["identity"] and got["bit_identical"], rank
        assert got["diff"] <= 1e-5, (rank, got["diff"])
        assert got["local_bytes"] == plan.training_bytes(rank), rank
        assert got["recv"] == costs[rank].recv_payload > 0, (rank, got["recv"], costs[rank])


def _run_steps(tp: int, fsdp: str, steps: list[int], load: str | None = None, save: str | None = None):
    """Adam steps on the batches `steps` (seeds), resuming from `load` first and saving to `save` after."""
    import torch

    layout, model = _actor(tp, fsdp)
    if load:
        model.load_checkpoint(load)
    for seed in steps:
        _step(layout, model, seed)
    if save:
        from test_megatron_cpu import _children_allowed  # the DistPool's ranks are daemonic

        with _children_allowed():
            model.save_checkpoint(save)
    torch.distributed.barrier()
    return _weights(model), model.steps


def test_fully_sharded_checkpoint_resumes_exactly_and_across_layouts(dist_pool, tmp_path):
    pool = dist_pool(4)
    straight = pool.run(_run_steps, 2, "full_shard", [0, 1, 2])[0]  # three steps, uninterrupted
    pool.run(_run_steps, 2, "full_shard", [0], save=str(tmp_path / "fsdp_1"))
    resumed = pool.run(_run_steps, 2, "full_shard", [1, 2], load=str(tmp_path / "fsdp_1"))[0]
    assert resumed[1] == straight[1] == 3
    assert all(torch_equal(resumed[0][k], straight[0][k]) for k in straight[0])  # exact resume
    # fully sharded (tp=1 x dp=4) -> Megatron DDP + distributed optimizer at tp=2 x dp=2 -> fully sharded again:
    # the state passes through the TP layout losslessly (the next step is bit-identical)
    pool.run(_run_steps, 1, "full_shard", [0], save=str(tmp_path / "fsdp_dp4"))
    pool.run(_run_steps, 2, "no_shard", [], load=str(tmp_path / "fsdp_dp4"), save=str(tmp_path / "tp2"))
    direct = pool.run(_run_steps, 1, "full_shard", [1], load=str(tmp_path / "fsdp_dp4"))[0]
    back = pool.run(_run_steps, 1, "shard_grad_op", [1], load=str(tmp_path / "tp2"))[0]
    assert back[1] == direct[1] == 2
    assert all(torch_equal(back[0][k], direct[0][k]) for k in direct[0])
    # and training goes on at the TP layout from the fully sharded state (Adam's moments included: without them
    # the step would differ by ~lr everywhere; at another layout Adam amplifies float noise where gradients are ~0)
    at_tp = pool.run(_run_steps, 2, "no_shard", [1], load=str(tmp_path / "fsdp_dp4"))[0]
    fresh_moments = pool.run(_run_steps_weights_only, 2, str(tmp_path / "fsdp_dp4"))[0]
    assert at_tp[1] == 2 and _max_rel(at_tp[0], direct[0]) <= 5e-3 < _max_rel(fresh_moments, direct[0])


def _run_steps_weights_only(tp: int, load: str):
    layout, model = _actor(tp, "no_shard")
    model.load_checkpoint(load, load_optimizer=False)
    _step(layout, model, 1)
    return _weights(model)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


# ---- the short API on Ray: one actor update equals plain PyTorch; the rollout's log-probs equal the trainer's -----
PROMPTS = ["vowels: qzkt", "vowels: bcdf", "vowels: rkjm", "vowels: lfkp"] * 2


@pytest.mark.slow
@pytest.mark.parametrize("devices,tp", [(2, 1), (4, 2)], ids=["fsdp_dp2", "tp2_x_fsdp_dp2"])
def test_fully_sharded_actor_update_equals_pytorch(dist_pool, ray_four_devices, tmp_path, devices, tp):
    import torch
    from transformers import AutoModelForCausalLM

    import hybridrl
    from hybridrl.models.tiny import default_model_dir
    from test_short_api import _hf_policy_gradient  # the reference of the TP=2 x DP=2 test

    for pool in list(dist_pool.pools.values()):  # the gloo pools of the tests above: their memory back first
        pool.close()
    path = str(default_model_dir())
    pool = hybridrl.ResourcePool(devices=devices, name=f"fsdp{devices}")
    try:
        actor = hybridrl.Actor(parallel={"tp": tp, "fsdp": "full_shard"}, rollout={"tp": 1, "max_new_tokens": 8},
                               resource_pool=pool, optim={"optimizer": "sgd", "lr": 1.0, "clip_grad": 1e9},
                               max_tokens_per_micro_batch=48)
        assert (actor.layout.tp, actor.layout.dp, actor.layout.fsdp) == (tp, devices // tp, "full_shard")
        out = actor.generate_sequences(PROMPTS, seed=3)  # generation from the gathered fully sharded shards
        trainer_log_probs = actor.compute_log_probs(out.sequences)
        advantages = torch.randn(len(out), generator=torch.Generator().manual_seed(0))
        metrics = actor.update(actions=out, advantages=advantages)
        actor.save_hf(str(tmp_path / "trained"))
    finally:
        pool.shutdown()
    assert ((out.log_probs - trainer_log_probs) * out.mask).abs().max() <= 1e-4
    assert metrics["update_ok"] == 1.0
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    reference = _hf_policy_gradient(path, out.sequences, advantages)  # SGD, lr 1: the step is the gradient
    for name, grad in reference.items():
        step = initial[name] - trained[name]
        assert (step - grad).abs().max() <= 1e-5 * max(1.0, grad.abs().max().item()), name
    total_norm = torch.sqrt(sum(g.square().sum() for g in reference.values())).item()
    assert metrics["grad_norm"] == pytest.approx(total_norm, rel=1e-5)
