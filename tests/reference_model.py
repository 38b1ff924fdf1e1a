"""Hugging Face transformers reference outputs, computed in a clean subprocess (for the tests; not shipped).

Why a subprocess: the reference must not share anything with the code under test. Processes that
run Megatron on CPU have the shims applied (megatron_patches.apply() wraps torch factories), and a wrapped
factory once broke the meta-device redirect, so transformers 5.x loaded models with an uninitialised
rotary `inv_freq`; a clean spawned process keeps the reference independent of any such process-global patch.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class HFReference:
    logits: torch.Tensor                                         # [b, s, vocab] or [b, num_labels] (seq cls)
    loss: float | None = None                                    # mean next-token CE over `labels`
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # HF name -> d loss / d param
    token_scores: torch.Tensor | None = None                     # seq cls: score head on every token [b, s, 1]


def _compute(model_dir: str, input_ids: torch.Tensor, labels: torch.Tensor | None, head: str) -> HFReference:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model_cls = AutoModelForSequenceClassification if head == "seq_cls" else AutoModelForCausalLM
    model = model_cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    if head == "seq_cls":
        with torch.no_grad():
            out = model(input_ids, output_hidden_states=True)
            token_scores = model.score(out.hidden_states[-1])
        return HFReference(logits=out.logits, token_scores=token_scores)
    logits = model(input_ids).logits
    ref = HFReference(logits=logits.detach())
    if labels is not None:
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        ref.loss = loss.item()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        ref.grads = _checkpoint_names(model, grads)
    return ref


def _checkpoint_names(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors named as in the model's checkpoint files: transformers 5 fuses MoE experts in memory
    (experts.gate_up_proj [E, 2I, H]) and splits them one by one on save; the same reversal here."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, tensors))


def _child(conn, *args) -> None:
    # plain pickle: Connection.send would share tensors through fds that die with this process
    try:
        conn.send_bytes(pickle.dumps(("ok", _compute(*args))))
    except BaseException as exc:  # noqa: BLE001 - hand the error to the parent
        conn.send_bytes(pickle.dumps(("error", repr(exc))))


def hf_reference(model_dir: str | Path, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 head: str = "lm", timeout_s: float = 300.0) -> HFReference:
    """transformers' outputs (and loss/grads when labels are given) for a saved HF model."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the child
    proc = ctx.Process(target=_child, args=(child, str(model_dir), input_ids, labels, head), daemon=True)
    proc.start()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"HF reference for {model_dir} took more than {timeout_s:.0f}s")
        status, value = pickle.loads(parent.recv_bytes())
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise RuntimeError(f"HF reference for {model_dir} failed: {value}")
    return value
