"""Each CPU/gloo shim fixes a real failure: every check runs in a fresh process without the patches
(it must fail with the known upstream error) and with them (it must work and give correct values).

Two subprocesses in all (one without, one with `megatron_patches.apply()`), each running every check,
keep this cheap. The version guard and the CUDA no-op are checked in the unpatched one, after its
checks, because apply() must leave a refused process untouched.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, sys, traceback, warnings
warnings.filterwarnings("ignore")
import torch

def rng():
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=1, ep_rank=0, etp_rank=0)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(7)
    outside_before = torch.rand(2)
    torch.manual_seed(7)
    torch.rand(1)
    with tracker.fork():
        first = torch.rand(3)
    with tracker.fork():
        second = torch.rand(3)  # the tracked stream continues where it stopped
    outside_after = torch.rand(1)  # the default stream is untouched by the forks
    expected = torch.Generator().manual_seed(123 + 2718 + 1)  # upstream: seed + 2718 + tp_rank
    want = torch.rand(6, generator=expected)
    return {"fork_ok": torch.equal(torch.cat([first, second]), want),
            "default_ok": torch.equal(outside_after, outside_before[1:])}

def cuda_device():
    from megatron.core.utils import GlobalMemoryBuffer
    buf = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")  # device=torch.cuda.current_device()
    x = torch.arange(4.0)
    moved = x.cuda().to("cuda:0").to(device="cuda", dtype=torch.float64).pin_memory()
    torch.cuda.nvtx.range_push("r"); torch.cuda.nvtx.range_pop()
    stream = torch.cuda.Stream(); stream.wait_stream(torch.cuda.current_stream()); torch.cuda.synchronize()
    made = torch.zeros(3, device="cuda", pin_memory=True)
    with torch.device("meta"):  # the device context still redirects the (wrapped) factories
        meta = [torch.tensor([]).device.type, torch.zeros(2).device.type, torch.arange(3).device.type]
    return {"meta": meta, "buffer": [list(buf.shape), str(buf.device)], "moved": moved.tolist(), "moved_dtype": str(moved.dtype),
            "made": [made.tolist(), str(made.device)], "device": str(torch.cuda.current_device())}

def tensor_type():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.ones(4)
    clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=10.0)
    return {"grad": param.grad.tolist(), "type_outside": torch.ones(1).type()}

def norm_sp():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                               sequence_parallel=True, normalization="RMSNorm", use_cpu_initialization=True)
    norm = WrappedTorchNorm(config=config, hidden_size=8, eps=1e-5)
    x = torch.randn(3, 8)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
        diff = (norm(x) - want).abs().max().item()
    import megatron_patches
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    return {"tagged": all(getattr(p, "sequence_parallel", False) for p in norm.parameters()),
            "diff": diff, "config_sp_kept": config.sequence_parallel,
            "helper_tagged": megatron_patches.mark_sequence_parallel_params(plain),
            "linear_untagged": not hasattr(plain[0].weight, "sequence_parallel")}

def moe():
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    inp, weight = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    out = router_gating_linear(inp, weight, None, torch.float32)
    out.sum().backward()
    return {"diff": (out - inp @ weight.t()).abs().max().item(),
            "grad_diff": (inp.grad - weight.sum(0).expand(5, 8)).abs().max().item()}

def single_rank():
    import tempfile
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode
    from megatron.core.distributed import param_and_grad_buffer as buffers
    calls = []
    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    bucket = torch.arange(6.0)
    other = torch.zeros(6)
    with Count():
        buffers.dist_reduce_scatter_func(bucket[0:6], bucket, group=dist.group.WORLD)  # the shard is the bucket
        buffers.dist_all_gather_func(bucket, bucket[0:6], group=dist.group.WORLD)
        in_place = [c for c in calls if c.endswith("_single")]
        calls.clear()
        buffers.dist_all_gather_func(other, bucket, group=dist.group.WORLD)  # not the same memory: upstream
    return {"in_place_collectives": in_place, "bucket": bucket.tolist(),
            "copied": other.tolist(), "other_collectives": [c for c in calls if c.endswith("_single")]}

def transformers_load():
    # Regression: transformers 5 detects `with torch.device("meta")` through torch.tensor([]).device;
    # wrapped factories once hid it and from_pretrained left rotary inv_freq uninitialised.
    import tempfile
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    with tempfile.TemporaryDirectory() as tmp:
        built = LlamaForCausalLM(config)
        built.save_pretrained(tmp)
        loaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        ids = torch.arange(8).view(1, 8)
        with torch.no_grad():
            logits_diff = (loaded(ids).logits - built(ids).logits).abs().max().item()
    want = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
    return {"inv_freq_diff": (loaded.model.rotary_emb.inv_freq - want).abs().max().item(),
            "logits_diff": logits_diff}

def version_guard():
    import megatron.core, megatron_patches
    real = megatron.core.__version__
    megatron.core.__version__ = "0.21.0"
    try:
        megatron_patches.apply()
        return {"raised": None}
    except megatron_patches.UnsupportedMegatronVersion as exc:
        message = str(exc)
    finally:
        megatron.core.__version__ = real
    try:
        torch.cuda.current_device()
        untouched = False
    except AssertionError:
        untouched = True
    return {"raised": message, "untouched": untouched, "applied": megatron_patches.applied()}

def gpu_without_te():
    # a GPU process whose transformer_engine does not import: only the shims that stand in for TE apply
    import megatron_patches
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    sys.modules["transformer_engine"] = None  # import transformer_engine -> ImportError
    try:
        result = megatron_patches.apply()
    finally:
        torch.cuda.is_available = real
    from megatron.core.transformer import TransformerConfig, torch_norm
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, sequence_parallel=True,
                               tensor_model_parallel_size=2, normalization="RMSNorm", use_cpu_initialization=True)
    norm = torch_norm.WrappedTorchNorm(config, 8, normalization="RMSNorm")
    return {"result": result, "applied": megatron_patches.applied(),
            "sp_norm_tagged": all(getattr(p, "sequence_parallel", False) for p in norm.parameters())}

CHECKS = [rng, cuda_device, tensor_type, norm_sp, moe, single_rank]
mode = sys.argv[1]
if mode == "patched":
    import megatron_patches
    first, again = megatron_patches.apply(), megatron_patches.apply()
    results = {"apply": {"ok": True, "first": first, "again": again}}
    CHECKS += [transformers_load]
else:
    results = {}
    CHECKS += [version_guard, gpu_without_te]
for check in CHECKS:
    try:
        results[check.__name__] = {"ok": True, **check()}
    except BaseException as exc:
        results[check.__name__] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                   "trace": traceback.format_exc()[-1500:]}
print("RESULTS " + json.dumps(results))
'''


def _start_child(mode: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", CHILD, mode], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _results(proc: subprocess.Popen, mode: str) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"child ({mode}) failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.fixture(scope="module")
def children() -> dict:
    procs = {mode: _start_child(mode) for mode in ("unpatched", "patched")}  # both at once
    return {mode: _results(proc, mode) for mode, proc in procs.items()}


@pytest.fixture(scope="module")
def unpatched(children) -> dict:
    return children["unpatched"]


@pytest.fixture(scope="module")
def patched(children) -> dict:
    return children["patched"]


# The failures these checks provoke exist only without CUDA (the shims are a no-op with it).
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims apply only where CUDA is absent")


def _failed_with(result: dict, error: str) -> None:
    assert not result["ok"], f"expected the unpatched snippet to fail with {error!r}, it worked: {result}"
    assert error in result["error"], result


def _worked(result: dict) -> dict:
    assert result["ok"], result.get("trace", result)
    return result


@cpu_only
def test_apply_is_idempotent_and_names_its_patches(patched):
    from megatron_patches import PATCHES

    assert patched["apply"]["first"] == list(PATCHES) == patched["apply"]["again"]


@cpu_only
def test_rng_tracker_uses_cpu_generator(unpatched, patched):
    _failed_with(unpatched["rng"], "Torch not compiled with CUDA enabled")
    result = _worked(patched["rng"])
    assert result["fork_ok"] and result["default_ok"], result


@cpu_only
def test_cuda_device_calls_map_to_cpu(unpatched, patched):
    _failed_with(unpatched["cuda_device"], "Torch not compiled with CUDA enabled")
    result = _worked(patched["cuda_device"])
    assert result["buffer"] == [[2, 3], "cpu"]
    assert result["moved"] == [0.0, 1.0, 2.0, 3.0] and result["moved_dtype"] == "torch.float64"
    assert result["made"] == [[0.0, 0.0, 0.0], "cpu"]
    assert result["device"] == "cpu"
    assert result["meta"] == ["meta", "meta", "meta"]


@cpu_only
def test_patched_process_still_loads_transformers_models(patched):
    result = _worked(patched["transformers_load"])
    assert result["inv_freq_diff"] < 1e-6 and result["logits_diff"] < 1e-5, result


@cpu_only
def test_tensor_type_scoped_to_optimizer_checks(unpatched, patched):
    _failed_with(unpatched["tensor_type"], "AssertionError")
    assert "param.grad.type() == 'torch.cuda.FloatTensor'" in unpatched["tensor_type"]["trace"]
    result = _worked(patched["tensor_type"])
    assert result["grad"] == pytest.approx([1.0 / (10.0 + 1e-6)] * 4, abs=1e-7)
    assert result["type_outside"] == "torch.FloatTensor"  # Tensor.type is only renamed inside the optimizer


@cpu_only
def test_torch_norm_accepts_sequence_parallel_and_tags_params(unpatched, patched):
    _failed_with(unpatched["norm_sp"], "sequence parallel not supported by torch LayerNorm")
    result = _worked(patched["norm_sp"])
    assert result["tagged"] and result["config_sp_kept"]
    assert result["diff"] < 1e-6
    assert result["helper_tagged"] == 2 and result["linear_untagged"]


@cpu_only
def test_moe_router_without_transformer_engine(unpatched, patched):
    _failed_with(unpatched["moe"], "NameError: name 'te_general_gemm' is not defined")
    result = _worked(patched["moe"])
    assert result["diff"] < 1e-5 and result["grad_diff"] < 1e-5


@cpu_only
def test_single_rank_data_parallel_skips_in_place_collectives(unpatched, patched):
    """Unpatched, gloo copies a one-rank bucket onto itself (a reduce-scatter and an all-gather); patched, no
    collective runs and the bucket is unchanged; a copy into other memory still goes to gloo."""
    plain, skipped = _worked(unpatched["single_rank"]), _worked(patched["single_rank"])
    assert plain["in_place_collectives"] == ["reduce_scatter_single", "all_gather_single"], plain
    assert skipped["in_place_collectives"] == [] and skipped["bucket"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert skipped["other_collectives"] == ["all_gather_single"] and skipped["copied"] == skipped["bucket"]


@cpu_only
def test_unsupported_version_is_refused_before_patching(unpatched):
    result = _worked(unpatched["version_guard"])
    assert result["raised"] and "0.21.0" in result["raised"] and ">=0.16,<0.20" in result["raised"]
    assert "pip install" in result["raised"]
    assert result["untouched"] and result["applied"] == []


@cpu_only
def test_gpu_without_transformer_engine_gets_only_the_no_te_shims(unpatched):
    """The shims that stand in for TE are gated on "TE absent", not on "CUDA absent" (issue 36 item 9): a GPU
    process without TE gets the sequence-parallel torch norm, the MoE router gemm and torch Adam's checkpoint
    fix, and none of the CPU/gloo shims; a GPU process with TE gets only the sequence-parallel norm (a LoRA model's
    local layers beside TE build it)."""
    from megatron_patches import PATCHES, patches_for

    result = _worked(unpatched["gpu_without_te"])
    assert result["result"] == result["applied"] == ["norm_sp", "moe_gemm", "optim_ckpt"]
    assert result["sp_norm_tagged"]
    assert patches_for(cuda=True, transformer_engine=True) == ("norm_sp",)
    assert set(patches_for(cuda=False, transformer_engine=False)) == set(PATCHES) == {
        "rng", "cuda_device", "tensor_type", "norm_sp", "moe", "moe_gemm", "optim_ckpt", "single_rank", "fsdp_mesh"}


@pytest.mark.parametrize("version", ["0.15.3", "0.20.0", "1.0.0", "not-a-version"])
def test_check_version_refuses(version):
    from megatron_patches import UnsupportedMegatronVersion, check_version

    with pytest.raises(UnsupportedMegatronVersion, match="megatron-core"):
        check_version(version)


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", "0.19.2"])
def test_check_version_accepts(version):
    from megatron_patches import check_version

    check_version(version)
