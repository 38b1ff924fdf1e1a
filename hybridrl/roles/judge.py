"""The generative judge role: a causal LM reads each (prompt, response) through a template and its verdict
becomes the score (workers/judge.py on every device of its pool; data/verdicts.py: templates and parsers).

    judge = hybridrl.Judge(model=JUDGE, template="{prompt}|{response}=", resource_pool=pool,
                           parser={"name": "regex", "pattern": r"(\\d)", "score_range": [0, 9]})
    scores = judge.score(rollout)                      # [B]; judge.submit(rollout).result() for the details

An unparsable verdict scores `on_parse_error` (a number), or with "drop" is marked invalid (JudgeScores.valid)
for the trainer to leave the sample out of the update; either way it is counted (JudgeScores.parse_errors).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.config import (JudgeGenerationConfig, ParallelConfig, RolloutConfig, ScoreModelConfig,
                             VerdictParserConfig, as_section)
from hybridrl.controller import ResourcePool
from hybridrl.data.verdicts import JudgeTemplate, choice_values, scaled, verdict_parser
from hybridrl.models import load_hf_config
from hybridrl.models.hub import resolve_model
from hybridrl.models.precision import model_dtype
from hybridrl.parallel.layout import ParallelLayout
from hybridrl.protocol import Batch
from hybridrl.roles.base import DEFAULT_MAX_TOKENS_PER_MICRO_BATCH, Role, layout_on, start_pool
from hybridrl.roles.reward import TextScoring, scored_texts
from hybridrl.rollout import SamplingParams, TokenIds
from hybridrl.rollout.prompts import left_pad
from hybridrl.rollout.types import decode_responses, merge_replicas
from hybridrl.workers.judge import JudgeWorker

DROP = "drop"


@dataclass
class JudgeScores:
    scores: torch.Tensor  # [B] float: the verdicts' scores, on_parse_error where unparsable (0 where dropped)
    valid: torch.Tensor  # [B] bool: False for a dropped sample (on_parse_error=drop)
    parse_errors: int  # verdicts no number could be read from (also when scored with on_parse_error)
    verdicts: list[str]  # the generated verdicts (choice_logprob: the answers' probabilities, as text)


def check_on_parse_error(value: Any, where: str = "reward_model.on_parse_error") -> float | str:
    """A finite number, or "drop"."""
    if isinstance(value, str) and value.strip() == DROP:
        return DROP
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}={value!r}: give a score (e.g. 0.0) or {DROP!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{where}={value!r}: give a finite score or {DROP!r}")
    return number


def judge_rollout_settings(scorer: ScoreModelConfig, tp: int) -> RolloutConfig:
    """The rollout settings a judge generates its verdicts with (engine resolved by the caller)."""
    gen = scorer.generation
    vllm = dataclasses.replace(gen.vllm, dtype=gen.vllm.dtype or scorer.dtype)
    return RolloutConfig(engine=gen.engine, tp=gen.tp or tp, n=1, temperature=gen.temperature,
                         max_new_tokens=gen.max_new_tokens, max_model_len=gen.max_model_len,
                         max_batch_size=gen.max_batch_size, vllm=vllm)


class Judge(Role):
    """A generative reward model. model: an HF causal-LM folder (or tiny:<name>); template: Jinja or a format
    string over prompt / response / the row's columns; parser: config.VerdictParserConfig (regex with
    score_range, choice_logprob with choices, or a registered name); generation: config.JudgeGenerationConfig
    (engine native | vllm, tp, max_new_tokens, temperature, max_model_len; the short API defaults to native);
    tokenizer / chat_template as RewardModel's (the template's text becomes the user message of the chat
    template when one is used)."""

    def __init__(self, model: str, template: str, parser: dict | VerdictParserConfig | None = None,
                 resource_pool: ResourcePool | None = None,
                 parallel: dict | ParallelConfig | ParallelLayout | None = None, *,
                 on_parse_error: float | str = 0.0, generation: dict | JudgeGenerationConfig | None = None,
                 dtype: str = "auto", micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = DEFAULT_MAX_TOKENS_PER_MICRO_BATCH, tokenizer: Any = None,
                 chat_template: bool | None = None, seed: int = 1, role: str = "judge",
                 call_timeout_s: float | None = 3600.0) -> None:
        if isinstance(generation, dict):  # the short API's engine unless named: native (the trainer resolves auto)
            generation = {"engine": "native", **generation}
        generation = as_section(JudgeGenerationConfig, generation, "Judge(generation=...)")
        if generation.engine == "auto":
            generation = dataclasses.replace(generation, engine="native")
        path = resolve_model(model, "Judge(model=...)")
        scorer = ScoreModelConfig(kind="generative", model=path, dtype=model_dtype(dtype, path),
                                  micro_batch_size=micro_batch_size,
                                  max_tokens_per_micro_batch=max_tokens_per_micro_batch, tokenizer=tokenizer,
                                  chat_template=chat_template, template=template,
                                  parser=as_section(VerdictParserConfig, parser, "Judge(parser=...)"),
                                  on_parse_error=on_parse_error, generation=generation)
        pool = start_pool(resource_pool)
        self._start(scorer, layout_on(pool, parallel, role), pool, seed, role, call_timeout_s, tokenizer)

    @classmethod
    def from_settings(cls, scorer: ScoreModelConfig, layout: ParallelLayout, pool: ResourcePool, seed: int = 1,
                      role: str = "reward", call_timeout_s: float | None = 3600.0) -> "Judge":
        """The trainer's way in: the section checked by its plan (model a local folder, generation engine, tp and
        max_model_len resolved)."""
        judge = cls.__new__(cls)
        judge._start(scorer, layout, pool, seed, role, call_timeout_s, scorer.tokenizer)
        return judge

    def _start(self, scorer: ScoreModelConfig, layout: ParallelLayout, pool: ResourcePool, seed: int, role: str,
               call_timeout_s: float | None, tokenizer: Any) -> None:
        self.settings, self.seed = scorer, seed
        self.template = JudgeTemplate(scorer.template)
        self.parser = verdict_parser(scorer.parser)
        self.on_parse_error = check_on_parse_error(scorer.on_parse_error)
        self.text = TextScoring(scorer.model, tokenizer, scorer.chat_template)  # the judge's tokenizer, template
        self.tokens = TokenIds.of(self.text.tokenizer)
        self.reads_text = self.parser.reads == "text"
        self.parse = self.parser.build(scorer.parser)
        self.choice_ids, self.values = ([], []) if self.reads_text else self._choices()
        rollout = None
        if self.reads_text:
            rollout = judge_rollout_settings(scorer, layout.tp)
            if rollout.max_model_len is None:
                rollout = dataclasses.replace(rollout, max_model_len=int(
                    getattr(load_hf_config(scorer.model), "max_position_embeddings", 512)))
        self.rollout = rollout
        super().__init__(JudgeWorker, role, pool, layout, {"scorer": scorer, "rollout": rollout, "tokens": self.tokens,
                                                           "forward": not self.reads_text, "seed": seed},
                         seed, call_timeout_s)

    def _choices(self) -> tuple[list[int], list[float]]:
        """The answers' token ids (one token each, or an error naming the answer) and their values."""
        values = choice_values(self.settings.parser)
        ids = []
        for choice in self.settings.parser.choices:
            tokens = self.text.tokenizer(choice, add_special_tokens=False)["input_ids"]
            if len(tokens) != 1:
                raise ValueError(f"reward_model.parser.choices: {choice!r} is {len(tokens)} tokens of the judge's "
                                 f"tokenizer; choose answers that are one token each")
            ids.append(int(tokens[0]))
        if len(set(ids)) != len(ids):
            raise ValueError(f"reward_model.parser.choices={list(self.settings.parser.choices)} map to the same token")
        return ids, values

    # ---- what the judge reads ----------------------------------------------------------------------------
    def judge_texts(self, prompts: list[str], responses: list[str], metadata: list[dict] | None = None) -> list[str]:
        """The template filled for each (prompt, response, row)."""
        rows = metadata or [{} for _ in responses]
        return [self.template.render(p, r, row) for p, r, row in zip(prompts, responses, rows)]

    def judge_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids the judge reads: the text as the user message of its chat template (when used), else as is."""
        tok = self.text.tokenizer
        if self.text.chat_template:
            rendered = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                tokenize=False) for t in texts]
            ids = tok(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(texts)["input_ids"]
        limit = None if self.rollout is None else self.rollout.max_model_len - self.rollout.max_new_tokens
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"judge input {i} is empty (template {self.template.text!r})")
            if limit is not None and len(row) > limit:
                raise ValueError(f"judge input {i} has {len(row)} tokens + generation.max_new_tokens="
                                 f"{self.rollout.max_new_tokens} > generation.max_model_len="
                                 f"{self.rollout.max_model_len}; raise reward_model.generation.max_model_len")
        return ids

    # ---- scoring ----------------------------------------------------------------------------------------
    def submit(self, prompts: Any, responses: Any = None, metadata: list[dict] | None = None) -> "PendingVerdicts":
        """Start judging (the Rollout, or prompts + response texts) without waiting; `.result()` -> JudgeScores."""
        if responses is None:
            prompts, responses = None, prompts
        prompt_texts, texts, metadata = scored_texts(prompts, responses, metadata)
        rows = metadata or [{} for _ in texts]
        ids = self.judge_ids(self.judge_texts(prompt_texts, texts, rows))
        input_ids, mask = left_pad(ids, self.tokens.pad)
        if self.reads_text:
            params = SamplingParams(n=1, temperature=self.rollout.temperature, greedy=self.rollout.temperature == 0,
                                    max_new_tokens=self.rollout.max_new_tokens, stop_token_ids=self.tokens.stops,
                                    seed=self.seed)
            future = self.group.generate_verdicts.remote(Batch({"input_ids": input_ids, "attention_mask": mask}),
                                                         params)
        else:
            placeholder = torch.full((len(ids), 1), self.tokens.pad, dtype=torch.long)
            ones = torch.ones_like(placeholder)
            data = Batch({"prompts": input_ids, "responses": placeholder, "response_mask": ones,
                          "attention_mask": torch.cat([mask, ones], 1)})
            future = self.group.choice_log_probs.remote(data, self.choice_ids)
        return PendingVerdicts(self, future, rows)

    def score(self, prompts: Any, responses: Any = None, metadata: list[dict] | None = None) -> torch.Tensor:
        """[B] scores, like RewardModel.score (dropped samples score 0 here: use submit() to see them)."""
        return self.submit(prompts, responses, metadata).result().scores

    def _numbers(self, raw: Any, rows: list[dict]) -> tuple[list[float | None], list[str]]:
        """Each row's verdict number before the range (None: unparsable) and the verdict as text."""
        if self.reads_text:
            texts = decode_responses(self.text.tokenizer, merge_replicas(raw, self.tokens.pad))
            return [self.parse(text, **row) for text, row in zip(texts, rows)], texts
        probs = torch.softmax(raw["choice_log_probs"].double(), dim=-1)  # renormalised over the answers
        numbers = (probs * torch.tensor(self.values, dtype=torch.float64)).sum(-1).tolist()
        return numbers, [" ".join(f"{c}:{p:.4f}" for c, p in zip(self.settings.parser.choices, row))
                         for row in probs.tolist()]

    def finish(self, raw: Any, rows: list[dict]) -> JudgeScores:
        numbers, verdicts = self._numbers(raw, rows)
        scores, valid, errors = [], [], 0
        for number in numbers:
            value = scaled(number, self.settings.parser.score_range) if number is not None and \
                math.isfinite(float(number)) else None
            if value is None:
                errors += 1
            fallback = 0.0 if self.on_parse_error == DROP else self.on_parse_error
            scores.append(float(value) if value is not None else fallback)
            valid.append(value is not None or self.on_parse_error != DROP)
        return JudgeScores(torch.tensor(scores, dtype=torch.float32), torch.tensor(valid, dtype=torch.bool), errors,
                           verdicts)


class PendingVerdicts:
    """A judge call in flight; `result()` parses the verdicts into JudgeScores."""

    def __init__(self, judge: Judge, future: Any, rows: list[dict]) -> None:
        self.judge, self.future, self.rows = judge, future, rows

    def result(self) -> JudgeScores:
        return self.judge.finish(self.future.result(), self.rows)
