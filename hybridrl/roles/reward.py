"""The reward role: sequence scores from a reward model (a scalar-head Megatron model on a pool,
workers/value.py RewardModelWorker) or a rule function (workers/rule_reward.py), and how a reward model
reads (prompt, response) text: its own tokenizer, in the format it was trained on (a format string or its chat
template)."""
from __future__ import annotations

import string
from pathlib import Path
from typing import Any, Callable

import torch

from hybridrl.config import ParallelConfig, ScoreModelConfig
from hybridrl.controller import ResourcePool
from hybridrl.data.tokenizer import tokenizer_for
from hybridrl.models.hub import resolve_model, resolve_reference
from hybridrl.models.peft import tokenizer_folder
from hybridrl.models.precision import model_dtype
from hybridrl.parallel.layout import ParallelLayout
from hybridrl.protocol import Batch
from hybridrl.roles.base import DEFAULT_MAX_TOKENS_PER_MICRO_BATCH, Role, parallel_argument
from hybridrl.rollout.prompts import check_prompt_texts, prompt_texts_of, repeat_per_response
from hybridrl.rollout.types import SEQUENCE_KEYS, Rollout
from hybridrl.workers.rule_reward import RuleReward
from hybridrl.workers.value import RewardModelWorker


class RewardModel:
    """Sequence scores from a reward model (a HF *ForSequenceClassification folder, on a pool) or a
    function `fn(prompt: str, response: str, **row_metadata) -> float` (a callable or a dotted path).

    A reward model reads text with its OWN tokenizer (`tokenizer=`, else the model folder's), in the format it
    was trained on: `format=` a format string over {prompt}, {response} and the row's metadata fields (e.g.
    "\n\nHuman: {prompt}\n\nAssistant: {response}" for an HH-RLHF model), tokenised with the tokenizer's
    special tokens; else its chat template (user: prompt, assistant: response) when `chat_template=True`, or by
    default when its folder declares one; else prompt + response as one string with the special tokens. Given
    the actor's Rollout, it reuses the token ids when they mean the same to it (no tokenizer of its own, or the
    actor's vocabulary, no format and no chat template) and re-tokenises the texts otherwise.
    """

    def __init__(self, model: str | None = None, fn: Callable | str | None = None,
                 resource_pool: ResourcePool | None = None,
                 parallel: dict | ParallelConfig | ParallelLayout | None = None, micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
                 dtype: str = "auto", tokenizer: Any = None, chat_template: bool | None = None, seed: int = 1,
                 role: str = "reward", num_workers: int = 0, call_timeout_s: float | None = 3600.0,
                 format: str | None = None,  # noqa: A002 - the option's name (reward_model.format)
                 parallel_config: dict | ParallelConfig | ParallelLayout | None = None) -> None:
        if (model is None) == (fn is None):
            raise ValueError("RewardModel: give exactly one of model= (a reward-model folder or hub id) or fn= "
                             "(a function)")
        if fn is not None and (tokenizer is not None or chat_template is not None or format is not None):
            raise ValueError("RewardModel(fn=...): tokenizer=, chat_template= and format= belong to a reward model "
                             "(model=)")
        parallel = parallel_argument(parallel, parallel_config, "RewardModel")
        self.rule = RuleReward(fn, num_workers=num_workers) if fn is not None else None
        self.role = None
        if model is not None:
            path = resolve_model(model, "RewardModel(model=...)")  # a hub id is fetched before any worker starts
            self.text = TextScoring(path, tokenizer, chat_template, format)  # checked before any worker starts
            scorer = ScoreModelConfig(model=path, dtype=model_dtype(dtype, path), micro_batch_size=micro_batch_size,
                                      max_tokens_per_micro_batch=max_tokens_per_micro_batch, format=format)
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
            data = self.text.encode(prompt_texts, texts, metadata)
        return self.role.group.score(data)["scores"]

    def _score_ids(self, prompts: Any, batch: Batch) -> torch.Tensor:
        if self.rule is not None:
            raise TypeError("a reward function scores texts: pass the Rollout or its .texts, not a Batch")
        if prompts is not None:
            raise TypeError("score(prompts, batch): a Batch holds token ids only, so its prompts cannot be checked; "
                            "pass the Rollout or its texts, or score(batch) alone")
        if self.text.own or self.text.format is not None:
            raise TypeError("this reward model has its own tokenizer or format: pass the Rollout or (prompts, texts), "
                            "not a Batch of the actor's token ids")
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
    """How a reward model reads (prompt, response) text: its tokenizer, and its format string or chat template."""

    def __init__(self, model_path: str, tokenizer: Any = None, chat_template: bool | None = None,
                 format: str | None = None) -> None:  # noqa: A002 - the option's name
        model_path = resolve_model(model_path, "RewardModel(model=...)")
        folder = Path(tokenizer_folder(model_path))  # a PEFT adapter without tokenizer files: its base's
        if isinstance(tokenizer, (str, Path)):
            tokenizer = resolve_reference(tokenizer, "RewardModel(tokenizer=...)")
        # own: the tokenizer was chosen for this model (given, or in its folder); else the bundled one, and
        # the model is taken to read the actor's token ids (the tiny test models have no tokenizer files)
        self.own = tokenizer is not None or (folder / "tokenizer_config.json").is_file() \
            or (folder / "tokenizer.json").is_file()
        self.tokenizer = tokenizer_for(folder, tokenizer)
        self.format, self.format_fields = format, check_score_format(format, "RewardModel(format=...)")
        if format is not None and chat_template:
            raise ValueError("RewardModel: give format= (a format string) or chat_template=True, not both")
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        if chat_template and not has_template:
            raise ValueError(f"RewardModel(chat_template=True): the tokenizer of {model_path} has no chat template")
        default_template = self.own and has_template and format is None
        self.chat_template = default_template if chat_template is None else bool(chat_template)
        self._same: dict[int, bool] = {}

    def reads_ids_of(self, tokenizer: Any) -> bool:
        """True when the rollout's token ids can be scored as they are (no re-tokenisation)."""
        if self.format is not None:
            return False
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

    def render(self, prompts: list[str], responses: list[str], metadata: list[dict] | None = None) -> list[str]:
        """The texts as the reward model reads them: through the format string, else the chat template, else
        prompt + response (those are tokenised with the tokenizer's special tokens; a template writes its own)."""
        if self.format is not None:
            return [self._formatted(i, p, r, metadata[i] if metadata else None)
                    for i, (p, r) in enumerate(zip(prompts, responses))]
        if self.chat_template:
            return [self.tokenizer.apply_chat_template([{"role": "user", "content": p},
                                                        {"role": "assistant", "content": r}], tokenize=False)
                    for p, r in zip(prompts, responses)]
        return [p + r for p, r in zip(prompts, responses)]

    def _formatted(self, row: int, prompt: str, response: str, fields: dict | None) -> str:
        values = {**(fields or {}), "prompt": prompt, "response": response}
        missing = [name for name in self.format_fields if name not in values]
        if missing:
            raise ValueError(f"reward model format {self.format!r} names {missing}, which row {row} does not have "
                             f"(its fields: {sorted(values)})")
        return self.format.format(**values)

    def texts_to_ids(self, prompts: list[str], responses: list[str],
                     metadata: list[dict] | None = None) -> list[list[int]]:
        rendered = self.render(prompts, responses, metadata)
        # a chat template wrote the special tokens itself; a format string or plain text gets the tokenizer's
        ids = self.tokenizer(rendered, add_special_tokens=not self.chat_template)["input_ids"]
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"reward model input {i} is empty (prompt {prompts[i]!r}, response {responses[i]!r})")
        return ids

    def encode(self, prompts: list[str], responses: list[str], metadata: list[dict] | None = None) -> Batch:
        """The rollout-shaped Batch the reward-model worker scores. Only the last token's scalar is read, so
        where a row is split between "prompts" and "responses" does not matter: the last token is the
        one-token response."""
        ids = self.texts_to_ids(prompts, responses, metadata)
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


def check_score_format(fmt: str | None, where: str) -> tuple[str, ...]:
    """The fields a reward model's format string names (prompt, response, row fields); ValueError when it cannot
    render a (prompt, response) pair. The short API and the trainer's config checks both call it."""
    if fmt is None:
        return ()
    if not isinstance(fmt, str):
        raise ValueError(f"{where}: give a format string such as '{{prompt}}{{response}}', got {type(fmt).__name__}")
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(fmt) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{where}={fmt!r}: not a format string ({exc}); name fields as {{prompt}} and {{response}}, "
                         f"write a literal brace as {{{{ or }}}}") from None
    bad = [name for name in fields if not name.isidentifier()]
    if bad:
        raise ValueError(f"{where}={fmt!r}: fields must be plain names such as {{prompt}}, {{response}} or a row "
                         f"field, got {bad}")
    if "response" not in fields:
        raise ValueError(f"{where}={fmt!r}: has no {{response}} field, so every response would score the same; "
                         f"e.g. '\\n\\nHuman: {{prompt}}\\n\\nAssistant: {{response}}'")
    return tuple(dict.fromkeys(fields))
