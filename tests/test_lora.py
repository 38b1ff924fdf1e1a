"""LoRA on Megatron (models/lora.py) and PEFT adapter folders as models (models/peft.py), on four gloo ranks.

- one adapter update equals transformers + peft's, at every layout;
- a PEFT adapter folder stands where a model does, merged into its base at load at TP=2 x PP=2: a LoRA causal LM's
  log-probs and a LoRA reward model's scores (its trained score head from modules_to_save) equal peft's (1e-4);
- `hybridrl convert --from peft --to hf --merge-lora` writes a model with peft's logits;
- adapters on a mixture-of-experts model's experts (expert parallel 2) give the log-probs transformers gives with
  W + BA written into every adapted tensor, and their gradients (every EP rank's experts', the dense ones) equal
  transformers' through W + BA with A, B leaves.

One pool for the module. The initial adapters are a peft adapter folder (A kaiming, B random so
both factors get gradients) loaded as lora.init; one policy-gradient step with SGD (the change of each factor is lr x its
gradient) at TP=1 x DP=4, TP=2 x PP=2 and TP=2 + SP x DP=2 equals the gradient peft computes on the
same batch (relative 1e-5; lr 1000 so the step dwarfs the factors' rounding); the base weights do not move and the optimizer holds the adapters only. The reference
log-probs with the adapters off equal the base model's, and the merged weights give the adapters' logits.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_helpers import make_peft_adapter, peft_model, response_log_probs

pytestmark = pytest.mark.slow

RANK, ALPHA, LR = 4, 8.0, 1000.0
LAYOUTS = [dict(tp=1, pp=1, dp=4), dict(tp=2, pp=2, dp=1), dict(tp=2, pp=1, dp=2, sequence_parallel=True)]


def _rollouts(vocab: int = 64, rows: int = 8):
    """Left-padded prompts, right-padded responses (the rollout layout the actor trains on)."""
    from hybridrl.protocol import Batch

    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(1, vocab, (rows, 6), generator=g)
    responses = torch.randint(1, vocab, (rows, 5), generator=g)
    prompt_mask = torch.ones(rows, 6, dtype=torch.long)
    response_mask = torch.ones(rows, 5, dtype=torch.long)
    for i in range(rows):
        prompt_mask[i, : i % 3] = 0
        response_mask[i, 5 - i % 4:] = 0
    prompts = prompts * prompt_mask
    responses = responses * response_mask
    advantages = torch.randn(rows, generator=g)[:, None] * response_mask
    return Batch({"prompts": prompts, "responses": responses, "attention_mask": torch.cat([prompt_mask, response_mask], 1),
                  "response_mask": response_mask, "advantages": advantages.float()})


def _policy_gradient_loss(forward, data) -> torch.Tensor:
    """The token-mean on-policy policy-gradient loss (ratio 1) the Megatron update minimises, from a transformers
    forward(input_ids=..., attention_mask=..., position_ids=...) -> logits."""
    prompts, responses = data["prompts"], data["responses"]
    ids, mask = torch.cat([prompts, responses], 1), data["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = forward(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    log_probs = torch.log_softmax(logits[:, prompts.shape[1] - 1:-1], -1)
    log_probs = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    response_mask = data["response_mask"].float()
    ratio = torch.exp(log_probs - log_probs.detach())
    return (-(data["advantages"] * ratio) * response_mask).sum() / response_mask.sum()


def _peft_gradients(base: str, adapter_dir: str, data) -> dict[str, torch.Tensor]:
    """d(token-mean policy-gradient loss) / d(each LoRA factor) in transformers + peft, by peft key."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter_dir,
                                      is_trainable=True)
    _policy_gradient_loss(model, data).backward()
    return {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}


def _merged_gradients(base: str, factors: dict, data) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF module: (dL/dA, dL/dB)} of the same loss in transformers with every adapted weight W + (alpha / r) B A,
    A and B leaves (peft cannot adapt transformers 5's fused experts): the experts' gate_up_proj [E, 2I, H] and
    down_proj [E, H, I] rebuilt from each expert's merged gate / up / down by torch.func.functional_call."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    weights = dict(model.named_parameters())
    leaves = {m: (a.clone().requires_grad_(True), b.clone().requires_grad_(True)) for m, (a, b) in factors.items()}
    merged = {m: (ALPHA / RANK) * b @ a for m, (a, b) in leaves.items()}
    params = {f"{m}.weight": weights[f"{m}.weight"] + delta for m, delta in merged.items() if ".experts." not in m}
    for layer in sorted({m.split(".experts.")[0] for m in merged if ".experts." in m}):
        gate_up, down = weights[f"{layer}.experts.gate_up_proj"], weights[f"{layer}.experts.down_proj"]
        expert = [f"{layer}.experts.{e}" for e in range(gate_up.shape[0])]
        params[f"{layer}.experts.gate_up_proj"] = gate_up + torch.stack(
            [torch.cat([merged[f"{x}.gate_proj"], merged[f"{x}.up_proj"]]) for x in expert])
        params[f"{layer}.experts.down_proj"] = down + torch.stack([merged[f"{x}.down_proj"] for x in expert])
    assert len(params) == len([m for m in merged if ".experts." not in m]) + 2  # every adapted tensor replaced

    def forward(**inputs):
        return torch.func.functional_call(model, params, (), inputs)

    _policy_gradient_loss(forward, data).backward()
    return {m: (a.grad, b.grad) for m, (a, b) in leaves.items()}


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hybridrl.models.tiny import default_model_dir

    base = str(default_model_dir())
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    folder = tmp_path_factory.mktemp("lora") / "adapter"
    model.save_pretrained(str(folder))
    return base, str(folder)


def _one_update(layout_kwargs: dict, base: str, adapter_dir: str, data) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridrl.config import LoraConfig, OptimConfig
    from hybridrl.models.lora_io import gather_adapter_factors
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.workers.megatron_model import MegatronModel
    from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms

    layout = ParallelLayout(**layout_kwargs)
    initialize_model_parallel(layout)
    model = MegatronModel(base, optim=OptimConfig(optimizer="sgd", lr=LR, clip_grad=1e9,
                                                  use_distributed_optimizer=False),
                          lora=LoraConfig(init=adapter_dir), sequence_parallel=layout.sequence_parallel,
                          max_tokens_per_micro_batch=24)
    base_before = {n: p.detach().clone() for n, p in model.inner.named_parameters() if ".lora." not in n}
    before = gather_adapter_factors(model.model)
    share = data.chunk(layout.dp)[ps.get_data_parallel_rank()]
    tp_group = model.tp_group if model.tp > 1 else None
    cfg = PolicyLossConfig()
    metrics = model.train_step(share, lambda mb, out: actor_loss_terms(mb, out, model.vocab_size, tp_group, cfg),
                               {k: share[k] for k in ("response_mask", "advantages")})
    after = gather_adapter_factors(model.model)
    moved = [n for n, p in model.inner.named_parameters() if ".lora." not in n and not torch.equal(p, base_before[n])]
    optimized = sum(p.numel() for group in model.optimizer.param_groups for p in group["params"])
    adapters = sum(p.numel() for n, p in model.inner.named_parameters() if ".lora." in n)
    result = {"moved": moved, "optimized": optimized, "adapters": adapters, "grad_norm": metrics["grad_norm"]}
    dist.barrier()
    if dist.get_rank() == 0:
        result.update(before=before[0], after=after[0])
    return result


def _peft_folders_as_models(lm_adapter: str, rm_adapter: str, data) -> dict:
    """A LoRA causal LM's response log-probs and a LoRA reward model's last-token scores at TP=2 x PP=2, each
    loaded from its PEFT folder (merged into the base at load); on the last pipeline stage."""
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.workers.megatron_model import MegatronModel
    from hybridrl.workers.policy import response_log_probs as megatron_log_probs
    from hybridrl.workers.sequences import gather_at

    initialize_model_parallel(ParallelLayout(tp=2, pp=2))
    lm = MegatronModel(lm_adapter)
    log_probs = lm.forward(data, lambda mb, out: megatron_log_probs(mb, out, lm.vocab_size, lm.tp_group)[0],
                           {"response_mask": data["response_mask"]})
    rm = MegatronModel(rm_adapter, head="scalar")

    def last_token_score(mb, output):
        return gather_at(output.squeeze(-1).float(), mb, (mb["lengths"] - 1).clamp(min=0).unsqueeze(1)).squeeze(1)

    return {"log_probs": log_probs, "scores": rm.forward(data, last_token_score)}


def _moe_adapters(moe_dir: str, folder: str, data) -> dict:
    """Adapters on every linear of a Qwen3-MoE model (its experts' included) at expert parallel 2 (TP=1, DP=4):
    rank 0 writes the adapters with random B as a PEFT folder (whole factors by HF module), every rank loads them
    as lora.init into its own experts; the response log-probs come back, and each rank's factors' gradients
    (by HF module) from one SGD policy-gradient step."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridrl.config import LoraConfig, OptimConfig
    from hybridrl.models.lora_io import gather_adapter_factors
    from hybridrl.models.peft import write_peft_adapter
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.workers.megatron_model import MegatronModel
    from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms
    from hybridrl.workers.policy import response_log_probs as megatron_log_probs

    initialize_model_parallel(ParallelLayout(tp=1, dp=4, ep=2))
    optim = OptimConfig(optimizer="sgd", lr=1.0, use_distributed_optimizer=False)
    first = MegatronModel(moe_dir, optim=optim, lora=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all"]))
    gathered = gather_adapter_factors(first.model)
    factors = None
    if dist.get_rank() == 0:
        g = torch.Generator().manual_seed(21)
        factors = {m: (a, torch.randn(b.shape, generator=g) * 0.05) for m, (a, b) in sorted(gathered[0].items())}
        write_peft_adapter(folder, factors, rank=RANK, alpha=ALPHA, base=moe_dir)
    dist.barrier()
    sgd = OptimConfig(optimizer="sgd", lr=LR, clip_grad=1e9, use_distributed_optimizer=False)
    model = MegatronModel(moe_dir, optim=sgd, lora=LoraConfig(init=folder))
    log_probs = model.forward(data, lambda mb, out: megatron_log_probs(mb, out, model.vocab_size, model.tp_group)[0],
                              {"response_mask": data["response_mask"]})
    # one SGD step on this DP rank's share (the loss: the token mean over the whole batch): each of this rank's
    # factors (its dense adapters, its EP rank's experts' adapters) moves by LR x its gradient
    before = _local_factors(model.model)
    share = data.chunk(4)[ps.get_data_parallel_rank()]
    metrics = model.train_step(share, lambda mb, out: actor_loss_terms(mb, out, model.vocab_size, None,
                                                                       PolicyLossConfig()),
                               {k: share[k] for k in ("response_mask", "advantages")})
    grads = {m: tuple((x0 - x1) / LR for x0, x1 in zip(before[m], after))
             for m, after in _local_factors(model.model).items()}
    return {"log_probs": log_probs, "factors": factors, "grads": grads, "grad_norm": metrics["grad_norm"],
            "ep_rank": ps.get_expert_model_parallel_rank()}


def _moe_adapters_split_over_tp(moe_dir: str, folder: str, data) -> dict:
    """The same adapters (the folder _moe_adapters wrote) on the same Qwen3-MoE with its experts' linears split
    over TP: TP=2 + SP, EP=2, DP=2 (expert TP = TP). The log-probs come back, and this rank's pieces of each
    factor's change / LR from one SGD step, with the dim along which its TP rank holds them (None: whole)."""
    from megatron.core import parallel_state as ps

    from hybridrl.config import LoraConfig, OptimConfig
    from hybridrl.models.builder import unwrap
    from hybridrl.models.lora import adapters_of
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.workers.megatron_model import MegatronModel
    from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms
    from hybridrl.workers.policy import response_log_probs as megatron_log_probs

    initialize_model_parallel(ParallelLayout(tp=2, dp=2, ep=2, sequence_parallel=True))
    sgd = OptimConfig(optimizer="sgd", lr=LR, clip_grad=1e9, use_distributed_optimizer=False)
    model = MegatronModel(moe_dir, optim=sgd, lora=LoraConfig(init=folder), sequence_parallel=True)
    log_probs = model.forward(data, lambda mb, out: megatron_log_probs(mb, out, model.vocab_size, model.tp_group)[0],
                              {"response_mask": data["response_mask"]})
    before = _local_factors(model.model)
    share = data.chunk(2)[ps.get_data_parallel_rank()]
    metrics = model.train_step(share, lambda mb, out: actor_loss_terms(mb, out, model.vocab_size, model.tp_group,
                                                                       PolicyLossConfig()),
                               {k: share[k] for k in ("response_mask", "advantages")})
    grads = {m: tuple((x0 - x1) / LR for x0, x1 in zip(before[m], after))
             for m, after in _local_factors(model.model).items()}
    split = {module: (adapter.split_dim("A"), adapter.split_dim("B"))
             for adapter in adapters_of(unwrap(model.model)) for module in adapter.hf_modules.values()}
    return {"log_probs": log_probs, "grads": grads, "split": split, "grad_norm": metrics["grad_norm"],
            "tp_rank": ps.get_tensor_model_parallel_rank(), "ep_rank": ps.get_expert_model_parallel_rank(),
            "expert_tp": ps.get_expert_tensor_parallel_world_size()}


def _experts_tp_refusals(moe_dir: str, folder: str) -> dict:
    """What building the adapters raises where the experts' linears are split over a TP group that the dense
    linears do not share (TP=1, expert TP=2, EP=2), and over TP without sequence parallelism (TP=2, EP=1)."""
    from hybridrl.config import LoraConfig, OptimConfig
    from hybridrl.parallel.distributed import initialize_model_parallel
    from hybridrl.parallel.layout import ParallelLayout
    from hybridrl.workers.megatron_model import MegatronModel

    errors = {}
    for name, layout in (("expert_tp", ParallelLayout(tp=1, dp=4, ep=2, etp=2)), ("no_sp", ParallelLayout(tp=2, dp=2))):
        initialize_model_parallel(layout)
        try:
            MegatronModel(moe_dir, optim=OptimConfig(optimizer="sgd", lr=LR, use_distributed_optimizer=False),
                          lora=LoraConfig(init=folder))
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


def _local_factors(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF module: (A, B)} of this rank's adapters (TP=1: whole factors; else its TP pieces), copied."""
    from hybridrl.models.builder import unwrap
    from hybridrl.models.lora import adapters_of

    return {module: tuple(adapter.local_factor(part, f).detach().clone() for f in ("A", "B"))
            for adapter in adapters_of(unwrap(model)) for part, module in adapter.hf_modules.items()}


def _suite(base: str, adapter_dir: str, data, lm_adapter: str, rm_adapter: str, moe: tuple[str, str]) -> dict:
    out = {str(kw): _one_update(kw, base, adapter_dir, data) for kw in LAYOUTS}
    out["peft_models"] = _peft_folders_as_models(lm_adapter, rm_adapter, data)
    out["moe"] = _moe_adapters(*moe, data)
    out["moe_tp"] = _moe_adapters_split_over_tp(*moe, data)
    out["moe_tp_refused"] = _experts_tp_refusals(*moe)
    return out


@pytest.fixture(scope="module")
def peft_models(peft_adapter, tmp_path_factory):
    base, _ = peft_adapter
    root = tmp_path_factory.mktemp("peft_models")
    lm = make_peft_adapter(base, root / "lm", rank=8, alpha=16, seed=11, targets=["q_proj", "v_proj", "down_proj"])
    rm = make_peft_adapter(base, root / "rm", rank=4, alpha=4, seed=12, task_type="SEQ_CLS")
    return lm, rm


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, top-2; layer 1 dense) over the test's 64-token vocabulary, and where its
    adapters go."""
    from hybridrl.models.tiny import create_tiny_model

    root = tmp_path_factory.mktemp("lora_moe")
    folder = create_tiny_model(root / "qwen3_moe", "qwen3_moe", vocab_size=64, hidden=64, layers=2, heads=4,
                               kv_heads=2, seed=0, experts=4, topk=2, expert_ffn_hidden=64, dense_layers=(1,))
    return str(folder), str(root / "adapters")


@pytest.fixture(scope="module")
def updates(dist_pool, peft_adapter, peft_models, moe_model):
    base, adapter_dir = peft_adapter
    return dist_pool(4).run(_suite, base, adapter_dir, _rollouts(), *peft_models, moe_model, timeout_s=400)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda kw: "tp{tp}-pp{pp}-dp{dp}".format(**kw) +
                         ("-sp" if kw.get("sequence_parallel") else ""))
def test_one_lora_update_equals_peft(updates, peft_adapter, layout):
    base, adapter_dir = peft_adapter
    reference = _peft_gradients(base, adapter_dir, _rollouts())
    got = updates[0][str(layout)]
    assert got["moved"] == []  # the base is frozen
    for rank_result in updates:
        r = rank_result[str(layout)]
        assert r["optimized"] == r["adapters"] > 0  # the optimizer holds this rank's adapters and nothing else
    checked = 0
    for module, (a0, b0) in got["before"].items():
        a1, b1 = got["after"][module]
        for factor, step in (("A", (a0 - a1) / LR), ("B", (b0 - b1) / LR)):
            grad = reference[f"base_model.model.{module}.lora_{factor}.weight"]
            assert (step - grad).abs().max() <= 1e-5 * grad.abs().max(), (module, factor)
            checked += 1
    assert checked == len(reference) == 2 * 7 * 2  # 7 projections x 2 layers, A and B
    norm = torch.sqrt(sum(g.square().sum() for g in reference.values())).item()
    assert got["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_peft_adapter_folders_stand_where_models_do(updates, peft_adapter, peft_models):
    base, _ = peft_adapter
    lm, rm = peft_models
    data = _rollouts()
    got = next(r["peft_models"] for r in updates if r["peft_models"]["log_probs"] is not None)
    expected = response_log_probs(peft_model(base, lm), data)
    assert (got["log_probs"] * data["response_mask"] - expected).abs().max() <= 1e-4
    reference = peft_model(base, rm, task_type="SEQ_CLS")
    ids = torch.cat([data["prompts"], data["responses"]], 1)
    with torch.no_grad():
        for row in range(len(data)):
            sequence = ids[row][data["attention_mask"][row].bool()].unsqueeze(0)
            assert abs(got["scores"][row].item() - reference(input_ids=sequence).logits[0, 0].item()) <= 1e-4, row


@pytest.fixture(scope="module")
def moe_reference(updates, moe_model, tmp_path_factory):
    """The experts' adapters' reference in transformers: (factors, log-probs on the checkpoint with
    W + (alpha / r) B A written into each adapted tensor, by HF name; {HF module: (dL/dA, dL/dB)} through
    W + (alpha / r) B A with A, B leaves; their norm)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    moe_dir, _ = moe_model
    factors = updates[0]["moe"]["factors"]
    weights = {}
    for f in sorted(Path(moe_dir).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    for module, (a, b) in factors.items():
        weights[f"{module}.weight"] = weights[f"{module}.weight"] + (ALPHA / RANK) * b @ a
    merged = tmp_path_factory.mktemp("lora_moe_merged")
    shutil.copy(Path(moe_dir) / "config.json", merged / "config.json")
    save_file(weights, str(merged / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((merged / "config.json").read_text())["model_type"] == "qwen3_moe"
    model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    data = _rollouts()
    expected = response_log_probs(model, data)
    base = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    assert (response_log_probs(base, data) - expected).abs().max() > 1e-3  # the adapters change the model
    reference = _merged_gradients(moe_dir, factors, data)
    norm = torch.sqrt(sum(g.square().sum() for pair in reference.values() for g in pair)).item()
    return factors, expected, reference, norm


def test_adapters_on_experts_equal_merged_weights_in_transformers(updates, moe_reference):
    """Experts' adapters at expert parallel 2: the log-probs equal transformers' on the checkpoint with
    W + (alpha / r) B A written into each adapted tensor (dense and expert projections alike, by HF name); one
    SGD update moves every EP rank's factors (its experts' and the dense ones) by LR x the gradient transformers
    computes through W + (alpha / r) B A with A, B leaves (relative 1e-4), and the grad norm is the reference's."""
    factors, expected, reference, norm = moe_reference
    experts = [m for m in factors if ".experts." in m]
    assert len(experts) == 4 * 3 and len(factors) == 2 * 4 + 3 + len(experts)  # 1 MoE layer: 4 experts x 3
    data = _rollouts()
    for rank_result in updates:  # every expert-parallel rank computed the same batch
        assert (rank_result["moe"]["log_probs"] * data["response_mask"] - expected).abs().max() <= 1e-4
    # one update: every rank's factors (dense on all, each EP rank's two experts) moved by LR x the gradient
    # transformers gives with A and B leaves inside W + (alpha / r) B A
    seen = set()
    for rank_result in updates:
        grads, ep_rank = rank_result["moe"]["grads"], rank_result["moe"]["ep_rank"]
        mine = {m for m in experts if int(m.split(".experts.")[1].split(".")[0]) // 2 == ep_rank}
        assert set(grads) == (set(factors) - set(experts)) | mine, ep_rank  # dense + this EP rank's 2 experts
        for module, pair in grads.items():
            for factor, got_grad, want in zip("AB", pair, reference[module]):
                assert want.abs().max() > 0, (module, factor)
                assert (got_grad - want).abs().max() <= 1e-4 * want.abs().max(), (module, factor)
        seen |= mine
        assert rank_result["moe"]["grad_norm"] == pytest.approx(norm, rel=1e-4)  # experts counted once, over EP
    assert seen == set(experts)


def test_adapters_on_experts_split_over_tp_equal_merged_weights_in_transformers(updates, moe_reference):
    """The same adapters with the experts' linears split over TP (TP=2 + SP, EP=2, DP=2; expert TP = TP): the
    log-probs are the same reference's, and one SGD update's factor changes, each TP rank's pieces put together
    (column-parallel fc1's gate / up B rows, row-parallel fc2's A columns, as the dense linears'), are LR x the
    same reference gradients (relative 1e-4): the replicated factors' partial gradients summed over TP once."""
    factors, expected, reference, norm = moe_reference
    experts = {m for m in factors if ".experts." in m}
    data = _rollouts()
    results = [r["moe_tp"] for r in updates]
    assert {(r["tp_rank"], r["ep_rank"], r["expert_tp"]) for r in results} == {(0, 0, 2), (1, 0, 2), (0, 1, 2),
                                                                               (1, 1, 2)}
    for r in results:
        assert (r["log_probs"] * data["response_mask"] - expected).abs().max() <= 1e-4
        assert r["grad_norm"] == pytest.approx(norm, rel=1e-4)
    seen, split_experts = set(), set()
    for ep_rank in (0, 1):  # the two TP ranks of each EP rank (here also the DP replica) put together
        pair_ranks = sorted((r for r in results if r["ep_rank"] == ep_rank), key=lambda r: r["tp_rank"])
        mine = {m for m in experts if int(m.split(".experts.")[1].split(".")[0]) // 2 == ep_rank}
        for r in pair_ranks:
            assert set(r["grads"]) == (set(factors) - experts) | mine, ep_rank
        for module in pair_ranks[0]["grads"]:
            for i, factor in enumerate("AB"):
                dim = pair_ranks[0]["split"][module][i]
                pieces = [r["grads"][module][i] for r in pair_ranks]
                if dim is None:  # replicated over TP: the same change on both ranks
                    assert torch.equal(pieces[0], pieces[1]), (module, factor)
                    got = pieces[0]
                else:
                    got = torch.cat(pieces, dim=dim)
                    split_experts |= {module} & experts
                want = reference[module][i]
                assert got.shape == want.shape, (module, factor)
                assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (module, factor)
        seen |= mine
    assert seen == experts and split_experts == experts  # every expert's linears were split over TP


def test_adapters_on_experts_split_over_a_tp_group_of_their_own_are_refused(updates):
    """Split experts' replicated factors get their partial gradients summed over the dense TP group when sequence
    parallelism is on: an expert TP other than the TP, or no sequence parallelism, is refused in one line."""
    for rank_result in updates:
        for layout, error in rank_result["moe_tp_refused"].items():
            assert error is not None and "LoRA on experts split over TP needs sequence parallelism" in error, layout
            assert "\n" not in error and "leave the experts out of lora.target_modules" in error, layout


def test_convert_merges_a_peft_adapter_into_a_hugging_face_model(peft_adapter, peft_models, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from hybridrl.cli import main

    base, _ = peft_adapter
    lm, rm = peft_models
    data = _rollouts()
    assert main(["convert", "--from", "peft", "--to", "hf", "--merge-lora", lm, str(tmp_path / "lm")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "lm"), dtype=torch.float32).eval()
    assert (response_log_probs(merged, data) - response_log_probs(peft_model(base, lm), data)).abs().max() <= 1e-5
    assert main(["convert", "--from", "peft", "--to", "hf", "--merge-lora", rm, str(tmp_path / "rm")]) == 0
    scorer = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"), dtype=torch.float32).eval()
    sequence = torch.cat([data["prompts"][0], data["responses"][0]])[None]
    with torch.no_grad():
        want = peft_model(base, rm, task_type="SEQ_CLS")(input_ids=sequence).logits
        assert (scorer(input_ids=sequence).logits - want).abs().max() <= 1e-5
    assert main(["convert", "--from", "peft", "--to", "hf", lm, str(tmp_path / "x")]) == 2  # --merge-lora missing
    assert "add --merge-lora" in capsys.readouterr().err
