"""Mixture-of-experts models (issue 15, first part): Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral built as
Megatron-Core MoE GPTModels from their HF checkpoints equal transformers, with expert parallelism over gloo.

One long-lived 4-rank pool; references from transformers in a clean subprocess (their fused in-memory experts
named back to the checkpoint's per-expert tensors). Checks at TP=1/EP=1, TP=1/EP=2, TP=2/EP=2 and PP=2/EP=2:
logits (fp32, <= 1e-4), loss, every parameter's gradient under its HF name (<= 1e-5), and the router's top-k
choices against transformers' own router on the same hidden states. Expert TP below TP (expert_tp=1 at TP=2,
with EP=2 and EP=4: the expert-parallel groups then span TP ranks) and above it (expert_tp=2 at TP=1, EP=2: an
expert-TP group spans DP replicas) are checked the same way.
"""
from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path

import pytest
import torch

from hybridrl.envs.bundled import CharsetTurnsEnv
from hybridrl.models.tiny import create_tiny_model
from hybridrl.parallel.layout import LayoutError, ParallelLayout

from reference_model import hf_reference  # tests/: transformers' outputs in a clean process

WORLD = 4
# Megatron's MoE layers need sequence parallelism beside TP in training
LAYOUTS = [ParallelLayout(tp=1, dp=4), ParallelLayout(tp=1, dp=4, ep=2),
           ParallelLayout(tp=2, dp=2, ep=2, sequence_parallel=True), ParallelLayout(tp=1, pp=2, dp=2, ep=2),
           ParallelLayout(tp=2, dp=2, ep=2, etp=1, sequence_parallel=True),
           ParallelLayout(tp=2, dp=2, ep=4, etp=1, sequence_parallel=True), ParallelLayout(tp=1, dp=4, ep=2, etp=2)]
BATCH, SEQ, VOCAB = 2, 16, 128
ATOL, GRAD_ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    common = {"vocab_size": VOCAB, "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2}
    return {
        # top-k renormalised, q/k norms, the second layer dense (mlp_only_layers)
        "qwen3_moe": create_tiny_model(root / "qwen3_moe", "qwen3_moe", seed=0, dense_layers=(1,), **common),
        # softmax over all experts then top-k (no renormalisation), a shared expert with its sigmoid gate, qkv bias
        "qwen2_moe": create_tiny_model(root / "qwen2_moe", "qwen2_moe", seed=1, norm_topk_prob=False, **common),
        "mixtral": create_tiny_model(root / "mixtral", "mixtral", seed=2, **common),
    }


@pytest.fixture(autouse=True)
def _fresh_pool_after_each_test(dist_pool):
    """Every HybridEngine a test builds adds gloo process groups (threads in each rank) that live as long as the
    process: close the pool after each test, the next one starts it afresh."""
    yield
    if WORLD in dist_pool.pools:
        dist_pool.pools[WORLD].close()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)


def _moe_step(model_dir: str, layout: ParallelLayout, input_ids: torch.Tensor, labels: torch.Tensor):
    """One forward + backward at `layout`; rank 0 returns logits, loss, {HF name: full grad} and, per MoE layer,
    the experts chosen for every token ([b, s, experts] bool)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, vocab_parallel_cross_entropy

    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights, named_global_parameters
    from hybridrl.models.families import tp_gather, tp_partition_dim
    from hybridrl.parallel.distributed import initialize_model_parallel

    initialize_model_parallel(layout)
    hf_config = load_hf_config(model_dir)
    model = build_gpt_model(hf_config, sequence_parallel=layout.sequence_parallel)
    load_hf_weights(model, model_dir, hf_config)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    outputs, chosen = {}, {}
    for layer in model.decoder.layers:  # the experts each token goes to (the router's routing map)
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            def keep(module, args, out, number=layer.layer_number - 1):
                chosen[number] = out[1].detach().reshape(-1, BATCH, out[1].shape[-1]).clone()  # [s (/ tp), b, E]
            router.register_forward_hook(keep)

    def loss_func(output):
        loss_per_token, logits = output
        outputs["logits"] = gather_from_tensor_model_parallel_region(logits.detach())
        loss = loss_per_token.float().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, chunk):
        output = chunk(input_ids, positions, attention_mask=None)
        if not ps.is_pipeline_last_stage():
            return output, loss_func
        loss = vocab_parallel_cross_entropy(output.transpose(0, 1).contiguous().float(), labels.t().contiguous())
        return (loss, output), loss_func

    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                         num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH)
    tp_group = ps.get_tensor_model_parallel_group()
    for number, mask in sorted(chosen.items()):  # [b, s, E]; sequence parallel: each TP rank routed a slice
        if layout.sequence_parallel:
            parts = [torch.empty_like(mask) for _ in range(layout.tp)]
            dist.all_gather(parts, mask.contiguous(), group=tp_group)
            mask = torch.cat(parts, dim=0)
        chosen[number] = mask.transpose(0, 1)
    # every DP replica ran the same batch: the tokens of the DP replicas inside one expert-TP x EP group all
    # reached each expert, so an expert's grad is ep * expert_tp / tp times the single batch's
    experts = {}
    grads = {}
    expert_tp_group = ps.get_expert_tensor_parallel_group()
    for name, param in named_global_parameters(model):
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        is_expert = ".local_experts." in name
        if is_expert:
            grad = grad * layout.tp / (layout.ep * layout.expert_tp)
        if getattr(param, "sequence_parallel", False):  # each TP rank holds a partial norm / router grad
            grad = grad.clone()
            dist.all_reduce(grad, group=tp_group)
        dim = tp_partition_dim(param)
        size, group = (layout.expert_tp, expert_tp_group) if is_expert else (layout.tp, tp_group)
        if dim is not None and size > 1:
            shards = [torch.empty_like(grad) for _ in range(size)]
            dist.all_gather(shards, grad.contiguous(), group=group)
            grad = tp_gather(name, shards, dim)
        for hf_name, tensor in model.hybridrl_family.to_hf(name, grad, hf_config, "lm"):
            (experts if is_expert else grads)[hf_name] = tensor
    # each tensor from one rank: TP rank 0 of DP replica 0 (experts: expert-TP rank 0 of each expert-parallel rank)
    tp0 = ps.get_tensor_model_parallel_rank() == 0
    last = ps.is_pipeline_last_stage()
    expert_owner = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    mine = {"grads": grads if tp0 and ps.get_data_parallel_rank() == 0 else {},
            "experts": experts if expert_owner else {},
            "logits": outputs.get("logits") if tp0 and last and ps.get_data_parallel_rank() == 0 else None,
            "loss": float(losses[0]["loss"]) if tp0 and last and ps.get_data_parallel_rank() == 0 else None,
            "chosen": chosen if tp0 and ps.get_data_parallel_rank() == 0 else {}}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    merged = {"grads": {}, "logits": None, "loss": None, "chosen": {}}
    for item in gathered:
        for key in ("grads", "experts"):
            for name, tensor in item[key].items():
                assert name not in merged["grads"], f"{name} came from two ranks"
                merged["grads"][name] = tensor
        merged["chosen"].update(item["chosen"])
        merged["logits"] = item["logits"] if item["logits"] is not None else merged["logits"]
        merged["loss"] = item["loss"] if item["loss"] is not None else merged["loss"]
    return merged


def _hf_choices(model_dir: str, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """transformers' routing map per MoE layer: [b, s, experts] bool, from its router's top-k on the hidden
    states entering that layer's MLP."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    choices = {}
    for number, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue

        def keep(module, args, out, number=number):
            hidden = args[0].reshape(-1, args[0].shape[-1])
            logits = torch.nn.functional.linear(hidden, module.weight)
            top = logits.topk(model.config.num_experts_per_tok, dim=-1).indices
            choices[number] = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top, True).reshape(BATCH, SEQ, -1)
        gate.register_forward_hook(keep)
    with torch.no_grad():
        model(input_ids)
    return choices


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_logits_grads_and_routing_match_transformers_with_expert_parallelism(dist_pool, moe_models, family):
    model_dir = str(moe_models[family])
    input_ids, labels = _batch()
    ref = hf_reference(model_dir, input_ids, labels)
    hf_chosen = _hf_choices(model_dir, input_ids)
    assert hf_chosen, "the reference found no MoE layer"
    pool = dist_pool(WORLD)
    for layout in LAYOUTS:
        result = pool.run(_moe_step, model_dir, layout, input_ids, labels)[0]
        where = f"{family} at {layout.describe()}"
        diff = (result["logits"][..., :VOCAB] - ref.logits).abs().max().item()
        assert diff <= ATOL, f"{where}: logits differ from transformers by {diff}"
        assert abs(result["loss"] - ref.loss) <= ATOL, where
        assert set(result["grads"]) == set(ref.grads), (where, set(result["grads"]) ^ set(ref.grads))
        for name, grad in ref.grads.items():
            diff = (result["grads"][name] - grad).abs().max().item()
            assert diff <= GRAD_ATOL, f"{where}: grad of {name} differs by {diff}"
        assert set(result["chosen"]) == set(hf_chosen), where
        for number, mask in hf_chosen.items():
            assert torch.equal(result["chosen"][number].bool(), mask), f"{where}: layer {number} routes differently"


def test_expert_parallel_layout_is_checked_against_the_model():
    with pytest.raises(LayoutError, match="ep=3 must divide dp=4"):
        ParallelLayout(dp=4, ep=3)
    with pytest.raises(LayoutError, match="needs a mixture-of-experts model"):
        ParallelLayout(dp=2, ep=2).check_model(4, 2, 2, num_experts=0)
    with pytest.raises(LayoutError, match=r"choose ep in \[1, 2, 4\]"):
        ParallelLayout(dp=3, ep=3).check_model(4, 2, 2, num_experts=4)
    with pytest.raises(LayoutError, match=r"intermediate size 6 is not divisible by max\(tp, expert_tp\) = 4"):
        ParallelLayout(tp=1, dp=8, ep=2, etp=4).check_model(4, 2, 2, num_experts=4, expert_ffn_hidden=6)


# ---- conversion ------------------------------------------------------------------------------------------
def _megatron_names(family, config) -> list[str]:
    """Every Megatron parameter name (global layers and experts) of an MoE config."""
    from hybridrl.models.families import ModelDims

    d = ModelDims.from_hf(config)
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i in range(d.num_layers):
        layer = f"decoder.layers.{i}."
        names += [layer + n for n in ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                                      "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight")]
        names += [layer + f"self_attention.{q}_layernorm.weight" for q in "qk"] if family.qk_norm else []
        names += [layer + "self_attention.linear_qkv.bias"] if family.qkv_bias else []
        if not d.moe.layers[i]:
            names += [layer + "mlp.linear_fc1.weight", layer + "mlp.linear_fc2.weight"]
            continue
        names.append(layer + "mlp.router.weight")
        names += [layer + f"mlp.experts.local_experts.{e}.linear_fc{k}.weight" for e in range(d.moe.num_experts)
                  for k in (1, 2)]
        if family.moe.shared:
            names += [layer + f"mlp.shared_experts.{n}" for n in ("linear_fc1.weight", "linear_fc2.weight",
                                                                  "gate_weight")]
    return names


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_to_hf_inverts_from_hf_for_every_moe_parameter(name):
    from hybridrl.models.families import FAMILIES
    from hybridrl.models.tiny import tiny_hf_config

    family = FAMILIES[name]
    dense = (1,) if name != "mixtral" else ()  # Mixtral has experts in every layer
    config = tiny_hf_config(name, layers=3, hidden=32, heads=4, kv_heads=2, dense_layers=dense)
    shapes = family.expected_hf_tensors(config)
    gen = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(shape, generator=gen) for n, shape in shapes.items()}
    seen = {}
    for mcore_name in _megatron_names(family, config):
        seen.update(dict(family.to_hf(mcore_name, family.from_hf(mcore_name, hf.__getitem__, config), config)))
    assert set(seen) == set(hf)
    assert all(torch.equal(seen[n], hf[n]) for n in hf)


@pytest.mark.slow
def test_convert_with_expert_parallelism_round_trips_bit_exact(moe_models, tmp_path, capsys):
    """HF -> Megatron at TP=2 x EP=2 (4 processes, 2 experts each) -> HF at PP=2 x EP=2: every tensor equal. The same
    with expert TP 1 on either side (2 processes at TP=2 x EP=2, each rank one whole block of experts -> 4 at EP=4),
    and from expert TP 2 above TP=1 (4 processes: each expert split over two DP replicas) to expert TP 1."""
    from hybridrl.cli import main as cli_main
    from safetensors.torch import load_file

    source = moe_models["qwen2_moe"]
    original = load_file(str(source / "model.safetensors"))
    trips = ((["--tp", "2", "--ep", "2"], ["--pp", "2", "--ep", "2"]),
             (["--tp", "2", "--ep", "2", "--expert-tp", "1"], ["--tp", "2", "--ep", "4", "--expert-tp", "1"]),
             (["--ep", "2", "--expert-tp", "2"], ["--tp", "2", "--ep", "2", "--expert-tp", "1"]))
    for i, (to_mcore, to_hf) in enumerate(trips):
        mcore, back = tmp_path / f"mcore{i}", tmp_path / f"back{i}"
        assert cli_main(["convert", "--from", "hf", "--to", "mcore", *to_mcore, str(source), str(mcore)]) == 0
        assert cli_main(["convert", "--from", "mcore", "--to", "hf", *to_hf, str(mcore), str(back)]) == 0
        exported = load_file(str(back / "model.safetensors"))
        assert set(original) == set(exported), (to_mcore, to_hf)
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), (to_mcore, to_hf, name)
    assert cli_main(["convert", "--from", "hf", "--to", "mcore", "--ep", "3", str(source), str(tmp_path / "bad")]) == 2
    assert "ep=3 needs a mixture-of-experts model whose experts it divides (the model has 4)" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


# ---- the 3D-HybridEngine with experts ----------------------------------------------------------------------
def _moe_engine_round_trip(model_dir: str, layout: ParallelLayout, input_ids: torch.Tensor, bucket_mb: float,
                           gen_tp: int = 1, gen_ep: int = 1):
    """Training model at `layout` -> generation model at t_g = gen_tp, e_g = gen_ep; returns per rank the
    generation logits, the expert bytes received (and the bytes this rank's experts hold), and whether the
    training weights came back bit-identical with the gathered experts' buffers freed."""
    from megatron.core import parallel_state as ps

    from hybridrl.hybrid_engine.engine import HybridEngine
    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.models.families import expert_number
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.generation import GenerationLayout

    initialize_model_parallel(layout)
    hf_config = load_hf_config(model_dir)
    model = build_gpt_model(hf_config, sequence_parallel=layout.sequence_parallel)
    load_hf_weights(model, model_dir, hf_config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = HybridEngine(model, hf_config, layout, GenerationLayout(tp=gen_tp, ep=gen_ep), bucket_mb=bucket_mb)
    local_expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                             if expert_number(n) is not None)
    gen = engine.to_generation()
    gen_shapes = engine._gen_shapes
    with torch.no_grad():
        logits = gen(input_ids, torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1), None,
                     runtime_gather_output=True)
    stats = engine.last_stats
    received = stats.extra.get("expert_recv_bytes", 0)
    engine.to_training()
    restored = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    freed = all(p.tensor.untyped_storage().size() == 0 for p in engine.experts.remote) if engine.experts else True
    gen_experts = sorted({expert_number(n) for n in gen_shapes if expert_number(n) is not None})
    return {"logits": logits[..., :VOCAB], "received": received, "local_expert_bytes": local_expert_bytes,
            "ep": ps.get_expert_model_parallel_world_size(), "restored": restored, "freed": freed,
            "buckets": len(engine.experts.buckets) if engine.experts else 0, "recv": stats.recv_payload_bytes,
            "buffer": stats.buffer_bytes, "held": stats.held_bytes, "gen_experts": gen_experts,
            "expert_messages": engine.experts.messages if engine.experts else 0}


@pytest.mark.slow
def test_hybrid_engine_gathers_the_experts_of_expert_parallel_ranks(dist_pool, moe_models, tmp_path):
    """Training EP=2 (TP=1 and TP=2 with SP) -> generation t_g=1 or 2, e_g=1: each rank receives exactly the other
    expert-parallel rank's experts ((ep - 1) x its own expert bytes), the generation logits equal transformers',
    and going back leaves the training weights bit-identical and the gathered experts freed; with a small
    bucket the experts travel in several all-gathers, with the same result. Bytes received, the generation
    buffer and the memory held while generating equal the plan's accounting of that rank. Expert TP 1 at TP=2
    (EP=2 and EP=4, the expert-parallel groups spanning TP ranks): the experts are regrouped into the dense TP
    layout by point-to-point messages (one per other expert block and bucket), with the same checks; at TP=4 with
    expert TP 2 (4 kv heads) half the ranks hold no piece of even their own block and receive every block. Expert
    TP 2 at TP=1 (an expert split over two DP replicas): each rank's dense shard of an expert is joined from two
    ranks' halves (one message per piece it does not hold and bucket)."""
    from hybridrl.hybrid_engine.accounting import account
    from hybridrl.hybrid_engine.model_shapes import model_shapes
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.parallel.generation import GenerationLayout

    input_ids, _ = _batch()
    wide = str(create_tiny_model(tmp_path / "mixtral_kv4", "mixtral", seed=3, vocab_size=VOCAB, hidden=32, layers=2,
                                 heads=4, kv_heads=4))
    refs = {path: hf_reference(path, input_ids) for path in (str(moe_models["mixtral"]), wide)}
    pool = dist_pool(WORLD)
    regrouped = [ParallelLayout(tp=2, dp=2, ep=2, etp=1, sequence_parallel=True),
                 ParallelLayout(tp=2, dp=2, ep=4, etp=1, sequence_parallel=True),
                 ParallelLayout(tp=4, dp=1, ep=2, etp=2, sequence_parallel=True),
                 ParallelLayout(tp=1, dp=4, ep=2, etp=2)]
    for layout, bucket_mb, gen_tp in ((ParallelLayout(tp=1, dp=4, ep=2), 32.0, 1),
                                      (ParallelLayout(tp=2, dp=2, ep=2, sequence_parallel=True), 0.02, 1),
                                      (ParallelLayout(tp=2, dp=2, ep=2, sequence_parallel=True), 32.0, 2),
                                      (regrouped[0], 32.0, 1), (regrouped[0], 0.02, 2), (regrouped[1], 0.02, 1),
                                      (regrouped[1], 32.0, 2), (regrouped[2], 32.0, 1), (regrouped[2], 0.02, 2),
                                      (regrouped[3], 0.02, 1), (regrouped[3], 32.0, 1)):
        model_dir = wide if layout.tp == 4 else str(moe_models["mixtral"])
        ref = refs[model_dir]
        plan = HybridEnginePlan(layout, GenerationLayout(tp=gen_tp), model_shapes(model_dir), dtype_bytes=4)
        costs = account(plan, "hybrid").ranks
        first = plan.expert_first_stage()
        for rank, out in enumerate(pool.run(_moe_engine_round_trip, model_dir, layout, input_ids, bucket_mb, gen_tp)):
            where = f"rank {rank} at {layout.describe()} -> t_g={gen_tp}"
            assert (out["buckets"] == 1) == (bucket_mb == 32.0), (where, out["buckets"])
            assert (out["logits"] - ref.logits).abs().max().item() <= ATOL, where
            assert out["received"] == first[rank][0] > 0, where
            if layout in regrouped:  # every piece it does not hold: one message per bucket
                shards = layout.expert_shards_of_tp_shard(layout.coords(rank).tp)
                pieces = layout.ep * len(shards) - (layout.expert_coords(rank).etp in shards)
                assert out["expert_messages"] == pieces * out["buckets"], where
            else:
                assert out["received"] == (out["ep"] - 1) * out["local_expert_bytes"], where
            assert out["restored"] and out["freed"], where
            assert out["recv"] == costs[rank].recv_payload and out["buffer"] == costs[rank].buffer_payload, where
            assert out["held"] == costs[rank].buffer_payload - plan.training_bytes(rank) + costs[rank].redundant


@pytest.mark.slow
def test_hybrid_engine_generates_with_expert_parallelism(dist_pool, moe_models):
    """Generation expert parallelism e_g = 2: each generation rank holds one half of the experts (its block,
    global numbers) and the MoE layers dispatch tokens between the two replicas; the generation logits equal
    transformers'. From training EP=4 the ranks gather in pairs (ep / e_g), from EP=2 nothing moves before the
    reshard; bytes, the generation buffer and held memory equal the plan's accounting (e_g in Table 2)."""
    from hybridrl.hybrid_engine.accounting import account
    from hybridrl.hybrid_engine.model_shapes import model_shapes
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.parallel.generation import GenerationGroups, GenerationLayout

    model_dir = str(moe_models["mixtral"])
    input_ids, _ = _batch()
    ref = hf_reference(model_dir, input_ids)
    pool = dist_pool(WORLD)
    for layout, bucket_mb, gen_tp in ((ParallelLayout(tp=1, dp=4, ep=4), 32.0, 1),
                                      (ParallelLayout(tp=1, dp=4, ep=4), 0.02, 1),
                                      (ParallelLayout(tp=1, dp=4, ep=2), 32.0, 1),
                                      (ParallelLayout(tp=2, dp=2, ep=2, sequence_parallel=True), 32.0, 1),
                                      (ParallelLayout(tp=2, dp=2, ep=2, sequence_parallel=True), 32.0, 2)):
        gen = GenerationLayout(tp=gen_tp, ep=2)
        plan = HybridEnginePlan(layout, gen, model_shapes(model_dir), dtype_bytes=4)
        groups = GenerationGroups(layout, gen)
        costs, first = account(plan, "hybrid").ranks, plan.expert_first_stage()
        outs = pool.run(_moe_engine_round_trip, model_dir, layout, input_ids, bucket_mb, gen_tp, 2)
        for rank, out in enumerate(outs):
            where = f"rank {rank} at {layout.describe()} -> t_g={gen_tp} e_g=2"
            block = groups.gen_expert_block(rank)
            assert out["gen_experts"] == [2 * block, 2 * block + 1], (where, out["gen_experts"])
            assert (out["logits"] - ref.logits).abs().max().item() <= ATOL, where
            assert out["received"] == first.get(rank, (0,))[0], where
            assert (out["received"] > 0) == (layout.ep == 4), where
            assert out["restored"] and out["freed"], where
            assert out["recv"] == costs[rank].recv_payload and out["buffer"] == costs[rank].buffer_payload, where
            assert out["held"] == costs[rank].buffer_payload - plan.training_bytes(rank) + costs[rank].redundant


def _lockstep_generation(model_dir: str, layout: ParallelLayout, rows_per_rank: list[int], sampled: bool):
    """Each rank generates its own rows (a different count per rank, none on some) with the native engine at
    e_g = 2 and then at e_g = 1 (every expert on each rank); returns both outputs."""
    import torch.distributed as dist

    from hybridrl.hybrid_engine.engine import HybridEngine
    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.native import NativeRolloutEngine

    initialize_model_parallel(layout)
    hf_config = load_hf_config(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, model_dir, hf_config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    rows = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()
            for n in torch.randint(2, 9, (rows_per_rank[dist.get_rank()],), generator=gen)]
    # stop at many tokens, so rows (and replicas) finish at different steps
    params = SamplingParams(max_new_tokens=12, temperature=1.0 if sampled else 0.0, seed=7,
                            stop_token_ids=tuple(range(3, VOCAB, 9)))
    out = {}
    for gen_ep in (2, 1):
        hybrid = HybridEngine(model, hf_config, layout, GenerationLayout(ep=gen_ep))
        engine = NativeRolloutEngine(hybrid.to_generation(), max_model_len=32, vocab_size=VOCAB, max_batch_size=2)
        assert (engine.ep_group is not None) == (gen_ep == 2)
        done = engine.generate_rows(rows, params)
        out[gen_ep] = [(s.tokens, s.log_probs) for s in done]
        hybrid.to_training()
    return out


@pytest.mark.slow
def test_native_engine_decodes_in_lockstep_with_generation_expert_parallelism(dist_pool, moe_models):
    """e_g = 2 in the native engine: the two replicas of each expert-parallel pair hold 3 and 1, or 0 and 2 rows
    (batches of 2: one replica runs a placeholder batch, one has nothing of its own at all), stop at different
    steps, and still run their MoE layers together; every row's tokens equal the e_g = 1 engine's and its
    log-probs too (<= 1e-5), greedy and sampled."""
    pool = dist_pool(WORLD)
    model_dir = str(moe_models["qwen3_moe"])
    for sampled in (False, True):
        outs = pool.run(_lockstep_generation, model_dir, ParallelLayout(tp=1, dp=4, ep=2), [3, 0, 1, 2], sampled)
        lengths = set()
        for rank, out in enumerate(outs):
            assert len(out[2]) == len(out[1]) == [3, 0, 1, 2][rank]
            for (tokens, log_probs), (want_tokens, want_log_probs) in zip(out[2], out[1]):
                assert tokens == want_tokens, (rank, sampled)
                assert max((abs(a - b) for a, b in zip(log_probs, want_log_probs)), default=0.0) <= 1e-5
                lengths.add(len(tokens))
        assert len(lengths) > 1, lengths  # rows stopped at different steps


# ---- routing replay ------------------------------------------------------------------------------------------
def _choose_from_noisy_scores(hook, seed: int):
    """Make a generation router pick its experts from perturbed scores, its gate weights staying the clean
    scores at those experts: the rollout engine choosing otherwise at near-ties, as other kernels or another
    precision do on GPU (on CPU in fp32 the native engine and the trainer choose alike)."""
    generator = torch.Generator().manual_seed(seed)
    own = hook.get_replay_topk

    def noisy(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        def choose(values, k, num_groups=None, group_topk=None):
            noise = 0.5 * values.detach().std() * torch.randn(values.shape, generator=generator)
            _, index = default_compute_topk(values + noise.to(values.dtype), k, num_groups=num_groups,
                                            group_topk=group_topk)
            return values.gather(1, index), index
        return own(scores, topk, num_groups, group_topk, choose)
    hook.get_replay_topk = noisy


def _routing_replay_round(model_dir: str, layout: ParallelLayout, prompts: list[list[int]]):
    """Generate through the hybrid engine with the rollout's routing recorded (once as the trainer routes, once
    choosing at perturbed scores), then the trainer's log-probs of the same tokens with the recording ignored,
    measured and replayed. Returns, on the last stage's TP rank 0, log-prob gaps and routing mismatch shares."""
    from megatron.core import parallel_state as ps

    from hybridrl.hybrid_engine.engine import HybridEngine
    from hybridrl.models.routing_replay import ExpertRouting
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.native import NativeRolloutEngine
    from hybridrl.workers.megatron_model import MegatronModel
    from hybridrl.workers.policy import response_log_probs

    initialize_model_parallel(layout)
    model = MegatronModel(model_dir, micro_batch_size=2, max_tokens_per_micro_batch=48,
                          sequence_parallel=layout.sequence_parallel)
    engine = HybridEngine(model.model, model.hf_config, layout, GenerationLayout(tp=1))
    rollout = NativeRolloutEngine(engine.gen_model, max_model_len=64, vocab_size=VOCAB, record_routing=True)
    params = SamplingParams(max_new_tokens=12, seed=3)

    def log_probs(batch, mode):
        model.routing_mode = mode
        out = model.forward(batch, lambda mb, logits: response_log_probs(
            mb, logits, VOCAB, model.tp_group if model.tp > 1 else None)[0], {"response_mask": batch["response_mask"]})
        mismatch = model.forward_routing_mismatch if mode else None
        if out is None:
            return None, mismatch
        mask = batch["response_mask"].bool()
        return (out - batch["rollout_log_probs"]).abs()[mask], mismatch

    results = {}
    for case in ("same", "perturbed"):
        engine.to_generation()
        if case == "perturbed":
            for index, hook in ExpertRouting.of(engine.gen_model).layers:
                _choose_from_noisy_scores(hook, seed=100 + index)
        batch = rollout.generate(prompts, params)
        engine.to_training()
        routed = batch["routed_experts"]
        results[case] = {"shape": tuple(routed.shape),
                         "recorded": int((routed[..., 0] >= 0).sum()), "real": int(batch["attention_mask"].sum())}
        for mode in (None, "measure", "replay"):
            results[case][mode] = log_probs(batch, mode)
    last = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    return results if last else None


@pytest.mark.slow
def test_routing_replay_makes_the_trainer_route_as_the_rollout(dist_pool, moe_models):
    """rollout.routing_replay: the native engine records each token's experts per MoE layer; the trainer's
    forward (packed rows, several micro-batches, sequence parallel or pipeline stages) reads them at the right
    tokens. When the rollout routes as the trainer would, the trainer measures no mismatch. When the rollout
    chooses otherwise at near-ties, the trainer without replay routes some tokens elsewhere (logged as
    moe/routing_mismatch) and their log-probs move away from the rollout's; with replay its log-probs equal the
    rollout's (the first update's importance ratio pi_trainer / pi_rollout is 1 to fp32 precision)."""
    model_dir = str(moe_models["qwen3_moe"])
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 3, 7, 8, 4, 6, 2)]
    pool = dist_pool(WORLD)
    for layout in (ParallelLayout(tp=1, dp=4, ep=2), ParallelLayout(tp=2, dp=2, ep=2, sequence_parallel=True),
                   ParallelLayout(tp=1, pp=2, dp=2, ep=2)):
        outs = [o for o in pool.run(_routing_replay_round, model_dir, layout, prompts) if o is not None]
        assert outs, layout
        for out in outs:
            where = layout.describe()
            same, perturbed = out["same"], out["perturbed"]
            # one MoE layer (the second is dense), top-2; every real token but each sequence's last is recorded
            assert same["shape"][2:] == (1, 2), where
            assert same["recorded"] == same["real"] - len(prompts), where
            gap, mismatch = same["measure"]
            assert mismatch == 0.0 and gap.max() <= 1e-5, (where, mismatch, gap.max())
            assert same["replay"][1] == 0.0 and same["replay"][0].max() <= 1e-5, where
            plain, measured = perturbed[None][0], perturbed["measure"]
            assert torch.equal(plain, measured[0]), where  # measuring does not change the forward
            assert 0.05 < measured[1] < 0.9, (where, measured[1])
            assert plain.max() > 1e-3, (where, plain.max())  # 100x the gap left with replay
            replay_gap, replay_mismatch = perturbed["replay"]
            assert replay_gap.max() <= 1e-5, (where, replay_gap.max())
            assert replay_mismatch == measured[1], where  # counted before replacing: the same tokens differ


@pytest.mark.slow
def test_grpo_moe_config_learns_with_expert_parallelism(ray_two_devices):
    """configs/grpo_moe_tiny.yaml (EP=2): reward first < 0.3 -> last five > 0.7; the generation model (all
    experts gathered) samples what the training model computes; the routers' losses and loads are logged.
    Its first step (samples, loss) equals the same job's at TP=2 with sequence parallelism and no expert
    parallelism, and at TP=2 with whole experts split over the two TP ranks (expert_tp=1, EP=2: the hybrid
    engine regroups them into the TP layout); later steps differ slightly: the load-balancing loss depends on how
    tokens are grouped."""
    from test_trainer_e2e import run_steps

    _, history = run_steps([], "grpo_moe_tiny.yaml")
    rewards = [m["reward_mean"] for m in history]
    assert rewards[0] < 0.3 and sum(rewards[-5:]) / 5 > 0.7, rewards
    for m in history:
        assert m["mismatch/log_prob_diff"] < 1e-5
        assert math.isfinite(m["moe/load_balancing_loss"]) and math.isfinite(m["moe/z_loss"])
        tokens = [m[f"moe/expert_tokens/e{e}"] for e in range(4)]
        # every token goes to 2 distinct experts in each of the 2 MoE layers
        assert min(tokens) >= 0 and sum(tokens) > 0 and sum(tokens) % 4 == 0, tokens
        assert 1.0 <= m["moe/load_imbalance"] <= 4.0
    _, (dense_layout,) = run_steps(["trainer.steps=1", "actor.parallel.tp=2", "actor.parallel.ep=1",
                                    "actor.parallel.sequence_parallel=true"], "grpo_moe_tiny.yaml")
    _, (expert_tp_layout,) = run_steps(["trainer.steps=1", "actor.parallel.tp=2", "actor.parallel.ep=2",
                                        "actor.parallel.expert_tp=1", "actor.parallel.sequence_parallel=true"],
                                       "grpo_moe_tiny.yaml")
    for other in (dense_layout, expert_tp_layout):
        for key in ("reward_mean", "response_length_mean", "actor/pg_loss"):  # grads carry the aux loss too
            assert math.isclose(history[0][key], other[key], rel_tol=1e-4, abs_tol=1e-6), key
    assert expert_tp_layout["mismatch/log_prob_diff"] < 1e-5


@pytest.mark.slow
def test_expert_parallel_replicas_run_the_same_number_of_micro_batches(ray_two_devices):
    """With a token budget of one 48-token row per micro-batch the two expert-parallel replicas pack their
    sequences into different numbers of rows (31 and 32 at step 4 on this seed); their MoE layers exchange
    tokens in every forward, so they agree on the larger count and the job runs on (without it the update of step
    4 hangs: checked)."""
    from test_trainer_e2e import run_steps

    _, history = run_steps(["trainer.steps=4", "actor.max_tokens_per_micro_batch=48"], "grpo_moe_tiny.yaml")
    _, whole = run_steps(["trainer.steps=4"], "grpo_moe_tiny.yaml")
    assert len(history) == 4 and all(m["mismatch/log_prob_diff"] < 1e-5 for m in history)
    # the first rollout and loss are the same job's; later steps move apart a little, because the routers'
    # load-balancing loss depends on how the tokens are grouped into micro-batches
    for key in ("reward_mean", "response_length_mean", "actor/pg_loss"):
        assert math.isclose(history[0][key], whole[0][key], rel_tol=1e-4, abs_tol=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tp": 1, "ep": 2},
                                      {"tp": 2, "ep": 2, "expert_tp": 1, "sequence_parallel": True}],
                         ids=["ep2", "tp2-etp1-ep2"])
def test_expert_parallel_actor_update_equals_pytorch_reference(ray_two_devices, tmp_path, parallel):
    """One actor update of the tiny Qwen3-MoE at EP=2 (each rank 2 of the 4 experts: the DP ranks at TP=1, the TP
    ranks at TP=2 with whole experts; token-budget micro-batches, whose counts the replicas agree on) with plain
    SGD, lr 1, router losses off: every weight moves by exactly the gradient transformers computes for the same
    token-mean policy-gradient loss on the same sequences (the dense actor's check in tests/test_short_api.py),
    experts included. The ranks route different tokens: with the experts' weights not marked expert-parallel in
    Megatron's config, DDP summed the gradients of the two ranks' different experts (e0 + e2, e1 + e3); tests
    that give every rank the same batch could not see it. (Expert TP above TP: tests/test_moe_four_devices.py.)"""
    check_expert_parallel_update(parallel, 2, tmp_path)


def check_expert_parallel_update(parallel: dict, devices: int, tmp_path: Path) -> None:
    """The check above at `parallel` on `devices` Ray devices (the caller's module holds the Ray cluster)."""
    import hybridrl
    from hybridrl.models.tiny import resolve_model_path
    from test_short_api import PROMPTS, _hf_policy_gradient
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("tiny:qwen3_moe")
    pool = hybridrl.ResourcePool(devices=devices)
    try:
        actor = hybridrl.Actor(path, parallel=parallel, rollout={"tp": 1, "max_new_tokens": 8},
                               resource_pool=pool, optim={"optimizer": "sgd", "lr": 1.0, "clip_grad": 1e9,
                                                          "use_distributed_optimizer": False},
                               max_tokens_per_micro_batch=48, moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.0})
        assert actor.layout.ep == parallel["ep"]
        out = actor.generate_sequences(PROMPTS, seed=3)
        advantages = torch.randn(len(out), generator=torch.Generator().manual_seed(0))
        metrics = actor.update(actions=out, advantages=advantages)
        actor.save_hf(str(tmp_path / "trained"))
    finally:
        pool.shutdown()
    assert metrics["update_ok"] == 1.0
    assert metrics["mismatch/log_prob_diff"] < 1e-5  # the generation model (experts regrouped) samples as trained
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    reference = _hf_policy_gradient(path, out.sequences, advantages)
    assert any(".experts." in name for name in reference)
    for name, grad in reference.items():
        step = initial[name] - trained[name]
        assert (step - grad).abs().max() <= 1e-4 * max(1.0, grad.abs().max().item()), name
    # the norm that clipping uses covers each expert once (the expert optimizer's share summed over EP ranks)
    norm = math.sqrt(sum(float(grad.double().square().sum()) for grad in reference.values()))
    assert math.isclose(metrics["grad_norm"], norm, rel_tol=1e-5), (metrics["grad_norm"], norm)


@pytest.mark.slow
def test_routing_replay_in_the_trainer(ray_two_devices):
    """grpo_moe_tiny with rollout.routing_replay=true: the rollout's experts travel with the sequences to the
    actor's old-log-prob and update forwards; moe/routing_mismatch is logged (the colocated rollout routes as
    the trainer: next to nothing differs) and the rollout's log-probs equal the trainer's. The plan refuses it
    for a dense model and for multi-turn episodes, before any worker starts."""
    from test_trainer_e2e import run_steps

    from hybridrl.config import ConfigError, load_config
    from hybridrl.trainer.plan import plan_run

    _, history = run_steps(["trainer.steps=2", "rollout.routing_replay=true"], "grpo_moe_tiny.yaml")
    for m in history:
        assert 0.0 <= m["moe/routing_mismatch"] <= 0.01, m["moe/routing_mismatch"]
        assert m["mismatch/log_prob_diff"] < 1e-5
    with pytest.raises(ConfigError, match="rollout.record_routing=true records which experts .* has no experts"):
        plan_run(load_config(None, ["rollout.record_routing=true"]))
    with pytest.raises(ConfigError, match="rollout.routing_replay=true with multi-turn episodes"):
        plan_run(load_config("grpo_moe_tiny.yaml", ["rollout.routing_replay=true", "rollout.env=charset_turns"]))


@pytest.mark.slow
def test_generation_expert_parallelism_in_the_trainer(ray_two_devices):
    """grpo_moe_tiny with rollout.ep=2: each generation replica holds 2 of the 4 experts (nothing is gathered:
    e_g = ep), the replicas decode in lockstep, and the first two steps equal the same job's with every expert on
    each replica; the rollout's log-probs equal the trainer's. The plan refuses rollout.ep for a dense model, one
    that does not divide actor.parallel.ep, partial rollouts on a pool of its own, a pool whose replicas it
    does not divide and (on a pool of its own) expert TP other than TP, before any worker starts (a pool of its
    own: tests/test_moe_four_devices.py)."""
    from hybridrl.config import ConfigError, load_config
    from hybridrl.trainer.plan import plan_run
    from test_trainer_e2e import run_steps

    _, split = run_steps(["trainer.steps=2", "rollout.ep=2"], "grpo_moe_tiny.yaml")
    _, whole = run_steps(["trainer.steps=2"], "grpo_moe_tiny.yaml")
    for a, b in zip(split, whole):
        assert a["mismatch/log_prob_diff"] < 1e-5
        for key in ("reward_mean", "response_length_mean", "actor/pg_loss"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), key
    for overrides, needle in (
            ([], "rollout.ep=2 splits the experts over generation replicas; the actor's model .* has no experts"),
            (["actor.parallel.ep=1"], "rollout.ep=2: .*rollout.ep 2 does not divide actor.parallel.ep 1"),
            (["resources.pools.gen=2", "rollout.pool=gen", "rollout.partial=true", "trainer.mode=one_step_off"],
             "rollout.ep=2 with rollout.partial=true is not supported"),
            (["resources.pools.gen=3", "rollout.pool=gen"], "rollout.ep=2 must divide the rollout pool's 3 replicas"),
            (["resources.pools.gen=2", "rollout.pool=gen", "actor.parallel.tp=2", "actor.parallel.expert_tp=1",
              "actor.parallel.sequence_parallel=true"], "takes the experts at the training TP layout")):
        config = None if not overrides else "grpo_moe_tiny.yaml"
        with pytest.raises(ConfigError, match=needle):
            plan_run(load_config(config, ["rollout.ep=2", *overrides]))


class UnevenTurnsEnv(CharsetTurnsEnv):
    """charset_turns whose episodes last 1, 2 or 3 turns (by the prompt's length): the later turns' generate
    calls carry few rows, so a generation replica often has none."""

    def reset(self, row):
        self.turns = 1 + len(str(row.get("prompt", ""))) % 3
        return super().reset(row)


@pytest.mark.slow
def test_generation_expert_parallelism_with_multi_turn_episodes(ray_two_devices):
    """grpo_moe_tiny with rollout.ep=2 on multi-turn episodes of uneven length: every turn's generate call reaches
    both replicas (one without rows decodes a placeholder in lockstep), and the first two steps equal the same
    job's with every expert on each replica."""
    from test_trainer_e2e import run_steps

    episodes = ["trainer.steps=2", f"rollout.env={__name__}:UnevenTurnsEnv", "rollout.max_turns=3",
                "rollout.max_new_tokens=12", "rollout.max_episode_tokens=48"]
    _, split = run_steps([*episodes, "rollout.ep=2"], "grpo_moe_tiny.yaml")
    _, whole = run_steps(episodes, "grpo_moe_tiny.yaml")
    assert 1.2 < split[0]["rollout/turns_mean"] < 2.8, split[0]["rollout/turns_mean"]
    for a, b in zip(split, whole):
        assert a["mismatch/log_prob_diff"] < 1e-5
        for key in ("reward_mean", "response_length_mean", "actor/pg_loss", "rollout/turns_mean"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), key


def test_qwen3_30b_a3b_recipe_plans_on_the_real_architecture(tmp_path):
    """configs/gpu/moe: refuses its placeholders; with a config.json-only folder of the real Qwen3-30B-A3B
    shapes the plan takes the recipe's layout (t=4 with sequence parallel, ep=4 over 16 devices)."""
    from transformers import Qwen3MoeConfig

    from hybridrl.config import ConfigError, load_config
    from hybridrl.trainer.plan import plan_run

    recipe = Path(__file__).resolve().parent.parent / "configs" / "gpu" / "moe" / "grpo_qwen3_30b_a3b_16gpu.yaml"
    with pytest.raises(ConfigError, match="actor.model.path='/path/to/Qwen3-30B-A3B'"):
        plan_run(load_config(recipe))
    real = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    real.save_pretrained(str(tmp_path / "qwen3-30b-a3b"))
    prompts = tmp_path / "train.jsonl"
    prompts.write_text('{"prompt": "1 + 1 ="}\n')
    plan = plan_run(load_config(recipe, [f"actor.model.path={tmp_path / 'qwen3-30b-a3b'}",
                                         f"data.train_files=[{prompts}]", "reward.fn=hybridrl.data.tasks:charset_reward",
                                         "rollout.engine=native"]))
    assert plan.roles["actor"].layout == ParallelLayout(tp=4, dp=4, ep=4, sequence_parallel=True)
    with pytest.raises(ConfigError, match="sequence parallelism"):
        plan_run(load_config(recipe, [f"actor.model.path={tmp_path / 'qwen3-30b-a3b'}",
                                      f"data.train_files=[{prompts}]", "reward.fn=hybridrl.data.tasks:charset_reward",
                                      "rollout.engine=native", "actor.parallel.sequence_parallel=false"]))


@pytest.mark.slow
def test_expert_tp_checkpoint_resumes_exactly_and_on_another_expert_grid(ray_two_devices, tmp_path):
    """grpo_moe_tiny at TP=2 with whole experts (expert_tp=1, ep=2: each TP rank holds 2 of the 4 experts), a
    checkpoint at step 2: resuming on the same layout gives the uninterrupted run's step 3 exactly; resuming at
    TP=1 / EP=2 (each expert block now on a DP rank, whole) loads the experts and optimizer state where Megatron's
    distributed checkpoint puts them, and step 3's samples and loss equal the uninterrupted run's."""
    import json

    from hybridrl.cli.train import run

    config = Path(__file__).resolve().parent.parent / "configs" / "grpo_moe_tiny.yaml"
    grid = ["actor.parallel.tp=2", "actor.parallel.ep=2", "actor.parallel.expert_tp=1",
            "actor.parallel.sequence_parallel=true"]

    def train(run_dir, overrides):
        args = argparse.Namespace(config=str(config), print_config=False,
                                  overrides=[f"trainer.run_dir={run_dir}", "trainer.save_every=2", *overrides])
        assert run(args) == 0
        return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}

    reference = train(tmp_path / "ref", grid + ["trainer.steps=3"])
    for name, layout in (("same", grid), ("tp1", ["actor.parallel.ep=2"])):
        run_dir = tmp_path / name
        shutil.copytree(tmp_path / "ref" / "ckpt" / "step_2", run_dir / "ckpt" / "step_2")
        (run_dir / "ckpt" / "latest").write_text("step_2\n")
        resumed = train(run_dir, layout + ["trainer.steps=3", "trainer.resume=auto"])[3]
        rel = 0.0 if name == "same" else 1e-4
        for key in ("reward_mean", "response_length_mean", "actor/pg_loss", "kl_mean"):
            assert math.isclose(resumed[key], reference[3][key], rel_tol=rel, abs_tol=1e-6 if rel else 0), \
                (name, key, resumed[key], reference[3][key])
