"""Megatron-Core on CPU/gloo through megatron_patches: sharded layouts equal the TP=1 model.

Every rank builds the same TP=1 GPTModel (fixed seed) as the reference, then the model in the layout
under test, copies the reference weights in (sliced by each param's partition_dim), and compares
logits, loss, grads, an optimizer step and a dist_checkpointing round trip against the reference.
The rank functions return differences; the assertions run in the test process.
"""
from __future__ import annotations

import contextlib
import functools
import multiprocessing

import pytest
import torch

SEED = 1234
VOCAB, SEQ, HIDDEN, LAYERS, HEADS, KV_GROUPS, FFN = 128, 16, 64, 4, 4, 2, 128
SAMPLES = 4  # global batch; micro-batch size 1
# Adam's first step is lr * g / (|g| + eps): a large eps keeps it insensitive to ~1e-8 grad noise
# between layouts, so params after one step can be compared at 1e-6. CLIP is below the grad norm, so
# the clip path (a patched site) really scales the grads.
LR, ADAM_EPS, CLIP = 1e-2, 1e-3, 0.05

# These run Megatron through gloo on CPU with the shims; a CUDA machine runs the nccl/GPU path instead.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo path (megatron_patches) only")

_reference_cache: dict = {}


# ---------------------------------------------------------------------------------------------
# Model, weights and data (run inside the pool's ranks)
# ---------------------------------------------------------------------------------------------
def make_config(tp: int = 1, pp: int = 1, sp: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=KV_GROUPS,
        ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
        # fusions compile through torch.compile on CPU (slow) or need CUDA kernels
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False)


def build_model(config):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def full_name(model, local_name: str) -> str:
    """Parameter name in the TP=1/PP=1 model: PP stages number their layers from 0 locally."""
    parts = local_name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def shard_of(full: torch.Tensor, name: str, param, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's slice of a full tensor. fc1 of a gated MLP holds [gate_r; up_r] per TP shard.

    Fused QKV needs no regrouping here: Megatron lays it out per query group, and a TP shard is a
    contiguous run of query groups.
    """
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=dim)[tp_rank]


def reference() -> dict:
    """TP=1 model, logits, per-sample losses and grads of the mean loss over all samples (cached)."""
    if "ref" in _reference_cache:
        return _reference_cache["ref"]
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout

    initialize_model_parallel(ParallelLayout(1, 1, torch.distributed.get_world_size()), seed=SEED)
    torch.manual_seed(SEED)
    model = build_model(make_config())
    tokens, labels = make_data()
    positions = torch.arange(SEQ).expand_as(tokens)
    logits = model(tokens, positions, attention_mask=None)
    per_sample = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(SAMPLES, SEQ).mean(1)
    per_sample.mean().backward()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    ref = {"weights": weights, "grads": grads, "logits": logits.detach(), "losses": per_sample.detach()}
    _reference_cache["ref"] = ref
    return ref


def reference_step() -> dict:
    """Reference weights after one clipped AdamW step on the reference grads (plain torch)."""
    if "step" in _reference_cache:
        return _reference_cache["step"]
    ref = reference()
    params = {n: torch.nn.Parameter(w.clone()) for n, w in ref["weights"].items()}
    for name, param in params.items():
        param.grad = ref["grads"][name].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
    adam = torch.optim.AdamW(list(params.values()), lr=LR, eps=ADAM_EPS, weight_decay=0.0)
    adam.step()
    step = {"weights": {n: p.detach() for n, p in params.items()}, "grad_norm": norm.item()}
    _reference_cache["step"] = step
    return step


def load_reference_weights(model, weights: dict) -> None:
    from megatron.core import parallel_state

    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard_of(weights[full_name(model, name)], name, param, tp_rank, tp))


def compare_shards(model, full: dict, get) -> float:
    """Max |local - slice of full| over this rank's params, `get(param)` picking weight or grad."""
    from megatron.core import parallel_state

    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    worst = 0.0
    for name, param in model.named_parameters():
        expected = shard_of(full[full_name(model, name)], name, param, tp_rank, tp)
        got = get(param)
        assert got.shape == expected.shape, (name, got.shape, expected.shape)
        worst = max(worst, (got - expected).abs().max().item())
    return worst


def _loss_func(labels: torch.Tensor, logits: torch.Tensor):
    from megatron.core import tensor_parallel

    # gather first: vocab_parallel_cross_entropy shifts its input in place
    full_logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits.detach().clone())
    per_sample = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean(-1)
    return per_sample.mean(), {"logits": full_logits, "losses": per_sample.detach()}


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    positions = torch.arange(SEQ).expand_as(tokens)
    return model(tokens, positions, attention_mask=None), functools.partial(_loss_func, labels)


def run_layout(tp: int, pp: int, dp: int, sp: bool = False, optimizer_step: bool = False,
               overlap_grad_reduce: bool = False) -> dict:
    """Logits/loss/grad differences to the reference for one layout (Megatron DDP, 1F1B when pp > 1).

    With optimizer_step, the grads are reduce-scattered for the distributed optimizer (so they are not
    compared) and one optimizer step runs; the result then holds this rank's param shards after it.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout

    ref = reference()
    initialize_model_parallel(ParallelLayout(tp, pp, dp, sequence_parallel=sp), seed=SEED)
    config = make_config(tp, pp, sp)
    model = build_model(config)
    load_reference_weights(model, ref["weights"])
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=optimizer_step,
                                               overlap_grad_reduce=overlap_grad_reduce, bucket_size=4096)
    ddp = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    if overlap_grad_reduce:  # buckets reduce asynchronously during backward (streams/events are stand-ins)
        config.no_sync_func = ddp.no_sync
        config.grad_sync_func = ddp.start_grad_sync
    if optimizer_step:
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=LR, adam_eps=ADAM_EPS, weight_decay=0.0, clip_grad=CLIP,
                            use_distributed_optimizer=True, params_dtype=torch.float32), [ddp])

    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = SAMPLES // dp
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    tokens, labels = make_data()
    micro_batches = [(tokens[i:i + 1], labels[i:i + 1]) for i in range(mine.start, mine.stop)]
    ddp.zero_grad_buffer()
    outputs = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(micro_batches), model=[ddp],
        num_microbatches=len(micro_batches), seq_length=SEQ, micro_batch_size=1)
    result = {"rank": torch.distributed.get_rank(), "last_stage": parallel_state.is_pipeline_last_stage()}
    if result["last_stage"]:
        logits = torch.cat([o["logits"] for o in outputs])
        losses = torch.cat([o["losses"] for o in outputs])
        result["logits"] = (logits - ref["logits"][mine]).abs().max().item()
        result["loss"] = (losses - ref["losses"][mine]).abs().max().item()
    result["sp_tagged"] = sum(1 for p in model.parameters() if getattr(p, "sequence_parallel", False))
    if not optimizer_step:
        result["grad"] = compare_shards(model, ref["grads"], lambda p: p.main_grad)
        return result
    success, grad_norm, _ = optimizer.step()
    result.update(success=success, grad_norm=grad_norm,
                  step=compare_shards(model, reference_step()["weights"], lambda p: p.detach()),
                  moved=compare_shards(model, ref["weights"], lambda p: p.detach()),
                  shards={(full_name(model, n), parallel_state.get_tensor_model_parallel_rank()): p.detach().clone()
                          for n, p in model.named_parameters()})
    return result


def save_checkpoint(ckpt_dir: str, tp: int, pp: int, dp: int) -> None:
    """Save the reference weights from layout (tp, pp, dp) with dist_checkpointing."""
    from megatron.core import dist_checkpointing

    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout

    ref = reference()
    initialize_model_parallel(ParallelLayout(tp, pp, dp), seed=SEED)
    model = build_model(make_config(tp, pp))
    load_reference_weights(model, ref["weights"])
    with _children_allowed():
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)


@contextlib.contextmanager
def _children_allowed():
    """dist_checkpointing.save starts a spawn Manager and writer processes, which a daemonic process
    may not do; the DistPool's ranks are daemonic (Ray actors and torchrun ranks are not)."""
    config = multiprocessing.current_process()._config
    was_daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was_daemon


def load_checkpoint(ckpt_dir: str, tp: int, pp: int, dp: int) -> dict:
    """Load into a freshly initialised model in layout (tp, pp, dp); differences to the reference."""
    from megatron.core import dist_checkpointing

    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout

    ref = reference()
    initialize_model_parallel(ParallelLayout(tp, pp, dp), seed=SEED)
    torch.manual_seed(SEED + 7)  # different init, so a load that does nothing cannot pass
    model = build_model(make_config(tp, pp))
    before = compare_shards(model, ref["weights"], lambda p: p.detach())
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state)
    return {"before": before, "after": compare_shards(model, ref["weights"], lambda p: p.detach())}


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
def _check_layout(results: list[dict], atol_logits: float = 1e-5, atol_grad: float = 1e-5) -> None:
    last = [r for r in results if r["last_stage"]]
    assert last, "no rank reported the last pipeline stage"
    for r in last:
        assert r["logits"] < atol_logits, r
        assert r["loss"] < atol_logits, r
    for r in results:
        if "grad" in r:
            assert r["grad"] < atol_grad, r


@pytest.mark.parametrize("tp,pp,dp,sp,overlap", [(2, 1, 2, False, False), (1, 2, 2, False, False),
                                                 (2, 2, 1, False, False), (2, 2, 1, True, False),
                                                 (1, 2, 2, False, True)])
def test_layout_matches_tp1(dist_pool, tp, pp, dp, sp, overlap):
    results = dist_pool(4).run(run_layout, tp, pp, dp, sp, False, overlap)
    _check_layout(results)
    if sp:
        assert all(r["sp_tagged"] > 0 for r in results)  # norm params tagged for the TP grad all-reduce


def test_distributed_optimizer_step_dp2_equals_dp1(dist_pool):
    pool = dist_pool(4)
    dp2 = pool.run(run_layout, 2, 1, 2, False, True)  # TP=2, DP=2: grads reduce-scattered, state sharded
    dp1_pp2 = pool.run(run_layout, 2, 2, 1, False, True)  # TP=2, PP=2, DP=1: the same TP shards
    dp1 = dist_pool(2).run(run_layout, 2, 1, 1, False, True)  # TP=2, DP=1 on 2 ranks
    for results in (dp2, dp1_pp2, dp1):
        _check_layout(results)
    ref_norm = pool.run(lambda: reference_step()["grad_norm"])[0]
    for r in dp2 + dp1_pp2 + dp1:
        assert r["success"], r
        assert abs(r["grad_norm"] - ref_norm) < 1e-5 and ref_norm > CLIP, (r["grad_norm"], ref_norm)
        assert r["moved"] > 1e-3, "the step did not change the params"
        assert r["step"] < 1e-6, r  # equals one plain-torch clipped AdamW step on the TP=1 model
    dp2_shards = {k: v for r in dp2 for k, v in r["shards"].items()}
    for other in (dp1, dp1_pp2):
        other_shards = {k: v for r in other for k, v in r["shards"].items()}
        assert dp2_shards.keys() == other_shards.keys()
        for key, value in dp2_shards.items():
            assert torch.allclose(value, other_shards[key], rtol=0, atol=1e-6), key


def test_dist_checkpoint_tp2_loads_at_tp1_and_pp2(dist_pool, tmp_path):
    pool = dist_pool(4)
    ckpt_dir = str(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    pool.run(save_checkpoint, ckpt_dir, 2, 1, 2)
    for tp, pp, dp in [(1, 1, 4), (1, 2, 2), (2, 2, 1)]:
        for r in pool.run(load_checkpoint, ckpt_dir, tp, pp, dp):
            assert r["before"] > 1e-3, (tp, pp, dp, r)
            assert r["after"] == 0.0, (tp, pp, dp, r)  # bit-exact
