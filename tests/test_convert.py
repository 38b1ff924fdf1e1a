"""`hybridrl convert` round trips, cross-layout Megatron checkpoints, and the conversion tables."""
from __future__ import annotations

import json

import pytest
import torch

from hybridrl.cli import main as cli_main
from hybridrl.models.families import LLAMA, QWEN2, fuse_qkv, split_qkv, tp_gather, tp_shard
from hybridrl.models.tiny import create_tiny_model, tiny_hf_config
from hybridrl.parallel.layout import ParallelLayout

from reference_model import hf_reference  # tests/: transformers' outputs in a clean process

ATOL = 1e-4


def _load_safetensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# ---- conversion tables (no processes) -------------------------------------------------------------
@pytest.mark.parametrize("family", [LLAMA, QWEN2])
def test_to_hf_inverts_from_hf_for_every_parameter(family):
    config = tiny_hf_config(family.name, layers=2, vocab_size=250)
    shapes = family.expected_hf_tensors(config)
    gen = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    mcore_names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i in range(2):
        mcore_names += [f"decoder.layers.{i}.{n}" for n in (
            "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
        if family.qkv_bias:
            mcore_names.append(f"decoder.layers.{i}.self_attention.linear_qkv.bias")
    seen = {}
    for name in mcore_names:
        full = family.from_hf(name, hf.__getitem__, config, padded_vocab_size=252)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert full.shape[0] == 252 and torch.equal(full[250:], torch.zeros(2, 64))  # minimal padding
        seen.update(dict(family.to_hf(name, full, config)))
    assert set(seen) == set(hf)
    assert all(torch.equal(seen[n], hf[n]) for n in hf)


def test_qkv_is_interleaved_per_query_group():
    # 4 query heads, 2 groups, head_dim 1: rows q0 q1 k0 v0 | q2 q3 k1 v1
    q, k, v = torch.tensor([0., 1, 2, 3]), torch.tensor([10., 11]), torch.tensor([20., 21])
    fused = fuse_qkv(q, k, v, num_query_groups=2, head_dim=1)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.tolist() for t in split_qkv(fused, 2, 2, 1)] == [[0, 1, 2, 3], [10, 11], [20, 21]]


def test_tp_shard_gather_roundtrip_and_swiglu_layout():
    full_fc1 = torch.arange(8.).reshape(8, 1)  # [gate rows 0-3; up rows 4-7]
    shards = [tp_shard("decoder.layers.0.mlp.linear_fc1.weight", full_fc1, 0, r, 2) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # each rank: its gate + its up
    assert torch.equal(tp_gather("decoder.layers.0.mlp.linear_fc1.weight", shards, 0), full_fc1)
    proj = torch.arange(12.).reshape(3, 4)
    parts = [tp_shard("decoder.layers.0.self_attention.linear_proj.weight", proj, 1, r, 2) for r in range(2)]
    assert torch.equal(tp_gather("decoder.layers.0.self_attention.linear_proj.weight", parts, 1), proj)


# ---- the CLI on real processes --------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Tiny Llama (GQA, untied) -> Megatron at TP=2 x PP=2 -> HF at TP=1 x PP=1, via the CLI."""
    root = tmp_path_factory.mktemp("convert")
    source = create_tiny_model(root / "hf", "llama", layers=4, seed=5)
    assert cli_main(["convert", "--from", "hf", "--to", "mcore", "--tp", "2", "--pp", "2",
                     str(source), str(root / "mcore")]) == 0
    assert cli_main(["convert", "--from", "mcore", "--to", "hf", str(root / "mcore"), str(root / "back")]) == 0
    return source, root / "mcore", root / "back"


@pytest.mark.slow
def test_convert_round_trip_is_bit_exact_and_loads_in_transformers(converted):
    source, mcore, back = converted
    meta = json.loads((mcore / "hybridrl_model.json").read_text())
    assert (meta["saved_tp"], meta["saved_pp"], meta["head"]) == (2, 2, "lm")
    original, exported = _load_safetensors(source), _load_safetensors(back)
    assert set(original) == set(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    input_ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    before, after = hf_reference(source, input_ids), hf_reference(back, input_ids)
    assert torch.equal(before.logits, after.logits)


def _logits_from_dist_checkpoint(ckpt_dir: str, layout: ParallelLayout, input_ids: torch.Tensor):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hybridrl.models import build_gpt_model, load_dist_checkpoint
    from hybridrl.models.dist_ckpt import read_dist_checkpoint_info
    from hybridrl.parallel.distributed import initialize_model_parallel

    initialize_model_parallel(layout)
    hf_config, _ = read_dist_checkpoint_info(ckpt_dir)
    model = build_gpt_model(hf_config, sequence_parallel=layout.sequence_parallel)
    load_dist_checkpoint(model, ckpt_dir)
    model.eval()
    # Run the stages in order by hand: stage s receives stage s-1's hidden states
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand(input_ids.shape[0], -1)
    hidden = None
    pp_group, pp_rank = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    ranks = torch.distributed.get_process_group_ranks(pp_group)
    with torch.no_grad():
        for stage in range(layout.pp):
            if stage == pp_rank:
                model.set_input_tensor(hidden)
                out = model(input_ids, positions, attention_mask=None)
            box = [out.contiguous() if stage == pp_rank else None]
            if stage < layout.pp - 1:
                torch.distributed.broadcast_object_list(box, src=ranks[stage], group=pp_group)
                hidden = box[0]
    if not ps.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(out)


@pytest.mark.slow
def test_checkpoint_saved_at_one_layout_loads_at_others(converted, dist_pool):
    source, mcore, _ = converted
    input_ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = hf_reference(source, input_ids)
    pool = dist_pool(4)
    for layout in (ParallelLayout(tp=1, pp=1, dp=4), ParallelLayout(tp=2, pp=1, dp=2),
                   ParallelLayout(tp=1, pp=2, dp=2), ParallelLayout(tp=2, pp=2, dp=1, sequence_parallel=True)):
        results = pool.run(_logits_from_dist_checkpoint, str(mcore), layout, input_ids)
        logits = results[-1]  # the last rank is on the last stage in every layout
        diff = (logits - ref.logits).abs().max().item()
        assert diff <= ATOL, f"saved at tp=2,pp=2, loaded at {layout.describe()}: logits differ by {diff}"


@pytest.mark.slow
def test_padded_vocab_and_tied_qwen2_round_trip(tmp_path):
    """vocab 251 at TP=2 is padded to 252 in Megatron; loading at TP=1 (251) and export strip it again."""
    source = create_tiny_model(tmp_path / "hf", "qwen2", vocab_size=251, layers=2, tie=True, seed=7)
    assert cli_main(["convert", "--from", "hf", "--to", "mcore", "--tp", "2", str(source), str(tmp_path / "mc")]) == 0
    assert cli_main(["convert", "--from", "mcore", "--to", "hf", str(tmp_path / "mc"), str(tmp_path / "back")]) == 0
    original, exported = _load_safetensors(source), _load_safetensors(tmp_path / "back")
    assert set(original) == set(exported) and "lm_head.weight" not in exported  # tied: HF stores one copy
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
