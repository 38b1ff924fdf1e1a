"""The reward role: sequence scores from a reward model (a scalar-head Megatron model on a pool,
workers/value.py RewardModelWorker) or a rule function (workers/rule_reward.py), and how a reward model
reads (prompt, response) text: its own tokenizer and chat template."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from hybridrl.config import ParallelConfig, ScoreModelConfig
from hybridrl.controller import ResourcePool
from hybridrl.data.tokenizer import tokenizer_for
from hybridrl.parallel.layout import ParallelLayout
from hybridrl.protocol import Batch
from hybridrl.roles.base import DEFAULT_MAX_TOKENS_PER_MICRO_BATCH, Role
from hybridrl.rollout.prompts import check_prompt_texts, prompt_texts_of, repeat_per_response
from hybridrl.rollout.types import SEQUENCE_KEYS, Rollout
from hybridrl.workers.rule_reward import RuleReward
from hybridrl.workers.value import RewardModelWorker


class RewardModel:
    """Sequence scores from a reward model (a HF *ForSequenceClassification folder, on a pool) or a
    function `fn(prompt: str, response: str, **row_metadata) -> float` (a callable or a dotted path).

    A reward model reads text with its OWN tokenizer (`tokenizer=`, else the model folder's), through its
    chat template (user: prompt, assistant: response) when `chat_template=True`, or by default when its
    folder declares one; without one, prompt + response is tokenised as one string with the tokenizer's
    special tokens. Given the actor's Rollout, it reuses the token ids when they mean the same to it (no
    tokenizer of its own, or the actor's vocabulary and no chat template) and re-tokenises the texts otherwise.
    """

    def __init__(self, model: str | None = None, fn: Callable | str | None = None,
                 resource_pool: ResourcePool | None = None,
                 parallel: dict | ParallelConfig | ParallelLayout | None = None, micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
                 dtype: str = "float32", tokenizer: Any = None, chat_template: bool | None = None, seed: int = 1,
                 role: str = "reward", num_workers: int = 0, call_timeout_s: float | None = 3600.0) -> None:
        if (model is None) == (fn is None):
            raise ValueError("RewardModel: give exactly one of model= (a reward-model folder) or fn= (a function)")
        if fn is not None and (tokenizer is not None or chat_template is not None):
            raise ValueError("RewardModel(fn=...): tokenizer= and chat_template= belong to a reward model (model=)")
        self.rule = RuleReward(fn, num_workers=num_workers) if fn is not None else None
        self.role = None
        if model is not None:
            self.text = TextScoring(str(model), tokenizer, chat_template)  # checked before any worker starts
            scorer = ScoreModelConfig(model=str(model), dtype=dtype, micro_batch_size=micro_batch_size,
                                      max_tokens_per_micro_batch=max_tokens_per_micro_batch)
            self.role = Role(RewardModelWorker, role, resource_pool, parallel, {"scorer": scorer, "seed": seed}, seed,
                             call_timeout_s)

    def score(self, prompts: Any, responses: Any = None, metadata: list[dict] | None = None) -> torch.Tensor:
        """[B] scores of `responses`: texts, or the Rollout. `prompts`: strings (or a PromptBatch), one per
        response or one per n responses (repeated); with a Rollout they must be its prompts (checked).
        score(rollout) scores a rollout with its own prompts; score(batch) a Batch of token ids as they are
        (a reward model without a tokenizer of its own only: a Batch has no texts to re-tokenise)."""
        if responses is None:
            prompts, responses = None, prompts
        if isinstance(responses, Batch):
            return self._score_ids(prompts, responses)
        prompt_texts, texts, metadata = scored_texts(prompts, responses, metadata)
        if self.rule is not None:
            return self.rule.score(prompt_texts, texts, metadata)
        if isinstance(responses, Rollout) and self.text.reads_ids_of(responses.tokenizer):
            data = responses.sequences.select(*SEQUENCE_KEYS)  # same tokens: no re-tokenisation
        else:
            data = self.text.encode(prompt_texts, texts)
        return self.role.group.score(data)["scores"]

    def _score_ids(self, prompts: Any, batch: Batch) -> torch.Tensor:
        if self.rule is not None:
            raise TypeError("a reward function scores texts: pass the Rollout or its .texts, not a Batch")
        if prompts is not None:
            raise TypeError("score(prompts, batch): a Batch holds token ids only, so its prompts cannot be checked; "
                            "pass the Rollout or its texts, or score(batch) alone")
        if self.text.own:
            raise TypeError("this reward model has its own tokenizer: pass the Rollout or (prompts, texts), not a "
                            "Batch of the actor's token ids")
        return self.role.group.score(batch.select(*SEQUENCE_KEYS))["scores"]

    def close(self) -> None:
        if self.role is not None:
            self.role.close()
        if self.rule is not None:
            self.rule.close()


def scored_texts(prompts: Any, responses: Any, metadata: list[dict] | None = None
                 ) -> tuple[list[str], list[str], list[dict] | None]:
    """(prompt per response, response texts, row metadata per response) of what a scorer is given: the Rollout
    (its own prompts; `prompts`, when given, must be them) or response texts with their prompts (one per response
    or per n responses)."""
    if isinstance(responses, Rollout):
        if prompts is not None:
            check_prompt_texts(prompt_texts_of(prompts), responses.prompt_texts)
        return responses.prompt_texts, responses.texts, metadata or responses.metadata
    if prompts is None:
        raise ValueError("reward_model.score(prompts, texts): texts need their prompts")
    texts = list(responses)
    given = prompt_texts_of(prompts)
    prompt_texts = repeat_per_response(given, len(texts))
    n = len(texts) // len(given)
    metadata = metadata if metadata is not None else getattr(prompts, "metadata", None)
    if metadata is not None and n > 1 and len(metadata) * n == len(texts):
        metadata = [m for m in metadata for _ in range(n)]
    return prompt_texts, texts, metadata


class TextScoring:
    """How a reward model reads (prompt, response) text: its tokenizer and chat template."""

    def __init__(self, model_path: str, tokenizer: Any = None, chat_template: bool | None = None) -> None:
        folder = Path(model_path)
        if not (folder / "config.json").is_file():
            raise ValueError(f"RewardModel(model={model_path!r}): no Hugging Face model folder there "
                             f"(expected config.json)")
        # own: the tokenizer was chosen for this model (given, or in its folder); else the bundled one, and
        # the model is taken to read the actor's token ids (the tiny test models have no tokenizer files)
        self.own = tokenizer is not None or (folder / "tokenizer_config.json").is_file() \
            or (folder / "tokenizer.json").is_file()
        self.tokenizer = tokenizer_for(model_path, tokenizer)
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        if chat_template and not has_template:
            raise ValueError(f"RewardModel(chat_template=True): the tokenizer of {model_path} has no chat template")
        self.chat_template = (self.own and has_template) if chat_template is None else bool(chat_template)
        self._same: dict[int, bool] = {}

    def reads_ids_of(self, tokenizer: Any) -> bool:
        """True when the rollout's token ids can be scored as they are (no re-tokenisation)."""
        if not self.own:
            return True
        if self.chat_template or tokenizer is None:
            return False
        key = id(tokenizer)
        if key not in self._same:  # compare once per actor tokenizer (large vocabularies)
            mine = self.tokenizer
            self._same[key] = tokenizer is mine or (
                tokenizer.get_vocab() == mine.get_vocab()
                and (tokenizer.bos_token_id, tokenizer.eos_token_id) == (mine.bos_token_id, mine.eos_token_id))
        return self._same[key]

    def texts_to_ids(self, prompts: list[str], responses: list[str]) -> list[list[int]]:
        tok = self.tokenizer
        if self.chat_template:
            rendered = [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                                                tokenize=False) for p, r in zip(prompts, responses)]
            ids = tok(rendered, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens
        else:
            ids = tok([p + r for p, r in zip(prompts, responses)])["input_ids"]
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"reward model input {i} is empty (prompt {prompts[i]!r}, response {responses[i]!r})")
        return ids

    def encode(self, prompts: list[str], responses: list[str]) -> Batch:
        """The rollout-shaped Batch the reward-model worker scores. Only the last token's scalar is read, so
        where a row is split between "prompts" and "responses" does not matter: the last token is the
        one-token response."""
        ids = self.texts_to_ids(prompts, responses)
        pad = self.tokenizer.pad_token_id or 0
        width = max(len(row) for row in ids) - 1
        prompt_ids = torch.full((len(ids), max(width, 1)), pad, dtype=torch.long)
        prompt_mask = torch.zeros_like(prompt_ids)
        for i, row in enumerate(ids):
            if len(row) > 1:
                prompt_ids[i, prompt_ids.shape[1] - len(row) + 1:] = torch.tensor(row[:-1])
                prompt_mask[i, prompt_ids.shape[1] - len(row) + 1:] = 1
        last = torch.tensor([[row[-1]] for row in ids], dtype=torch.long)
        ones = torch.ones_like(last)
        return Batch({"prompts": prompt_ids, "responses": last, "attention_mask": torch.cat([prompt_mask, ones], 1),
                      "response_mask": ones})
