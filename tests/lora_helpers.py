"""Helpers of the LoRA tests: peft adapter folders and transformers + peft reference outputs."""
from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(base: str, folder: Path, *, rank: int = 4, alpha: float = 8.0, seed: int = 3,
                      targets="all-linear", task_type: str | None = None, b_std: float = 0.05) -> str:
    """A peft LoRA adapter over `base` saved to `folder`, its B factors random (peft starts them at zero) so the
    adapter changes the model and both factors get gradients; a SEQ_CLS adapter also trains the score head."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if task_type == "SEQ_CLS" else AutoModelForCausalLM
    kwargs = {"num_labels": 1} if task_type == "SEQ_CLS" else {}
    model = get_peft_model(cls.from_pretrained(base, dtype=torch.float32, **kwargs),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, task_type=task_type))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
    model.save_pretrained(str(folder))
    return str(folder)


def peft_model(base: str, adapter: str, task_type: str | None = None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if task_type == "SEQ_CLS" else AutoModelForCausalLM
    kwargs = {"num_labels": 1} if task_type == "SEQ_CLS" else {}
    return PeftModel.from_pretrained(cls.from_pretrained(base, dtype=torch.float32, **kwargs), adapter).eval()


def response_log_probs(model, sequences) -> torch.Tensor:
    """[B, R] log-probs of the responses under a transformers (or peft) causal LM, 0 on padding."""
    prompts, responses = sequences["prompts"], sequences["responses"]
    ids, mask = torch.cat([prompts, responses], 1), sequences["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    picked = torch.log_softmax(logits[:, prompts.shape[1] - 1:-1], -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return picked * sequences["response_mask"]
