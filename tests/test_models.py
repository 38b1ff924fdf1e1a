"""Megatron GPT built from HF configs equals transformers at TP=1, TP=2, PP=2, TP=2xPP=2 (+SP).

Real Megatron-Core through gloo on 4 ranks (one long-lived pool); references from transformers in a
clean subprocess. Checks: logits (fp32, max abs diff <= 1e-4), loss and every parameter gradient
(mapped to HF names through the family tables), scalar head vs LlamaForSequenceClassification.
"""
from __future__ import annotations

import pytest
import torch

from hybridrl.models.tiny import create_tiny_model
from hybridrl.parallel.layout import ParallelLayout

from reference_model import hf_reference  # tests/: transformers' outputs in a clean process

WORLD = 4
LAYOUTS = [ParallelLayout(tp=1, pp=1, dp=4), ParallelLayout(tp=2, pp=1, dp=2), ParallelLayout(tp=1, pp=2, dp=2),
           ParallelLayout(tp=2, pp=2, dp=1, sequence_parallel=True)]
BATCH, SEQ, VOCAB = 2, 16, 256
ATOL = 1e-4
GRAD_ATOL = 1e-5


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        # Llama-3 style: GQA (4 heads, 2 kv heads), rope theta 5e5 with llama3 scaling, untied
        "llama": create_tiny_model(root / "llama", "llama", rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}),
        # Qwen2: qkv bias, tied embeddings
        "qwen2": create_tiny_model(root / "qwen2", "qwen2", tie=True, seed=1),
        "llama_rm": create_tiny_model(root / "llama_rm", "llama", head="seq_cls", seed=2, layers=2),
    }


def _megatron_step(model_dir: str, layout: ParallelLayout, input_ids: torch.Tensor, labels: torch.Tensor,
                   head: str = "lm"):
    """One forward+backward at `layout`; rank 0 returns (full logits, loss, {hf_name: full grad})."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights, named_global_parameters
    from hybridrl.models.families import tp_gather, tp_partition_dim
    from hybridrl.parallel.distributed import initialize_model_parallel

    initialize_model_parallel(layout)
    hf_config = load_hf_config(model_dir)
    model = build_gpt_model(hf_config, head=head, sequence_parallel=layout.sequence_parallel)
    load_hf_weights(model, model_dir, hf_config)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    outputs = {}

    def loss_func(output):
        if head == "scalar":
            outputs["logits"] = output.detach()
            return output.sum() * 0.0, {}
        loss_per_token, logits = output
        outputs["logits"] = gather_from_tensor_model_parallel_region(logits.detach())
        loss = loss_per_token.float().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, chunk):
        output = chunk(input_ids, positions, attention_mask=None)
        if head == "scalar" or not ps.is_pipeline_last_stage():
            return output, loss_func
        logits = output  # [b, s, v/tp]
        # CE over the TP-split vocab, exactly as Megatron's loss path does it
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        loss = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous().float(), labels.t().contiguous())
        return (loss, logits), loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=SEQ, micro_batch_size=BATCH, forward_only=head == "scalar")

    tp_group = ps.get_tensor_model_parallel_group()
    grads = {}
    if head == "lm":
        for name, param in named_global_parameters(model):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            if getattr(param, "sequence_parallel", False):  # SP: each TP rank holds a partial norm grad
                grad = grad.clone()
                dist.all_reduce(grad, group=tp_group)
            dim = tp_partition_dim(param)
            if dim is not None and layout.tp > 1:
                shards = [torch.empty_like(grad) for _ in range(layout.tp)]
                dist.all_gather(shards, grad.contiguous(), group=tp_group)
                grad = tp_gather(name, shards, dim)
            # tied (PP > 1): output_layer maps to embed_tokens, and the HF grad is the sum of both uses
            for hf_name, tensor in model.hybridrl_family.to_hf(name, grad, hf_config, head):
                grads[hf_name] = grads.get(hf_name, 0) + tensor
    # Gather to global rank 0 (DP replica 0, TP rank 0 of each stage contributes)
    is_source = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    last = ps.is_pipeline_last_stage()
    mine = {"grads": grads if is_source else {},
            "logits": outputs.get("logits") if is_source and last else None,
            "loss": float(losses[0]["loss"]) if is_source and last and head == "lm" else None}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    merged = {"grads": {}, "logits": None, "loss": None}
    for item in gathered:
        for k, v in item["grads"].items():
            merged["grads"][k] = merged["grads"].get(k, 0) + v
        merged["logits"] = item["logits"] if item["logits"] is not None else merged["logits"]
        merged["loss"] = item["loss"] if item["loss"] is not None else merged["loss"]
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_loss_grads_match_transformers_at_every_layout(dist_pool, tiny_models, family):
    model_dir = tiny_models[family]
    input_ids, labels = _batch()
    ref = hf_reference(model_dir, input_ids, labels)
    pool = dist_pool(WORLD)
    first_grads = None
    for layout in LAYOUTS:
        result = pool.run(_megatron_step, str(model_dir), layout, input_ids, labels)[0]
        where = f"{family} at {layout.describe()}"
        assert result["logits"].shape == (BATCH, SEQ, VOCAB), where
        logit_diff = (result["logits"] - ref.logits).abs().max().item()
        assert logit_diff <= ATOL, f"{where}: logits differ from transformers by {logit_diff}"
        assert abs(result["loss"] - ref.loss) <= ATOL, f"{where}: loss {result['loss']} vs {ref.loss}"
        assert set(result["grads"]) == set(ref.grads), where
        for name, grad in ref.grads.items():
            diff = (result["grads"][name] - grad).abs().max().item()
            assert diff <= GRAD_ATOL, f"{where}: grad of {name} differs by {diff}"
        if first_grads is None:
            first_grads = result["grads"]
        else:  # the same gradients at every layout (not only close to transformers)
            for name, grad in first_grads.items():
                assert torch.allclose(result["grads"][name], grad, atol=GRAD_ATOL), f"{where}: {name}"


def test_scalar_head_scores_match_sequence_classification(dist_pool, tiny_models):
    model_dir = tiny_models["llama_rm"]
    input_ids, _ = _batch(seed=3)
    ref = hf_reference(model_dir, input_ids, head="seq_cls")
    pool = dist_pool(WORLD)
    for layout in (ParallelLayout(tp=2, pp=2, dp=1, sequence_parallel=True), ParallelLayout(tp=1, pp=1, dp=4)):
        result = pool.run(_megatron_step, str(model_dir), layout, input_ids, None, head="scalar")[0]
        scores = result["logits"]  # [b, s, 1]
        assert scores.shape == (BATCH, SEQ, 1)
        # transformers pools the last token (no pad token in the batch) ...
        assert (scores[:, -1] - ref.logits).abs().max().item() <= ATOL, layout.describe()
        # ... and every token's score equals its score head on that token's hidden state
        assert (scores - ref.token_scores).abs().max().item() <= ATOL, layout.describe()


def _critic_from_causal_lm(model_dir: str, input_ids: torch.Tensor):
    """A scalar-head model (critic) from a causal-LM checkpoint: the backbone loads, the head is new."""
    from hybridrl.models import CheckpointError, build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.parallel.distributed import initialize_model_parallel

    initialize_model_parallel(ParallelLayout(tp=2, pp=1, dp=2))
    hf_config = load_hf_config(model_dir)
    critic = build_gpt_model(hf_config, head="scalar")
    try:
        load_hf_weights(critic, model_dir, hf_config)
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    load_hf_weights(critic, model_dir, hf_config, init_missing_score=True)
    lm = build_gpt_model(hf_config)
    load_hf_weights(lm, model_dir, hf_config)
    same_backbone = all(torch.equal(p, dict(lm.named_parameters())[n]) for n, p in critic.named_parameters()
                        if not n.startswith("output_layer"))
    with torch.no_grad():
        values = critic(input_ids, torch.arange(input_ids.shape[1]).unsqueeze(0), attention_mask=None)
    return refused, same_backbone, tuple(values.shape)


def test_critic_from_causal_lm_checkpoint(dist_pool, tiny_models):
    input_ids, _ = _batch(seed=4)
    refused, same_backbone, shape = dist_pool(WORLD).run(_critic_from_causal_lm, str(tiny_models["llama"]),
                                                         input_ids)[0]
    assert refused is not None and "score.weight" in refused and "init_missing_score=True" in refused
    assert same_backbone and shape == (BATCH, SEQ, 1)


def _swiglu_mlp_against_megatron(model_dir: str) -> dict:
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.mlp import MLP

    from hybridrl.models import build_gpt_model, load_hf_config
    from hybridrl.models.swiglu import SwiGLUMLP
    from hybridrl.parallel.distributed import initialize_model_parallel

    initialize_model_parallel(ParallelLayout(dp=1))
    model = build_gpt_model(load_hf_config(model_dir))
    mlp_types = {type(layer.mlp) for layer in model.decoder.layers}
    config = model.config
    submodules = gpt_layer_specs.get_gpt_layer_local_spec().submodules.mlp.submodules
    torch.manual_seed(0)
    megatron_mlp = MLP(config, submodules)
    ours = SwiGLUMLP(config, submodules)
    ours.load_state_dict(megatron_mlp.state_dict())
    hidden = torch.randn(7, 3, config.hidden_size)
    grad_out = torch.randn(7, 3, config.hidden_size)
    results = []
    for mlp in (megatron_mlp, ours):
        x = hidden.clone().requires_grad_(True)
        out, _ = mlp(x)
        out.backward(grad_out)
        results.append((out.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}))
    return {"mlp_types": mlp_types, "results": results}


def test_swiglu_mlp_equals_megatron_mlp_bit_for_bit(dist_pool, tiny_models):
    """Dense layers on CPU run SwiGLUMLP (no concatenation in the backward): outputs and every gradient equal
    Megatron's MLP exactly."""
    from hybridrl.models.swiglu import SwiGLUMLP

    got = dist_pool(1).run(_swiglu_mlp_against_megatron, str(tiny_models["llama"]))[0]
    assert got["mlp_types"] == {SwiGLUMLP}
    (out_m, dx_m, grads_m), (out_s, dx_s, grads_s) = got["results"]
    assert torch.equal(out_m, out_s) and torch.equal(dx_m, dx_s)
    assert grads_m.keys() == grads_s.keys() and all(torch.equal(grads_m[n], grads_s[n]) for n in grads_m)
    assert dx_m.abs().sum() > 0


def _grouped_attention_against_megatron(model_dir: str) -> dict:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from hybridrl.models import build_gpt_model, load_hf_config
    from hybridrl.models.attention import SDPA_MIN_KEYS, GroupedAttention
    from hybridrl.parallel.distributed import initialize_model_parallel

    initialize_model_parallel(ParallelLayout(dp=1))
    model = build_gpt_model(load_hf_config(model_dir))
    config = model.config
    kinds = {type(layer.self_attention.core_attention) for layer in model.decoder.layers}
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    out = {"kinds": kinds, "groups": (heads, groups)}
    for label, seq, batch in (("grouped", 12, 3), ("sdpa", SDPA_MIN_KEYS, 2)):
        # packed rows: two sequences share row 0 (block-diagonal causal mask), row 1 ends in 3 padding positions
        allowed = torch.ones(seq, seq, dtype=torch.bool).tril().repeat(batch, 1, 1, 1)  # [b, 1, s, s]
        half = seq // 2
        allowed[0, 0, half:, :half] = False
        allowed[1, 0, :, seq - 3:] = False
        allowed[1, 0, seq - 3:, :] = False  # padding queries see nothing
        mask = ~allowed  # True = hidden (Megatron's convention)
        torch.manual_seed(1)
        q = torch.randn(seq, batch, heads, dim)
        k, v = torch.randn(seq, batch, groups, dim), torch.randn(seq, batch, groups, dim)
        grad_out = torch.randn(seq, batch, heads * dim)
        grad_out[seq - 3:, 1] = 0  # the loss never reads padding positions
        results = []
        for cls in (DotProductAttention, GroupedAttention):
            attention = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
            inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
            context = attention(*inputs, mask)
            context.backward(grad_out)
            results.append((context.detach(), [t.grad for t in inputs]))
        out[label] = results
    return out


def test_grouped_attention_equals_megatron_attention(dist_pool, tiny_models):
    """Local-spec layers run GroupedAttention (no per-head copies of keys / values): on short rows its outputs and
    the query gradient equal Megatron's DotProductAttention exactly, the key / value gradients within 1e-6 (grouped-
    query attention, a block-diagonal mask, padding rows); from SDPA_MIN_KEYS tokens it runs SDPA, within 1e-5 on
    every real position."""
    from hybridrl.models.attention import GroupedAttention

    got = dist_pool(1).run(_grouped_attention_against_megatron, str(tiny_models["llama"]))[0]
    assert got["kinds"] == {GroupedAttention} and got["groups"][0] > got["groups"][1]
    (ctx_m, grads_m), (ctx_g, grads_g) = got["grouped"]
    assert torch.equal(ctx_m, ctx_g) and torch.equal(grads_m[0], grads_g[0])
    for a, b in zip(grads_m[1:], grads_g[1:]):  # a group's heads summed inside one matmul: another order of sums
        assert torch.allclose(a, b, rtol=0, atol=1e-6) and a.abs().sum() > 0
    (ctx_m, grads_m), (ctx_g, grads_g) = got["sdpa"]
    real = torch.ones(ctx_m.shape[:2], dtype=torch.bool)
    real[-3:, 1] = False
    assert torch.allclose(ctx_m[real], ctx_g[real], atol=1e-5) and torch.isfinite(ctx_g).all()
    for a, b in zip(grads_m, grads_g):
        assert torch.allclose(a, b, atol=1e-5) and a.abs().sum() > 0
