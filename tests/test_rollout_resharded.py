"""The native rollout engine fed by the 3D-HybridEngine's Resharder generates what it generates on the
original Hugging Face weights at t_g = 1.

Four gloo ranks. Per (training layout -> generation t_g): build the training-layout Megatron model from HF
weights, reshard it (hybrid strategy) into a generation-layout model on the strided generation TP groups,
generate with the native engine; then a second "iteration": new weights land in the training model, the
same Resharder moves them, the engine drops its KV cache (load_weights()) and generates again. The
reference is a native engine on a TP=1 model loaded straight from each HF checkpoint.
"""
import pytest
import torch

from hybridrl.rollout import SamplingParams

pytestmark = pytest.mark.slow  # 1-2 min on 2 cores (load-dependent): 4 ranks, 4 layouts x 2 iterations

PROMPTS = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15], [7], [20, 21, 22]]
NEW_TOKENS = 8
MODEL = dict(vocab_size=120, hidden=64, heads=8, kv_heads=4, layers=2)  # GQA; vocab padded by Megatron
PARAMS = {"greedy": SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS),
          "sample": SamplingParams(n=2, seed=7, temperature=0.9, top_k=30, max_new_tokens=NEW_TOKENS)}
# (training t, p, d) -> generation t_g (p_g = 1)
CASES = [((4, 1, 1), 2), ((4, 1, 1), 1), ((2, 1, 2), 1), ((2, 2, 1), 2)]


def _plain(batch) -> dict:
    return {key: batch[key].clone() for key in ("responses", "response_mask", "rollout_log_probs")}


def _generate_all(engine) -> dict:
    return {name: _plain(engine.generate(PROMPTS, params)) for name, params in PARAMS.items()}


def _reference_on_hf_weights(model_dir: str) -> dict:
    """Native engine at t_g = 1 on a model loaded directly from the HF checkpoint."""
    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.rollout.native import NativeRolloutEngine

    initialize_model_parallel(ParallelLayout(dp=4))
    hf_config = load_hf_config(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, model_dir, hf_config)
    engine = NativeRolloutEngine(model.eval(), max_model_len=32, vocab_size=hf_config.vocab_size)
    return _generate_all(engine)


def _resharded_suite(model_dirs: tuple[str, str]) -> dict:
    import torch.distributed as dist

    from hybridrl.hybrid_engine.megatron_adapter import (generation_pg_collection, load_generation_weights,
                                                         training_params)
    from hybridrl.hybrid_engine.reshard import Resharder
    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.generation import GenerationGroups, GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.rollout.native import NativeRolloutEngine

    rank = dist.get_rank()
    out: dict = {"reference": [_reference_on_hf_weights(d) for d in model_dirs]}
    for (t, p, d), tg in CASES:
        layout = ParallelLayout(tp=t, pp=p, dp=d)
        initialize_model_parallel(layout)
        hf_config = load_hf_config(model_dirs[0])
        train_model = build_gpt_model(hf_config)
        load_hf_weights(train_model, model_dirs[0], hf_config)
        groups = GenerationGroups(layout, GenerationLayout(tp=tg))
        resharder = Resharder(groups, training_params(train_model, layout.coords(rank).pp), "hybrid")
        pgs = generation_pg_collection(groups)
        gen_model = build_gpt_model(hf_config, pg_collection=pgs,
                                    padded_vocab_size=train_model.hybridrl_args.padded_vocab_size).eval()
        engine = NativeRolloutEngine(gen_model, max_model_len=32, vocab_size=hf_config.vocab_size)
        case: dict = {"gen_tp_group": dist.get_process_group_ranks(engine.tp_group),
                      "expected_group": next(g for g in groups.gen_tp_groups() if rank in g)}
        for iteration, model_dir in enumerate(model_dirs):
            if iteration:  # the "update" changed the training weights in place; the same Resharder moves them
                load_hf_weights(train_model, model_dir, hf_config)
            load_generation_weights(gen_model, resharder.to_generation())
            engine.load_weights()  # weights already written in place: only drop KV state
            case[iteration] = _generate_all(engine)
            resharder.to_training()
        case["recv_bytes"] = resharder.last_stats.recv_payload_bytes
        out[(t, p, d, tg)] = case
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from hybridrl.models.tiny import create_tiny_model

    root = tmp_path_factory.mktemp("resharded_rollout")
    return (str(create_tiny_model(root / "old", seed=0, **MODEL)),
            str(create_tiny_model(root / "new", seed=1, **MODEL)))


@pytest.fixture(scope="module")
def results(dist_pool, model_dirs):
    return dist_pool(4).run(_resharded_suite, model_dirs, timeout_s=400)


def _hf_greedy(model_dir: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def test_reference_is_transformers_greedy(results, model_dirs):
    for iteration, model_dir in enumerate(model_dirs):
        assert results[0]["reference"][iteration]["greedy"]["responses"].tolist() == _hf_greedy(model_dir)
    assert not torch.equal(results[0]["reference"][0]["greedy"]["responses"],
                           results[0]["reference"][1]["greedy"]["responses"])


@pytest.mark.parametrize("case", CASES, ids=[f"{t}-{tg}" for t, tg in CASES])
def test_resharded_native_engine_equals_hf_weights_tg1(results, case):
    (t, p, d), tg = case
    key = (t, p, d, tg)
    for rank, r in enumerate(results):
        got = r[key]
        assert got["gen_tp_group"] == got["expected_group"], rank  # the strided generation TP group
        assert len(got["gen_tp_group"]) == tg
        for iteration in (0, 1):
            for name in PARAMS:
                mine, ref = got[iteration][name], r["reference"][iteration][name]
                assert torch.equal(mine["responses"], ref["responses"]), (rank, iteration, name)
                assert torch.equal(mine["response_mask"], ref["response_mask"]), (rank, iteration, name)
                diff = (mine["rollout_log_probs"] - ref["rollout_log_probs"]).abs().max().item()
                assert diff <= 1e-4, (rank, iteration, name, diff)
    if t * p > tg:
        assert all(r[key]["recv_bytes"] > 0 for r in results)  # weights really moved between ranks
