"""What a generative judge reads and how its verdict becomes a number: the prompt template and the verdict parsers.

A template is Jinja when it holds `{{` or `{%` (`{{ prompt }}`, `{{ response }}`, `{{ row.answer }}` or the row's
columns by name), else a Python format string (`{prompt}`, `{response}`, `{answer}`); a field the row lacks is an
error naming it and the fields there are.

A parser is registered by name. Parsers that read text get the judge's generated verdict and the row's columns
and return a number, or None when the verdict says nothing they can read (a parse error, counted and scored as
`on_parse_error`); `choice_logprob` reads no text: one forward gives the judge's next-token probabilities of the
listed answers, renormalised over them, and the score is their expected value. Every parser's number is then
mapped from `score_range` [low, high] onto [0, 1] when a range is given (outside it: a parse error).

    from hybridrl.data.verdicts import register_verdict_parser

    @register_verdict_parser("pass_fail")             # reward_model.parser.name=pass_fail
    def pass_fail(verdict: str, **row) -> float | None:
        return 1.0 if "PASS" in verdict else 0.0 if "FAIL" in verdict else None
"""
from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any, Callable

from hybridrl.config import VerdictParserConfig
from hybridrl.registry import Registry, import_user_module

TextParser = Callable[..., "float | None"]  # (verdict text, **row columns) -> number or None


@dataclass(frozen=True)
class VerdictParser:
    name: str
    reads: str  # "text": the judge generates a verdict | "choices": one forward, the answers' probabilities
    build: Callable[[VerdictParserConfig], TextParser | None]  # the configured parser (None for choices)


VERDICT_PARSERS = Registry("verdict parser", "@register_verdict_parser in a module named by reward_model.parser.module")


def register_verdict_parser(name: str) -> Callable[[TextParser], TextParser]:
    """Decorator: `fn(verdict: str, **row) -> float | None` parses a judge's generated verdict (None: unparsable)."""
    def decorate(fn: TextParser) -> TextParser:
        VERDICT_PARSERS.add(name, VerdictParser(name, "text", lambda _cfg: fn), fn)
        return fn
    return decorate


def _regex(cfg: VerdictParserConfig) -> TextParser:
    pattern = re.compile(cfg.pattern)

    def parse(verdict: str, **_: Any) -> float | None:
        match = pattern.search(verdict)
        if match is None:
            return None
        try:
            return float(match.group(1) if pattern.groups else match.group(0))
        except (TypeError, ValueError):
            return None
    return parse


def _choices(cfg: VerdictParserConfig) -> None:
    """choice_logprob reads no text: the judge worker's one forward gives the answers' probabilities."""
    return None


VERDICT_PARSERS.add("regex", VerdictParser("regex", "text", _regex), _regex)
VERDICT_PARSERS.add("choice_logprob", VerdictParser("choice_logprob", "choices", _choices), _choices)


def verdict_parser(cfg: VerdictParserConfig, where: str = "reward_model.parser") -> VerdictParser:
    """The registered parser `cfg.name` (its module imported first), its options checked: ValueError naming them."""
    if cfg.module:
        import_user_module(cfg.module, f"{where}.module")
    parser = VERDICT_PARSERS.lookup(cfg.name, subject=f"{where}.name={cfg.name!r}")
    if cfg.score_range is not None and not (len(cfg.score_range) == 2 and cfg.score_range[0] < cfg.score_range[1]):
        raise ValueError(f"{where}.score_range={list(cfg.score_range)} must be [low, high] with low < high")
    if parser.name == "regex":
        try:
            re.compile(cfg.pattern)
        except re.error as exc:
            raise ValueError(f"{where}.pattern={cfg.pattern!r} is not a regular expression ({exc})") from None
    if parser.reads == "choices":
        choice_values(cfg, where)
    return parser


def choice_values(cfg: VerdictParserConfig, where: str = "reward_model.parser") -> list[float]:
    """Each answer's value: choice_values, or the answers read as numbers."""
    choices = list(cfg.choices)
    if len(choices) < 2:
        raise ValueError(f"{where}.choices={choices}: choice_logprob needs at least two answers (e.g. ['yes', 'no'] "
                         f"with choice_values [1, 0])")
    if cfg.choice_values is not None:
        if len(cfg.choice_values) != len(choices):
            raise ValueError(f"{where}.choice_values has {len(cfg.choice_values)} values for {len(choices)} choices")
        return [float(v) for v in cfg.choice_values]
    try:
        return [float(c) for c in choices]
    except ValueError:
        raise ValueError(f"{where}.choices={choices} are not numbers: give {where}.choice_values (one per "
                         f"answer)") from None


def scaled(value: float | None, score_range: list[float] | None) -> float | None:
    """value mapped from [low, high] onto [0, 1] (None outside it, or for None); unchanged without a range."""
    if value is None or score_range is None:
        return value
    low, high = float(score_range[0]), float(score_range[1])
    if not low <= value <= high:
        return None
    return (value - low) / (high - low)


class JudgeTemplate:
    """The judge's prompt: Jinja when the text holds {{ or {%, else a format string."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("reward_model.template is empty: write the judge's prompt, e.g. "
                             "'{prompt}\\n{response}\\nScore (0-10):'")
        self.text = text
        self.jinja = "{{" in text or "{%" in text
        if self.jinja:
            import jinja2  # comes with transformers (chat templates); only judges with a Jinja template need it

            try:
                self._template = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True
                                                    ).from_string(text)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"reward_model.template is not valid Jinja ({exc})") from None
            self._undefined = jinja2.UndefinedError
        else:
            try:
                self.fields = [name for _, name, _, _ in string.Formatter().parse(text) if name]
            except ValueError as exc:
                raise ValueError(f"reward_model.template is not a format string ({exc}); write literal braces "
                                 f"as {{{{ }}}} or use Jinja") from None
            bad = [name for name in self.fields if not name.isidentifier()]
            if bad:
                raise ValueError(f"reward_model.template fields {bad}: name them ({{prompt}}, {{response}}, a column)")

    def render(self, prompt: str, response: str, row: dict | None = None) -> str:
        values = {**(row or {}), "prompt": prompt, "response": response}
        if self.jinja:
            try:
                return self._template.render(row=dict(row or {}), **values)
            except self._undefined as exc:
                raise ValueError(f"reward_model.template: {exc.message}; the row has {sorted(values)}") from None
        missing = [name for name in self.fields if name not in values]
        if missing:
            raise ValueError(f"reward_model.template names {missing}, which the row lacks; it has {sorted(values)}")
        return self.text.format(**values)
