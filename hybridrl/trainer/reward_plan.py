"""The run plan's reward sources and distillation teacher (trainer/plan.py calls these): which model sources and
judges exist, where they run, how a judge generates, and the teacher's checks.

- reward.sources: every source named once, a rule function or a model (reward model or judge), never both;
  without sources the reward_model section (or the rule function) is the one source, as before.
- a judge (kind=generative): its template parses, its parser is registered with valid options, its answer tokens
  are single tokens of its tokenizer, its generation engine resolved (auto: vLLM where the judge and machine
  support it and no other vLLM engine shares its processes) and its generation TP divides its TP.
- algorithm.distill: the teacher's tokenizer is the actor's; opd needs a teacher; the mode is registered.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

from hybridrl.algorithms.distill import check_distill_mode
from hybridrl.config import ConfigError, ScoreModelConfig, check_config as _check, typed
from hybridrl.data.tasks import task_reward_path
from hybridrl.data.tokenizer import tokenizer_for
from hybridrl.data.verdicts import JudgeTemplate, verdict_parser
from hybridrl.models import load_hf_config
from hybridrl.parallel.generation import GenerationLayout, check_generation_layout
from hybridrl.parallel.layout import LayoutError
from hybridrl.roles.judge import check_on_parse_error, judge_rollout_settings
from hybridrl.roles.reward import TextScoring
from hybridrl.roles.sources import SOURCE_KINDS, SourceSpec
from hybridrl.workers.rule_reward import load_reward_fn

NAME = re.compile(r"^[A-Za-z0-9_]+$")
JUDGE_LEN_ALLOWANCE = 64  # tokens a template adds around the prompt and response, by default


# ---- which model roles the sources add -------------------------------------------------------------------
def source_roles(cfg: Any) -> list[tuple[str, str, Any, str]]:
    """(role, option, section, model reference) of every model-backed reward source in reward.sources."""
    sources = cfg.reward.sources
    _check(not sources or not (cfg.reward.fn or cfg.reward_model.model),
           "reward.sources is set together with reward.fn / reward_model.model: list every source in reward.sources "
           "(a rule as {name: ..., fn: ...}, a model as {name: ..., model: {...}}) and unset the others")
    names = set()
    roles = []
    for i, source in enumerate(sources):
        where = f"reward.sources[{i}]"
        _check(bool(NAME.match(source.name or "")), f"{where}.name={source.name!r}: name each source with letters, "
                                                    f"digits and _ (it names the metric reward/<name>_mean)")
        _check(source.name not in names, f"{where}.name={source.name!r} is used twice: name each source once")
        names.add(source.name)
        _check(bool(source.fn) != bool(source.model.model),
               f"{where} ({source.name}): give exactly one of fn (a rule function) or model.model (a reward model "
               f"or judge)")
        _check(math.isfinite(source.weight), f"{where}.weight={source.weight} must be a finite number")
        if source.model.model:
            roles.append((f"reward/{source.name}", f"{where}.model", source.model, source.model.model))
    return roles


def teacher_roles(cfg: Any) -> list[tuple[str, str, Any, str]]:
    """The teacher's role when algorithm.distill.teacher is set."""
    distill = cfg.algorithm.distill
    return [("teacher", "algorithm.distill", distill, distill.teacher)] if distill.teacher else []


# ---- the sources ------------------------------------------------------------------------------------------
def plan_reward_sources(cfg: Any, plan: Any, max_len: int, resolve_engine: Callable[[str, str], str]) -> None:
    """plan.sources: the run's reward sources, judges' sections resolved (rule functions importable)."""
    _check(cfg.cost_model.kind == "scalar", f"cost_model.kind={cfg.cost_model.kind!r}: the cost model is a scalar "
                                            f"model (kind=scalar)")
    sources: list[SourceSpec] = []
    actor = plan.roles["actor"]
    # vLLM's parallel state is process-global: one vLLM engine per pool's processes
    vllm: dict[str, str] = {actor.pool: "actor"} if plan.rollout.engine == "vllm" and "rollout" not in plan.roles \
        else {}
    if cfg.reward.sources:
        for i, source in enumerate(cfg.reward.sources):
            where = f"reward.sources[{i}]"
            if source.fn:
                fn = _rule_fn(source.fn, f"{where}.fn")
                sources.append(SourceSpec(source.name, "rule", float(source.weight), fn=fn,
                                          role=f"reward/{source.name}"))
            else:
                role = f"reward/{source.name}"
                scorer = _model_section(cfg, plan, role, f"{where}.model", max_len, resolve_engine, vllm)
                sources.append(SourceSpec(source.name, scorer.kind, float(source.weight), scorer=scorer, role=role))
    elif cfg.reward_model.model:
        scorer = _model_section(cfg, plan, "reward", "reward_model", max_len, resolve_engine, vllm)
        sources.append(SourceSpec("judge" if scorer.kind == "generative" else "reward_model", scorer.kind,
                                  scorer=scorer, role="reward"))
    elif plan.reward_fn:
        sources.append(SourceSpec("rule", "rule", fn=plan.reward_fn, role="reward"))
    plan.sources = sources
    drops = [s.name for s in sources if s.scorer is not None and s.scorer.on_parse_error == "drop"]
    if drops:
        _check(not cfg.algorithm.get("max_refill_rounds"),
               f"reward source {drops[0]!r} drops unparsable verdicts (on_parse_error=drop) and algorithm."
               f"max_refill_rounds refills the batch: use one of them (on_parse_error=<a score>, or "
               f"max_refill_rounds=0)")


def _rule_fn(path: str, option: str) -> str:
    try:
        load_reward_fn(path)
    except ValueError as exc:
        raise ConfigError(str(exc).replace("reward.fn", option)) from None
    return path


def _model_section(cfg: Any, plan: Any, role: str, option: str, max_len: int,
                   resolve_engine: Callable[[str, str], str], vllm: dict[str, str]) -> ScoreModelConfig:
    """The source's section as its workers get it: the model folder resolved; a judge's checked and resolved."""
    placed = plan.roles[role]
    scorer = dataclasses.replace(typed(_section(cfg, option)), model=placed.model_path)
    kind = SOURCE_KINDS.get(scorer.kind)
    _check(kind is not None and kind.needs_model,
           f"{option}.kind={scorer.kind!r}: choose one of "
           f"{sorted(k for k, v in SOURCE_KINDS.items() if v.needs_model)}")
    judge = scorer.kind == "generative"
    # each kind reads its text from its own option: a judge's template, a scalar model's format
    _check(not (judge and scorer.format is not None), f"{option}.format is the text a scalar reward model was trained "
                                                      f"on; a judge (kind=generative) reads {option}.template: unset "
                                                      f"{option}.format")
    _check(judge or scorer.template is None, f"{option}.template is a judge's prompt, but {option}.kind="
                                             f"{scorer.kind!r}: set {option}.kind=generative, or give a scalar model's "
                                             f"text as {option}.format")
    if not judge:
        return scorer
    return _judge_section(placed, scorer, option, max_len, resolve_engine, vllm)


def _section(cfg: Any, option: str) -> Any:
    node = cfg
    for part in re.findall(r"[A-Za-z_]+|\[\d+\]", option):
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    return node


def _judge_section(placed: Any, scorer: ScoreModelConfig, option: str, max_len: int,
                   resolve_engine: Callable[[str, str], str], vllm: dict[str, str]) -> ScoreModelConfig:
    _check(scorer.template is not None, f"{option}.template is not set: a generative judge reads its prompt from "
                                        f"a template, e.g. '{{prompt}}\\n{{response}}\\nScore (0-10):'")
    try:
        JudgeTemplate(scorer.template)
        parser = verdict_parser(scorer.parser, f"{option}.parser")
        check_on_parse_error(scorer.on_parse_error, f"{option}.on_parse_error")
        text = TextScoring(scorer.model, scorer.tokenizer, scorer.chat_template)
    except ValueError as exc:
        raise ConfigError(str(exc).replace("reward_model.", f"{option}.")) from None
    for choice in (scorer.parser.choices if parser.reads == "choices" else []):
        count = len(text.tokenizer(choice, add_special_tokens=False)["input_ids"])
        _check(count == 1, f"{option}.parser.choices: {choice!r} is {count} tokens of the judge's tokenizer; choose "
                           f"answers that are one token each")
    if parser.reads != "text":
        return scorer
    gen = scorer.generation
    _check(gen.engine in ("auto", "native", "vllm"), f"{option}.generation.engine={gen.engine!r}; choose auto, "
                                                    f"native or vllm")
    tp = gen.tp or placed.layout.tp
    hf = load_hf_config(scorer.model)
    try:
        check_generation_layout(placed.layout, GenerationLayout(tp=tp), num_attention_heads=hf.num_attention_heads,
                                num_query_groups=getattr(hf, "num_key_value_heads", None))
    except LayoutError as exc:
        raise ConfigError(f"{option}.generation.tp={tp} with {option}.parallel.tp={placed.layout.tp}: "
                          f"{str(exc).replace('--gen-tp', 'generation.tp').replace('--train-tp', 'parallel.tp')}") \
            from None
    engine = _judge_engine(placed, scorer, option, resolve_engine, vllm)
    length = gen.max_model_len or min(2 * max_len + JUDGE_LEN_ALLOWANCE + gen.max_new_tokens,
                                      int(getattr(hf, "max_position_embeddings", 1 << 30)))
    _check(length > gen.max_new_tokens, f"{option}.generation.max_model_len={length} leaves no room for the judge's "
                                        f"prompt beside generation.max_new_tokens={gen.max_new_tokens}")
    resolved = dataclasses.replace(gen, engine=engine, tp=tp, max_model_len=length)
    judge_rollout_settings(dataclasses.replace(scorer, generation=resolved), placed.layout.tp)  # builds
    return dataclasses.replace(scorer, generation=resolved)


def _judge_engine(placed: Any, scorer: ScoreModelConfig, option: str, resolve_engine: Callable[[str, str], str],
                  vllm: dict[str, str]) -> str:
    """generation.engine with auto resolved; `vllm` (pool -> the role whose vLLM engine it runs) is updated."""
    requested = scorer.generation.engine
    if requested == "native":
        return "native"
    taken = vllm.get(placed.pool)
    if taken is not None:
        _check(requested != "vllm", f"{option}.generation.engine=vllm: pool {placed.pool!r} already runs a vLLM engine "
                                    f"({taken}), and vLLM holds one per process; put the judge on a pool of its own "
                                    f"({option}.pool) or set {option}.generation.engine=native")
        return "native"
    try:
        engine = resolve_engine(requested, scorer.model)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("rollout.engine", f"{option}.generation.engine")) from None
    if engine == "vllm":
        vllm[placed.pool] = placed.name
    return engine


# ---- distillation -----------------------------------------------------------------------------------------
def plan_distill(cfg: Any, plan: Any) -> None:
    """algorithm.distill and the algorithm's need for a teacher; the teacher shares the actor's tokenizer."""
    distill = cfg.algorithm.distill
    spec = plan.algorithm
    _check(not spec.needs_teacher or bool(distill.teacher),
           f"algorithm {spec.name!r} distils from a teacher: set algorithm.distill.teacher=<a model sharing the "
           f"actor's tokenizer>")
    if not distill.teacher:
        return
    _check(math.isfinite(distill.coef) and distill.coef >= 0, f"algorithm.distill.coef={distill.coef} must be >= 0")
    try:
        check_distill_mode(distill.mode)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    teacher, actor = plan.roles["teacher"].model_path, plan.roles["actor"].model_path
    mine, theirs = tokenizer_for(actor), tokenizer_for(teacher)
    same = mine.get_vocab() == theirs.get_vocab() and \
        (mine.bos_token_id, mine.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    _check(same, f"algorithm.distill.teacher={distill.teacher!r}: its tokenizer ({len(theirs.get_vocab())} tokens) is "
                 f"not the actor's ({len(mine.get_vocab())} tokens); the teacher scores the student's token ids, so "
                 f"both must share a tokenizer")
    plan.distill = typed(distill)


def default_reward_fn(cfg: Any) -> str | None:
    """The rule function when no model scores: reward.fn, or the bundled task's (none for an environment or an
    agent: their own rewards; one given is added to them)."""
    return cfg.reward.fn or (None if cfg.rollout.env or cfg.rollout.agent else task_reward_path())


def plan_rule_rewards(cfg: Any, plan: Any) -> None:
    """The reward (and cost) functions when no model scores: importable and callable by name."""
    _check(not (cfg.reward_model.model and cfg.reward.fn),
           "both reward_model.model and reward.fn are set: score with one (unset the other)")
    if not cfg.reward_model.model and not cfg.reward.sources:  # an environment's own rewards need no rule
        plan.reward_fn = default_reward_fn(cfg)
    if plan.step.cost and not cfg.cost_model.model:
        plan.cost_fn = cfg.reward.cost_fn
    for option, path in (("reward.fn", plan.reward_fn), ("reward.cost_fn", plan.cost_fn)):
        if path:
            try:
                load_reward_fn(path)
            except ValueError as exc:
                raise ConfigError(str(exc).replace("reward.fn", option)) from None
