"""Bad inputs to `hybridrl convert` and the model builder fail clearly, before any process starts."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridrl.cli import main as cli_main
from hybridrl.cli.convert import DTYPE_NAMES
from hybridrl.models import convert
from hybridrl.models.config import CheckpointError, rope_settings, transformer_config_from_hf
from hybridrl.models.families import UnsupportedModelError, family_for
from hybridrl.models.tiny import create_tiny_model, tiny_hf_config
from hybridrl.parallel.layout import LayoutError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("errors") / "llama", "llama", layers=4, heads=4, kv_heads=2)


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    """Every case here must be refused before a worker process is spawned."""
    def refuse(*args, **kwargs):
        raise AssertionError("a conversion process was started for bad input")
    monkeypatch.setattr("torch.multiprocessing.spawn", refuse)


def _copy(tiny, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny, target)
    return target


def _convert(capsys, *args) -> str:
    assert cli_main(["convert", *map(str, args)]) == 2
    return capsys.readouterr().err


def test_unsupported_architecture_lists_supported(tiny, tmp_path, capsys):
    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    GPT2Config(n_layer=2, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
    err = _convert(capsys, "--from", "hf", "--to", "mcore", folder, tmp_path / "out")
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err and "Qwen2ForCausalLM" in err


@pytest.mark.parametrize("tp,pp,needle", [(3, 1, "num_attention_heads=4 is not divisible by tp=3"),
                                          (4, 1, "num_key_value_heads=2 is not divisible by tp=4"),
                                          (1, 3, "num_layers=4 is not divisible by pp")])
def test_layout_that_does_not_divide_the_model(tiny, tmp_path, capsys, tp, pp, needle):
    err = _convert(capsys, "--from", "hf", "--to", "mcore", "--tp", tp, "--pp", pp, tiny, tmp_path / "out")
    assert needle in err


def test_missing_config_and_missing_safetensors_file(tiny, tmp_path, capsys):
    err = _convert(capsys, "--from", "hf", "--to", "mcore", tmp_path, tmp_path / "out")
    assert "no config.json" in err
    folder = _copy(tiny, tmp_path)
    (folder / "model.safetensors").unlink()
    assert "no model.safetensors" in _convert(capsys, "--from", "hf", "--to", "mcore", folder, tmp_path / "out")


def test_missing_file_named_in_index(tiny, tmp_path, capsys):
    folder = _copy(tiny, tmp_path)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[:5]}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in names[5:]})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    err = _convert(capsys, "--from", "hf", "--to", "mcore", folder, tmp_path / "out")
    assert "model-00002-of-00002.safetensors" in err and "missing" in err


def test_missing_tensor_and_wrong_shape(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    without = {k: v for k, v in weights.items() if k != "model.layers.2.mlp.up_proj.weight"}
    save_file(without, str(folder / "model.safetensors"), metadata={"format": "pt"})
    err = _convert(capsys, "--from", "hf", "--to", "mcore", folder, tmp_path / "out")
    assert "'model.layers.2.mlp.up_proj.weight' is missing" in err
    weights["model.layers.2.mlp.up_proj.weight"] = torch.zeros(3, 64)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    err = _convert(capsys, "--from", "hf", "--to", "mcore", folder, tmp_path / "out")
    assert "model.layers.2.mlp.up_proj.weight" in err and "shape [3, 64]" in err


def test_truncated_safetensors_file(tiny, tmp_path, capsys):
    folder = _copy(tiny, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    err = _convert(capsys, "--from", "hf", "--to", "mcore", folder, tmp_path / "out")
    assert "truncated" in err and "model.safetensors" in err


def test_missing_megatron_metadata(tiny, tmp_path, capsys):
    mcore = tmp_path / "mcore"
    mcore.mkdir()
    (mcore / "hybridrl_model.json").write_text("{}")
    err = _convert(capsys, "--from", "mcore", "--to", "hf", mcore, tmp_path / "out")
    assert "missing Megatron checkpoint metadata (metadata.json)" in err
    (mcore / "metadata.json").write_text("{}")
    (mcore / "hybridrl_model.json").unlink()
    assert "missing hybridrl_model.json" in _convert(capsys, "--from", "mcore", "--to", "hf", mcore, tmp_path / "o")


def test_bad_direction_and_non_empty_destination(tiny, tmp_path, capsys):
    assert "is not a conversion" in _convert(capsys, "--from", "hf", "--to", "hf", tiny, tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "not an empty folder" in _convert(capsys, "--from", "hf", "--to", "mcore", tiny, tmp_path / "full")


def test_config_features_megatron_would_get_wrong():
    yarn = tiny_hf_config("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 64})
    with pytest.raises(UnsupportedModelError, match="rope_scaling type 'yarn' is not supported"):
        rope_settings(yarn)
    odd_llama3 = tiny_hf_config("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192})
    with pytest.raises(UnsupportedModelError, match="low_freq_factor"):
        rope_settings(odd_llama3)
    assert rope_settings(tiny_hf_config("llama", rope_theta=5e5)).theta == 5e5
    qwen_window = tiny_hf_config("qwen2")
    qwen_window.use_sliding_window = True
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        transformer_config_from_hf(qwen_window)
    biased = tiny_hf_config("llama")
    biased.attention_bias = True
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        transformer_config_from_hf(biased)
    with pytest.raises(UnsupportedModelError, match=r"expert parallelism \(ep=2, expert_tp=None\) for a model without"):
        transformer_config_from_hf(tiny_hf_config("llama"), ep=2)


def test_transformer_config_fields():
    config = transformer_config_from_hf(tiny_hf_config("qwen2", heads=4, kv_heads=2, hidden=64), tp=2)
    assert (config.num_query_groups, config.kv_channels, config.add_qkv_bias, config.add_bias_linear) == (2, 16, True, False)
    assert config.normalization == "RMSNorm" and config.gated_linear_unit and config.use_cpu_initialization
    assert not (config.bias_activation_fusion or config.masked_softmax_fusion or config.bias_dropout_fusion)
    assert family_for(tiny_hf_config("llama", head="seq_cls")).name == "llama"


def test_plan_accepts_good_input(tiny, tmp_path):
    job = convert.plan("hf", "mcore", str(tiny), str(tmp_path / "out"), tp=2, pp=2)
    assert job.layout.world_size == 4 and job.head == "lm" and job.dtype == torch.float32
    with pytest.raises(LayoutError):
        convert.plan("hf", "mcore", str(tiny), str(tmp_path / "out"), tp=0)
    with pytest.raises(CheckpointError, match="does not exist"):
        convert.plan("hf", "mcore", str(tmp_path / "nope"), str(tmp_path / "out"))


def test_convert_command_offers_the_conversions_dtypes():
    """cli/convert.py names the dtypes itself (models/convert.py imports torch, `hybridrl --help` does not)."""
    assert sorted(DTYPE_NAMES) == sorted(convert.DTYPES)
