"""Native rollout engine (Megatron-Core GPTModel + StaticInferenceContext KV cache) on 2 gloo ranks.

One pool run per generation TP size builds the model from a tiny HF checkpoint, runs every check's
generation and the training model's recomputation, and hands the numbers back; the tests compare them
with transformers (greedy), with each other (seeds, t_g = 2 vs t_g = 1) and with the recomputation.
"""
import pytest
import torch

pytestmark = pytest.mark.slow  # ~2 min on 2 cores: two 2-rank suites

PROMPTS = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15], [7], [20, 21, 22]]
NEW_TOKENS = 8
MODEL = dict(vocab_size=128, hidden=64, heads=2, kv_heads=2, layers=2)


def _build_model(model_dir: str):
    from hybridrl.models.builder import build_gpt_model
    from hybridrl.models.checkpoint_hf import load_hf_weights
    from hybridrl.models.config import load_hf_config

    hf_config = load_hf_config(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, model_dir, hf_config)
    return model.eval(), hf_config


def _recompute_logits(model, batch, vocab_size: int) -> torch.Tensor:
    """Full forward of the training model on the finished sequences: logits predicting each response token."""
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    length = ids.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None] & real[:, None, :]
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(ids, positions, ~allowed.unsqueeze(1), runtime_gather_output=True)
    prompt_len = batch["prompts"].shape[1]
    return logits.float()[:, prompt_len - 1:-1, :vocab_size]


def _plain(batch) -> dict:
    out = {key: batch[key].clone() for key in ("prompts", "responses", "response_mask", "rollout_log_probs")}
    out["finish_reasons"] = list(batch.non_tensors["finish_reasons"])
    return out


def _native_suite(model_dir: str, new_model_dir: str, tp: int) -> dict:
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.config import RolloutConfig
    from hybridrl.rollout import SamplingParams, SamplingParamsError, build_rollout_engine
    from hybridrl.rollout.sampling import sampling_log_probs

    initialize_model_parallel(ParallelLayout(tp=tp, dp=2 // tp))
    model, hf_config = _build_model(model_dir)
    vocab = hf_config.vocab_size
    # max_batch_size=4 < rows: several KV-cache batches per call.
    engine = build_rollout_engine(RolloutConfig(engine="native", max_model_len=32, max_batch_size=4), model=model,
                                  vocab_size=vocab)
    out: dict = {}
    greedy = SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS)
    sample = SamplingParams(n=3, seed=11, max_new_tokens=NEW_TOKENS)
    hot = SamplingParams(n=2, seed=5, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=NEW_TOKENS)

    for name, params in (("greedy", greedy), ("sample", sample), ("hot", hot)):
        batch = engine.generate(PROMPTS, params)
        out[name] = _plain(batch)
        logits = _recompute_logits(model, batch, vocab)
        log_probs = sampling_log_probs(logits, params).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
        out[name]["recomputed_log_probs"] = log_probs * batch["response_mask"]
    out["sample_again"] = _plain(engine.generate(PROMPTS, sample))
    out["sample_other_seed"] = _plain(engine.generate(PROMPTS, SamplingParams(n=3, seed=12,
                                                                              max_new_tokens=NEW_TOKENS)))
    out["unseeded"] = _plain(engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=NEW_TOKENS)))
    stop_token = int(out["greedy"]["responses"][0, 2])
    out["stop_token"] = stop_token
    out["stopped"] = _plain(engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS,
                                                                    stop_token_ids=[stop_token])))
    out["ignored"] = _plain(engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS,
                                                                    stop_token_ids=[stop_token], ignore_eos=True)))
    out["short"] = _plain(engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=3)))

    errors = {}
    for label, prompts, params in (("empty", [[1], []], greedy), ("too_long", [[1] * 30], greedy),
                                   ("out_of_vocab", [[vocab]], greedy)):
        try:
            engine.generate(prompts, params)
        except SamplingParamsError as exc:
            errors[label] = str(exc)
    out["errors"] = errors

    # release() frees the KV cache; generate() refuses until wake(); results are unchanged afterwards.
    out["kv_bytes_before_release"] = engine.kv_cache_bytes()
    out["kv_bytes_per_row"], out["chunk_rows"] = engine.kv_bytes_per_row(), engine.chunk_rows()
    engine.release()
    out["kv_bytes_released"] = engine.kv_cache_bytes()
    try:
        engine.generate(PROMPTS, greedy)
        out["generate_while_released"] = "no error"
    except RuntimeError as exc:
        out["generate_while_released"] = str(exc)
    engine.wake()
    out["greedy_after_wake"] = _plain(engine.generate(PROMPTS, greedy))

    # Weight push: copy another checkpoint's weights in, compare with a fresh engine built on them.
    new_model, _ = _build_model(new_model_dir)
    engine.load_weights((name, param.detach().clone()) for name, param in new_model.named_parameters())
    fresh = build_rollout_engine(RolloutConfig(engine="native", max_model_len=32), model=new_model, vocab_size=vocab)
    for name, params in (("greedy", greedy), ("sample", sample)):
        out[f"pushed_{name}"] = _plain(engine.generate(PROMPTS, params))
        out[f"fresh_{name}"] = _plain(fresh.generate(PROMPTS, params))
    try:
        engine.load_weights([("decoder.final_layernorm.weight", torch.zeros(3))])
    except ValueError as exc:
        out["bad_push"] = str(exc)
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from hybridrl.models.tiny import create_tiny_model

    root = tmp_path_factory.mktemp("native_rollout")
    return (str(create_tiny_model(root / "old", seed=0, **MODEL)),
            str(create_tiny_model(root / "new", seed=1, **MODEL)))


@pytest.fixture(scope="module")
def results(dist_pool, model_dirs):
    pool = dist_pool(2)
    return {tp: pool.run(_native_suite, *model_dirs, tp) for tp in (1, 2)}


def _hf_greedy(model_dir: str, prompts, new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        outs.append(ids[0, len(prompt):].tolist())
    return outs


def test_greedy_equals_transformers_generate(results, model_dirs):
    expected = _hf_greedy(model_dirs[0], PROMPTS, NEW_TOKENS)
    for tp in (1, 2):
        got = results[tp][0]["greedy"]
        assert got["responses"].tolist() == expected, f"t_g={tp}"
        assert got["response_mask"].all() and got["finish_reasons"] == ["length"] * len(PROMPTS)
        assert got["prompts"][1].tolist() == [0, 0, 0, 0, 3, 4]  # left-padded


def test_log_probs_match_training_model_recomputation(results):
    for tp in (1, 2):
        for name in ("greedy", "sample", "hot"):
            got = results[tp][0][name]
            assert torch.allclose(got["rollout_log_probs"], got["recomputed_log_probs"], atol=1e-4, rtol=0), \
                f"t_g={tp} {name}: max diff " \
                f"{(got['rollout_log_probs'] - got['recomputed_log_probs']).abs().max():.2e}"
            assert (got["rollout_log_probs"][got["response_mask"].bool()] < 0).all()


def test_seeded_sampling_is_reproducible(results):
    for tp in (1, 2):
        r = results[tp][0]
        assert r["sample"]["responses"].shape[0] == 3 * len(PROMPTS)
        assert torch.equal(r["sample"]["responses"], r["sample_again"]["responses"])
        assert torch.equal(r["sample"]["rollout_log_probs"], r["sample_again"]["rollout_log_probs"])
        assert not torch.equal(r["sample"]["responses"], r["sample_other_seed"]["responses"])
        # the n samples of one prompt differ from each other, and each row keeps its prompt
        assert not torch.equal(r["sample"]["responses"][0], r["sample"]["responses"][1])
        assert torch.equal(r["sample"]["prompts"][0], r["sample"]["prompts"][2])


def test_stop_tokens_and_max_new_tokens(results):
    for tp in (1, 2):
        r = results[tp][0]
        stop = r["stop_token"]
        ignored = r["ignored"]  # ignore_eos: the greedy rows at full length although the stop token comes up
        assert ignored["responses"].tolist() == r["greedy"]["responses"].tolist()
        assert ignored["response_mask"].all() and set(ignored["finish_reasons"]) == {"length"}
        stopped = r["stopped"]
        assert stopped["responses"][0, :3].tolist() == r["greedy"]["responses"][0, :3].tolist()
        assert stopped["response_mask"][0].tolist() == [1, 1, 1] + [0] * (stopped["responses"].shape[1] - 3)
        assert stopped["finish_reasons"][0] == "stop"
        for row, reason in enumerate(stopped["finish_reasons"]):
            length = int(stopped["response_mask"][row].sum())
            tokens = stopped["responses"][row, :length].tolist()
            assert stop not in tokens[:-1]
            assert reason == ("stop" if tokens[-1] == stop else "length")
            assert reason == "stop" or length == NEW_TOKENS
            assert stopped["rollout_log_probs"][row, length:].abs().sum() == 0
        short = r["short"]
        assert short["responses"].shape[1] == 3 and short["response_mask"].all()
        assert short["responses"].tolist() == r["greedy"]["responses"][:, :3].tolist()


def test_generation_tp2_equals_tp1(results):
    r1, r2 = results[1][0], results[2][0]
    for name in ("greedy", "sample", "hot", "stopped", "pushed_sample"):
        assert torch.equal(r1[name]["responses"], r2[name]["responses"]), name
        assert torch.equal(r1[name]["response_mask"], r2[name]["response_mask"]), name
        assert torch.allclose(r1[name]["rollout_log_probs"], r2[name]["rollout_log_probs"], atol=1e-5), name
    # both TP ranks of the generation group produced the same batch (unseeded: one seed drawn for both)
    for name in ("greedy", "sample", "hot", "unseeded"):
        assert torch.equal(results[2][0][name]["responses"], results[2][1][name]["responses"])


def test_weight_push_equals_fresh_engine(results, model_dirs):
    for tp in (1, 2):
        r = results[tp][0]
        for name in ("greedy", "sample"):
            assert torch.equal(r[f"pushed_{name}"]["responses"], r[f"fresh_{name}"]["responses"])
            assert torch.allclose(r[f"pushed_{name}"]["rollout_log_probs"], r[f"fresh_{name}"]["rollout_log_probs"],
                                  atol=1e-6)
        assert not torch.equal(r["pushed_greedy"]["responses"], r["greedy"]["responses"])
        assert "shape" in r["bad_push"]
    assert results[1][0]["pushed_greedy"]["responses"].tolist() == _hf_greedy(model_dirs[1], PROMPTS, NEW_TOKENS)


def test_release_frees_kv_cache_and_wake_restores(results):
    for tp in (1, 2):
        r = results[tp][0]
        assert r["kv_bytes_before_release"] > 0 and r["kv_bytes_released"] == 0
        # the size a GPU's free memory is divided by (chunk_rows) is what a row's cache takes: the last call's last
        # chunk held 1 row (5 prompts, 4 per chunk); layers x (K, V) x groups / tp x head_dim x 32 positions x fp32
        assert r["kv_bytes_per_row"] == r["kv_bytes_before_release"] == 2 * 2 * (2 // tp) * 32 * 32 * 4
        assert r["chunk_rows"] == 4  # on a CPU: rollout.max_batch_size
        assert "call wake() first" in r["generate_while_released"]
        assert torch.equal(r["greedy_after_wake"]["responses"], r["greedy"]["responses"])


def test_bad_prompts_refused_by_engine(results):
    errors = results[1][0]["errors"]
    assert "prompt 1 is empty" in errors["empty"]
    assert "max_model_len" in errors["too_long"]
    assert "vocabulary" in errors["out_of_vocab"]


def _lean_vs_megatron(model_dirs: dict, tp: int) -> dict:
    """Per model: tokens and log-probs of the lean forward (rollout/fast_decode.py) and of Megatron's own, greedy
    and sampled, several KV-cache batches per call, at generation TP = tp."""
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.native import NativeRolloutEngine

    initialize_model_parallel(ParallelLayout(tp=tp, dp=2 // tp))
    out = {}
    for name, model_dir in model_dirs.items():
        model, hf_config = _build_model(model_dir)
        for lean in (True, False):
            engine = NativeRolloutEngine(model, vocab_size=hf_config.vocab_size, max_model_len=32, max_batch_size=4,
                                         fast_forward=lean)
            assert (engine._fast is not None) == lean, name
            for label, params in (("greedy", SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS)),
                                  ("sample", SamplingParams(n=2, seed=5, temperature=1.5, max_new_tokens=NEW_TOKENS)),
                                  # a quarter of the vocabulary stops: rows end at different steps (the lean
                                  # forward drops them from the decode batch, Megatron's keeps them masked)
                                  ("stops", SamplingParams(n=2, seed=5, temperature=1.5, max_new_tokens=NEW_TOKENS,
                                                           stop_token_ids=list(range(3, 128, 4))))):
                batch = engine.generate(PROMPTS, params)
                out[(name, lean, label)] = (batch["responses"], batch["rollout_log_probs"], batch["response_mask"],
                                            batch.meta["decode_row_steps"])
    return out


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from hybridrl.models.tiny import create_tiny_model

    root = tmp_path_factory.mktemp("lean_forward")
    common = dict(vocab_size=128, hidden=64, heads=4, kv_heads=2, layers=2)
    return {"llama_gqa_tied": str(create_tiny_model(root / "llama", seed=3, tie=True, **common)),
            "qwen2_bias": str(create_tiny_model(root / "qwen2", "qwen2", seed=4, **common)),
            "qwen3_qk_norm": str(create_tiny_model(root / "qwen3", "qwen3", seed=5, **common)),
            "qwen3_moe": str(create_tiny_model(root / "qwen3_moe", "qwen3_moe", seed=6, **common)),
            "qwen2_moe_shared": str(create_tiny_model(root / "qwen2_moe", "qwen2_moe", seed=7, **common))}


def test_lean_forward_equals_megatron_forward(dist_pool, family_dirs):
    """The native engine's lean prefill/decode forward gives Megatron's tokens and log-probs (<= 1e-5) for
    grouped-query attention with tied embeddings, Qwen2's qkv bias, Qwen3's q/k norms and mixture-of-experts
    layers (Qwen3-MoE; Qwen2-MoE's shared expert), at t_g = 1 and 2."""
    pool = dist_pool(2)
    for tp in (1, 2):
        out = pool.run(_lean_vs_megatron, family_dirs, tp)[0]
        for name in family_dirs:
            for label in ("greedy", "sample", "stops"):
                (lean_tokens, lean_lp, mask, lean_steps), (ref_tokens, ref_lp, _, ref_steps) = \
                    out[(name, True, label)], out[(name, False, label)]
                assert torch.equal(lean_tokens, ref_tokens), (name, tp, label)
                assert (lean_lp - ref_lp).abs().max().item() <= 1e-5, (name, tp, label)
                if label != "stops":
                    assert lean_steps == ref_steps == len(PROMPTS) * (1 if label == "greedy" else 2) * NEW_TOKENS
                else:  # lengths differ: the lean decode computed only rows still running, Megatron's every row
                    lengths = mask.sum(-1)
                    assert lengths.min() < lengths.max(), (name, tp)
                    assert lean_steps == int(lengths.sum()) < ref_steps, (name, tp)


def _bf16_lean_vs_full_forward(model_dirs: dict) -> dict:
    """Per model in bf16: the lean engine's sampled log-probs and the same tokens' log-probs from Megatron's full
    forward, with how many packed weights the chunk used."""
    from hybridrl.models.builder import build_gpt_model
    from hybridrl.models.checkpoint_hf import load_hf_weights
    from hybridrl.models.config import load_hf_config
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.native import NativeRolloutEngine
    from hybridrl.rollout.sampling import sampling_log_probs

    initialize_model_parallel(ParallelLayout(tp=1, dp=2))
    out = {}
    for name in ("llama_gqa_tied", "qwen3_qk_norm"):
        hf_config = load_hf_config(model_dirs[name])
        model = build_gpt_model(hf_config, dtype=torch.bfloat16)
        load_hf_weights(model, model_dirs[name], hf_config)
        engine = NativeRolloutEngine(model.eval(), vocab_size=hf_config.vocab_size, max_model_len=32, max_batch_size=4)
        params = SamplingParams(n=2, seed=5, temperature=1.0, max_new_tokens=NEW_TOKENS)
        batch = engine.generate(PROMPTS, params)
        logits = _recompute_logits(model, batch, hf_config.vocab_size)
        full = sampling_log_probs(logits, params).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
        mask = batch["response_mask"].bool()
        out[name] = (batch["rollout_log_probs"][mask], full[mask], len(engine._fast._packed),
                     hf_config.num_hidden_layers)
    return out


def test_lean_forward_in_bf16_follows_megatron(dist_pool, family_dirs):
    """bf16 (dtype auto on a CPU with bf16 units, models of hidden >= 512): the lean forward's decode attention runs
    on SDPA and its linears on weights packed for oneDNN once per chunk; the sampled tokens' log-probs stay within
    bf16's rounding of Megatron's full forward on the same sequences."""
    from hybridrl.rollout import fast_decode

    for name, (lean, full, packed, layers) in dist_pool(2).run(_bf16_lean_vs_full_forward, family_dirs)[0].items():
        assert packed == (4 * layers if fast_decode._ONEDNN_PACKING else 0), name
        gap = (lean - full).abs()
        assert gap.max().item() <= 0.05 and gap.mean().item() <= 0.005, (name, gap.max().item(), gap.mean().item())
        assert lean.lt(0).any(), name  # real log-probs, not zeros


class _MaskIgnoringAttention(torch.nn.Module):
    """Transformer Engine's attention as its layer spec runs it (causal in the prefill, no_mask in decode steps),
    on CPU: Megatron's local attention with the engine's padding mask dropped (its softmax then builds the causal
    mask itself in the prefill). Not a DotProductAttention, as TE's is not."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        return self.inner(query, key, value, None, *args, **kwargs)


def _left_padding_with_mask_ignoring_attention(model_dir: str) -> dict:
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout import native

    initialize_model_parallel(ParallelLayout(tp=1, dp=2))
    model, hf_config = _build_model(model_dir)
    params = SamplingParams(n=2, seed=3, temperature=1.0, max_new_tokens=NEW_TOKENS)

    def generate(honours=None):
        engine = native.NativeRolloutEngine(model, vocab_size=hf_config.vocab_size, max_model_len=32,
                                            max_batch_size=4, fast_forward=False)
        if honours is not None:  # as before the fix: padded rows batched together whatever the attention
            engine.one_length_per_batch = not honours
        batch = engine.generate(PROMPTS, params)
        return {"tokens": batch["responses"], "log_probs": batch["rollout_log_probs"],
                "one_length": engine.one_length_per_batch, "prompts": batch["prompts"]}

    out = {"local": generate()}
    for layer in model.decoder.layers:
        layer.self_attention.core_attention = _MaskIgnoringAttention(layer.self_attention.core_attention)
    out["te_like"], out["te_like_padded"] = generate(), generate(honours=True)
    return out


def test_attention_that_ignores_masks_never_sees_left_padding(dist_pool, model_dirs):
    """Issue 36 item 7: with Transformer Engine's attention (it ignores the padding mask) the native engine batches
    prompts by length, so its tokens and log-probs equal those of Megatron's masked local attention; batched with
    left padding, as before, they differ."""
    out = dist_pool(2).run(_left_padding_with_mask_ignoring_attention, model_dirs[0])[0]
    local, te_like, padded = out["local"], out["te_like"], out["te_like_padded"]
    assert not local["one_length"] and te_like["one_length"]
    assert torch.equal(te_like["prompts"], local["prompts"])  # rows come back in the caller's order
    assert torch.equal(te_like["tokens"], local["tokens"])
    assert (te_like["log_probs"] - local["log_probs"]).abs().max().item() <= 1e-5
    assert (padded["log_probs"] - local["log_probs"]).abs().max().item() > 1e-3  # the bug the grouping removes
