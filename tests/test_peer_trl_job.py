"""benchmarks/peer_trl.py's job (benchmarks/peer_job.py): both sides read the same checkpoint, tokenizer and prompts, score with the
same rule, and the hybridrl side's config is the one-update, no-reference GRPO the comparison needs.
(The TRL venv is never created here, and no timing is asserted.)"""
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
peer_trl = pytest.importorskip("peer_job")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return peer_trl.prepare_job("small", cache=tmp_path_factory.mktemp("peer-cache"))


def test_checkpoint_and_tokenizer_are_deterministic(job, tmp_path):
    again = peer_trl.prepare_job("small", cache=tmp_path)
    assert again["weights_sha256"] == job["weights_sha256"]
    assert Path(again["data"]).read_text() == Path(job["data"]).read_text()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (Path(again["model"]) / name).read_text() == (Path(job["model"]) / name).read_text()


def test_hybridrl_prompts_tokenize_like_trl(job):
    """hybridrl's prompt dataset and TRL's `processing_class(text=prompts)` give the same ids, and both
    decode responses with skip_special_tokens before the shared reward."""
    from transformers import AutoConfig, AutoTokenizer

    from hybridrl.data.dataset import PromptDataset

    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    assert len(tokenizer) == len(peer_trl.VOCAB) == AutoConfig.from_pretrained(job["model"]).vocab_size == 24
    dataset = PromptDataset(job["data"], tokenizer, max_prompt_length=peer_trl.JOB["max_prompt_length"])
    rows = [dataset[i] for i in range(16)]
    trl_ids = tokenizer(text=[row.text for row in rows])["input_ids"]  # TRL's _tokenize_prompts
    for row, ids in zip(rows, trl_ids):
        assert list(row.input_ids) == ids
        assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
        assert row.metadata["target"] == row.text.split()[0]
    response = tokenizer.convert_tokens_to_ids(["sun", "</s>", "ice", "<pad>", "tea"])
    text = tokenizer.decode(response, skip_special_tokens=True)
    assert text == "sun ice tea"
    assert peer_trl.word_reward("warm : ice ice sun", text) == pytest.approx(2 / 4)
    assert peer_trl.word_reward("cold : sun", text, target="cold") == pytest.approx(1 / 4)
    assert peer_trl.word_reward("warm : sun", "sun fire tea sand oven") == 1.0


def test_token_count_skips_the_first_step():
    steps = [{"prompt_tokens": 500, "response_tokens": 2048, "seconds": 9.0},
             {"prompt_tokens": 520, "response_tokens": 2048, "seconds": 1.0},
             {"prompt_tokens": 540, "response_tokens": 2048, "seconds": 1.0}]
    tokens, seconds, per_s = peer_trl.count_tokens_per_s(steps)
    assert (tokens, seconds, per_s) == (520 + 540 + 2 * 2048, 2.0, (520 + 540 + 2 * 2048) / 2.0)


@pytest.mark.parametrize("layout", peer_trl.LAYOUTS)
def test_hybridrl_side_config(job, layout, tmp_path):
    """The overrides plan one update per batch (no old-log-prob pass), no reference, fixed length."""
    from hybridrl.config import load_config
    from hybridrl.trainer.plan import plan_run

    cfg = load_config("configs/grpo_tiny.yaml", peer_trl.hybridrl_overrides(job, layout, 3, tmp_path / "run"))
    plan = plan_run(cfg)
    assert set(plan.roles) == {"actor", "reward"} or "ref" not in plan.roles
    assert plan.step.mini_batches == 1 and cfg.algorithm.ppo_epochs == 1
    assert cfg.rollout.ignore_eos and cfg.rollout.max_new_tokens == 32 and cfg.rollout.n == 4
    assert plan.rows_per_step == 64
    assert plan.roles["actor"].layout.tp == (2 if layout == "tp2->1" else 1)


def test_each_side_runs_in_its_default_environment(monkeypatch):
    """Nothing tunes a side's threads but the side itself: the caller's threading variables are removed, none
    are added (only the offline switches and unbuffered output)."""
    import os

    for key, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"),
                       ("GOMP_SPINCOUNT", "0"), ("KEEP_ME", "yes")):
        monkeypatch.setenv(key, value)
    env, dropped = peer_trl.side_env(None)
    assert {"OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "GOMP_SPINCOUNT"} <= set(dropped)
    assert not [k for k in env if k.startswith(peer_trl.THREAD_VARIABLE_PREFIXES)]
    assert env["KEEP_ME"] == "yes" and "PYTHONPATH" not in env
    assert set(env) - set(os.environ) <= {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
                                          "PYTHONUNBUFFERED"}
    assert peer_trl.side_env("/a:/b")[0]["PYTHONPATH"] == "/a:/b"


def test_natural_length_shape_config(job, tmp_path):
    """A sweep / natural-length shape: EOS ends responses, the step's prompts and response cap follow the shape."""
    from hybridrl.config import load_config
    from hybridrl.trainer.plan import plan_run

    shape = peer_trl.Shape(prompts=64, new_tokens=128, natural=True)
    cfg = load_config("configs/grpo_tiny.yaml", peer_trl.hybridrl_overrides(job, "tp1", 3, tmp_path / "run", shape))
    plan = plan_run(cfg)
    assert not cfg.rollout.ignore_eos and cfg.rollout.max_new_tokens == 128
    assert plan.rows_per_step == 256 == shape.sequences


@pytest.mark.parametrize("precision", ["default", "fp32", "bf16"])
def test_precision_is_the_same_on_both_sides(job, tmp_path, precision):
    """default: each side as its user runs it (hybridrl's dtype auto as the plan resolves it, TRL's bf16=True);
    bf16: hybridrl's actor trains and generates in bfloat16 (fp32 main weights), TRL keeps its default bf16=True;
    fp32: both in float32, TRL told bf16=False."""
    from hybridrl.config import load_config
    from hybridrl.models.precision import model_dtype
    from hybridrl.trainer.plan import plan_run

    shape = peer_trl.Shape(precision=precision)
    cfg = load_config("configs/grpo_tiny.yaml", peer_trl.hybridrl_overrides(job, "tp1", 3, tmp_path / "run", shape))
    plan_run(cfg)
    expected = {"fp32": "float32", "bf16": "bfloat16", "default": model_dtype("auto", job["model"])}[precision]
    assert cfg.actor.model.dtype == expected
    assert shape.trl_precision == ("fp32" if precision == "fp32" else "bf16")
    assert shape.label == "64x32" + ("" if precision == "default" else f" {precision}")
