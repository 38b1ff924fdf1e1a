"""Models made by a short run on the bundled task, named like the bundled tiny models (`tiny:<name>`):

- `tiny:charset_judge`: the bundled task's rule reward distilled into a tiny causal LM, a generative judge. It
  reads `{prompt}|{response}=` (the bundled tokenizer, no chat template) and answers one digit d, then </s>:
  d/9 is its estimate of `charset_reward(prompt, response)` (the share of response characters in the set the
  prompt names). Made here on first use (~10-30 s on 2 CPU cores, deterministic for a seed): 300 Adam steps of
  a 2-layer Llama (hidden 64, 2 heads of 64: a head size vLLM's CPU kernels take) on random (prompt, response)
  pairs whose share of allowed characters is drawn uniformly, against soft digit targets (9r split between the
  two nearest digits, so the expected digit is 9r) and </s> after the digit. Read it with
  parser {name: choice_logprob, choices: ["0", ..., "9"], score_range: [0, 9]} (the expected digit: one forward)
  or {name: regex, pattern: "([0-9])", score_range: [0, 9]} (the greedy digit, generated).
- `tiny:opd_teacher`: a policy a short GRPO run on the bundled task trained (the teacher of configs/opd_tiny.yaml);
  made by `python scripts/make_opd_teacher.py` (hybridrl/trainer/made_teacher.py).
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

from hybridrl.data.tasks import charset_reward, make_charset_rows
from hybridrl.data.tokenizer import BUNDLED_TOKENIZER_DIR, CHARACTERS, VOCAB, VOCAB_SIZE
from hybridrl.models.tiny import register_made_model, tiny_hf_config

JUDGE_TEMPLATE = "{prompt}|{response}="
JUDGE_SHAPE = {"vocab_size": VOCAB_SIZE, "hidden": 64, "layers": 2, "heads": 2, "kv_heads": 2}
JUDGE_STEPS, JUDGE_BATCH, JUDGE_LR, JUDGE_SEED = 300, 128, 3e-3, 0
MAX_RESPONSE = 16  # characters: the bundled configs' max_new_tokens


def _judge_example(rng: random.Random, rows: list[dict]) -> tuple[str, float]:
    row = rng.choice(rows)
    allowed, share = row["target_set"], rng.random()
    response = "".join(rng.choice(allowed) if rng.random() < share else rng.choice(CHARACTERS)
                       for _ in range(rng.randint(0, MAX_RESPONSE)))
    return JUDGE_TEMPLATE.format(prompt=row["prompt"], response=response), charset_reward(row["prompt"], response,
                                                                                          target_set=allowed)


def _judge_batch(rng: random.Random, rows: list[dict], ids: dict[str, int]) -> tuple[torch.Tensor, ...]:
    """Left-padded [B, W] ids of `<s> text d </s>`, their mask, and the soft digit targets [B, 10]."""
    texts, targets, digits = [], torch.zeros(JUDGE_BATCH, 10), []
    for i in range(JUDGE_BATCH):
        text, reward = _judge_example(rng, rows)
        low = min(int(math.floor(9 * reward)), 9)
        frac = 9 * reward - low
        targets[i, low] += 1 - frac
        targets[i, min(low + 1, 9)] += frac
        texts.append([ids["<s>"]] + [ids.get(c, ids["<unk>"]) for c in text])
        digits.append(ids[str(round(9 * reward))])
    width = max(len(t) for t in texts) + 2
    input_ids = torch.zeros((JUDGE_BATCH, width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (text, digit) in enumerate(zip(texts, digits)):
        row = text + [digit, ids["</s>"]]
        input_ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return input_ids, mask, targets


def build_charset_judge(out_dir: Path, steps: int = JUDGE_STEPS, seed: int = JUDGE_SEED) -> None:
    """Train the tiny judge (module docstring) and save it with the bundled tokenizer (chat template removed)."""
    from transformers import LlamaForCausalLM

    generator_state, threads = torch.random.get_rng_state(), torch.get_num_threads()
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # a model this small runs fastest on one thread (and a busy machine hurts less)
    try:
        model = LlamaForCausalLM(tiny_hf_config("llama", **JUDGE_SHAPE))
        _train_judge(model, steps, seed)
    finally:
        torch.random.set_rng_state(generator_state)
        torch.set_num_threads(threads)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for item in BUNDLED_TOKENIZER_DIR.iterdir():
        (out_dir / item.name).write_bytes(item.read_bytes())
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)  # the judge reads the template's text as it is
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _train_judge(model: torch.nn.Module, steps: int, seed: int) -> None:
    ids = {token: index for index, token in enumerate(VOCAB)}
    digit_ids = torch.tensor([ids[str(d)] for d in range(10)])
    rng, rows = random.Random(seed), make_charset_rows(400, seed=seed + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=JUDGE_LR)
    for _ in range(steps):
        input_ids, mask, targets = _judge_batch(rng, rows, ids)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits.float()
        verdict = torch.log_softmax(logits[:, -3], -1)  # after "=": the digit
        stop = torch.log_softmax(logits[:, -2], -1)[:, ids["</s>"]]  # after the digit: </s>
        loss = -(targets * verdict[:, digit_ids]).sum(-1).mean() - stop.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


register_made_model("charset_judge", build_charset_judge, "it is trained on first use (hybridrl/models/made.py)")
register_made_model("opd_teacher", None, "a short GRPO run on the bundled task trains it: python "
                                         "scripts/make_opd_teacher.py (~1 minute on 2 CPU cores), then run again")
