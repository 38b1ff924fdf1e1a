"""Collectives on a device group receive tensors of that group's device (issue 36 item 8), on CPU through the
harness tests/nccl_harness.py: inside it, a tensor hybridrl's code makes on the host (no device named) and
passes to a collective fails the test as it would fail on NCCL. One process group of 2 ranks for the module.
"""
from __future__ import annotations

import pytest
import torch

WORLD = 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from hybridrl.models.tiny import create_tiny_model

    return str(create_tiny_model(tmp_path_factory.mktemp("nccl") / "moe", family="qwen3_moe", seed=2,
                                 vocab_size=128, hidden=64, heads=4, kv_heads=2, layers=2, experts=4, topk=2))


def _old_code_is_caught():
    """The harness against the code as it was (compiled as a hybridrl file): the MoE metrics' CPU float64 counts
    and the partial rollout's CPU count reach all_reduce and fail."""
    from nccl_harness import HYBRIDRL, device_collectives

    snippets = {"moe_metrics": "counts = torch.zeros(2, 4, dtype=torch.float64)\n"
                               "counts[0] += torch.ones(4).to(torch.float64).cpu()\n"
                               "dist.all_reduce(counts.clone())\n",
                "partial_rollout": "sent = torch.tensor([3], dtype=torch.long)\n"
                                   "dist.all_reduce(sent, op=dist.ReduceOp.MIN)\n",
                "fixed": "x = torch.zeros(2, device=torch.device('cpu'))\ndist.all_reduce(x + 1)\n"}
    out = {}
    for name, source in snippets.items():
        code = compile(source, f"{HYBRIDRL}/old_{name}.py", "exec")
        try:
            with device_collectives():
                exec(code, {"torch": torch, "dist": torch.distributed})
            out[name] = "passed"
        except AssertionError as exc:
            out[name] = str(exc)
    return out


def test_harness_rejects_host_tensors_in_collectives(dist_pool):
    for r in dist_pool(WORLD).run(_old_code_is_caught):
        assert "host tensor (made at old_moe_metrics.py:" in r["moe_metrics"]
        assert "host tensor (made at old_partial_rollout.py:1)" in r["partial_rollout"]
        assert r["fixed"] == "passed"


def _moe_update_and_generation(model_dir):
    """A MoE actor's update (routing metrics, loss normaliser, micro-batch agreement, gradient check) and a
    generation at t_g = 2 (the shared sampling seed's broadcast, the lean decode's all-reduces), all under the
    harness; then the partial rollout's check for newer weights on the replica's TP group."""
    from nccl_harness import device_collectives

    from hybridrl.config import OptimConfig
    from hybridrl.hybrid_engine.engine import HybridEngine
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.generation import GenerationLayout
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.protocol import Batch
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.native import NativeRolloutEngine
    from hybridrl.workers.megatron_model import MegatronModel
    from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms
    from hybridrl.workers.rollout import RolloutWorker

    rank = torch.distributed.get_rank()
    out = {}
    with device_collectives() as seen:
        initialize_model_parallel(ParallelLayout(tp=1, dp=2))
        model = MegatronModel(model_dir, micro_batch_size=2, max_tokens_per_micro_batch=None,
                              optim=OptimConfig(lr=1e-3))
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(1, 128, (4, 10), generator=g)
        data = Batch({"prompts": ids[:, :5], "responses": ids[:, 5:],
                      "attention_mask": torch.ones(4, 10, dtype=torch.long),
                      "response_mask": torch.ones(4, 5, dtype=torch.long), "advantages": torch.randn(4, 5)})
        metrics = model.train_epochs(data, lambda mb, logits: actor_loss_terms(mb, logits, 128, None,
                                                                                PolicyLossConfig()),
                                     ["response_mask", "advantages"])
        out["expert_tokens"] = sum(v for k, v in metrics.items() if k.startswith("moe/expert_tokens"))
        out["update_collectives"] = seen.checked

        layout = ParallelLayout(tp=2)
        initialize_model_parallel(layout)
        train = MegatronModel(model_dir, micro_batch_size=2, sequence_parallel=False)
        engine = HybridEngine(train.model, train.hf_config, layout, GenerationLayout(tp=2))
        rollout = NativeRolloutEngine(engine.gen_model, max_model_len=32, vocab_size=128)
        before = seen.checked
        batch = rollout.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4))  # seed drawn + broadcast
        out["generated"] = int(batch["response_mask"].sum())
        out["generation_collectives"] = seen.checked - before

        class Bridge:
            device = torch.device("cpu")

            def announced(self):
                return 2 + rank

        replica = RolloutWorker.__new__(RolloutWorker)
        replica._bridge, replica.engine, replica.version = Bridge(), rollout, 1
        out["newer"] = replica._newer_weights_sent()
        out["sent"] = replica._sent
    return out


def test_device_group_collectives_get_device_tensors(dist_pool, moe_dir):
    """Before the fix the MoE routing metrics all-reduced a CPU float64 tensor on the role's group and the
    partial rollout a CPU count on the replica's TP group: on GPUs both fail ("No backend type associated with
    device type cpu"), here the harness fails them."""
    for rank, r in enumerate(dist_pool(WORLD).run(_moe_update_and_generation, moe_dir)):
        assert r["expert_tokens"] > 0 and r["update_collectives"] >= 3, (rank, r)
        assert r["generated"] > 0 and r["generation_collectives"] >= 1, (rank, r)
        assert r["newer"] and r["sent"] == 2, (rank, r)  # the two TP ranks agree on the smaller count


def _export_under_the_harness(model_dir):
    """The HF export at PP=2: rank 1's layers reach rank 0 one tensor at a time over point-to-point messages on the
    collective device (before: one gather_object of whole state dicts, world x a rank's part on rank 0's GPU)."""
    from nccl_harness import device_collectives
    from safetensors.torch import load_file

    from hybridrl.models import build_gpt_model, load_hf_config, load_hf_weights
    from hybridrl.models.checkpoint_hf import gather_hf_state_dict
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout

    initialize_model_parallel(ParallelLayout(pp=2))
    hf = load_hf_config(model_dir)
    model = build_gpt_model(hf)
    load_hf_weights(model, model_dir, hf)
    with device_collectives() as seen:
        state = gather_hf_state_dict(model, hf)
    if state is None:
        return {"messages": seen.checked}
    source = load_file(f"{model_dir}/model.safetensors")
    return {"messages": seen.checked, "same_names": sorted(state) == sorted(source),
            "equal": all(torch.equal(state[n], source[n]) for n in source)}


def test_hf_export_sends_tensor_by_tensor(dist_pool, moe_dir):
    results = dist_pool(WORLD).run(_export_under_the_harness, moe_dir)
    assert results[0]["same_names"] and results[0]["equal"]
    assert results[1]["messages"] > 10 and results[0]["messages"] == results[1]["messages"]  # one send per tensor
