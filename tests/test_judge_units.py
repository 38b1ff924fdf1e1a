"""Judges, reward sources and on-policy distillation without Ray: verdict templates and parsers, how sources
combine, the dropped samples' scores, the distillation term against hand-computed values, and the run plan's
refusals (one line each, before anything starts)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hybridrl.algorithms.compute import compute_advantages
from hybridrl.algorithms.distill import distill_advantages
from hybridrl.algorithms.registry import get_algorithm
from hybridrl.algorithms.shaping import fill_dropped
from hybridrl.algorithms.step import step_needs
from hybridrl.config import AlgorithmConfig, ConfigError, DistillConfig, VerdictParserConfig, load_config, typed
from hybridrl.data.verdicts import VERDICT_PARSERS, JudgeTemplate, register_verdict_parser, scaled, verdict_parser
from hybridrl.roles.sources import PendingRewards, SourceScores, SourceSpec
from hybridrl.trainer.plan import plan_run

JUDGE = ["reward_model.kind=generative", "reward_model.model=tiny:charset_judge",
         'reward_model.template="{prompt}|{response}="']


# ---- templates and parsers ---------------------------------------------------------------------------------
def test_template_format_string_and_jinja_over_prompt_response_and_row():
    assert JudgeTemplate("{prompt}|{response}={target_set}").render("vowels: qz", "ae", {"target_set": "aeiou"}) \
        == "vowels: qz|ae=aeiou"
    jinja = JudgeTemplate("Q: {{ prompt }}\nA: {{ response }}\nset {{ row.target_set }} ({{ target_set }})")
    assert jinja.render("p", "r", {"target_set": "xy"}) == "Q: p\nA: r\nset xy (xy)"
    with pytest.raises(ValueError, match=r"names \['answer'\], which the row lacks; it has \['prompt', 'response'\]"):
        JudgeTemplate("{prompt} {answer}").render("p", "r", {})
    with pytest.raises(ValueError, match="'answer' is undefined"):
        JudgeTemplate("{{ answer }}").render("p", "r", {})
    with pytest.raises(ValueError, match="empty"):
        JudgeTemplate("  ")


def test_regex_parser_reads_the_number_and_maps_the_range():
    cfg = VerdictParserConfig(pattern=r"Score: (\d+)", score_range=[0, 10])
    parse = verdict_parser(cfg).build(cfg)
    assert parse("I think... Score: 7/10") == 7.0 and scaled(7.0, cfg.score_range) == 0.7
    assert parse("no score here") is None
    assert scaled(11.0, cfg.score_range) is None  # outside the range: unparsable too
    assert scaled(3.5, None) == 3.5
    whole = VerdictParserConfig(pattern=r"\d")
    assert verdict_parser(whole).build(whole)("x9y") == 9.0  # no group: the whole match
    with pytest.raises(ValueError, match="score_range"):
        verdict_parser(VerdictParserConfig(score_range=[5, 1]))
    with pytest.raises(ValueError, match="not a regular expression"):
        verdict_parser(VerdictParserConfig(pattern="(unclosed"))


def test_choice_values_default_to_the_answers_as_numbers():
    from hybridrl.data.verdicts import choice_values

    assert choice_values(VerdictParserConfig(name="choice_logprob", choices=["0", "5"])) == [0.0, 5.0]
    assert choice_values(VerdictParserConfig(name="choice_logprob", choices=["yes", "no"], choice_values=[1, 0])) \
        == [1.0, 0.0]
    with pytest.raises(ValueError, match="not numbers: give reward_model.parser.choice_values"):
        verdict_parser(VerdictParserConfig(name="choice_logprob", choices=["yes", "no"]))


def test_a_user_parser_is_registered_by_name():
    @register_verdict_parser("test_pass_fail")
    def pass_fail(verdict: str, **row) -> float | None:
        return 1.0 if "PASS" in verdict else 0.0 if "FAIL" in verdict else None

    try:
        cfg = VerdictParserConfig(name="test_pass_fail")
        parser = verdict_parser(cfg)
        assert parser.reads == "text" and parser.build(cfg)("...PASS") == 1.0 and parser.build(cfg)("?") is None
        with pytest.raises(ValueError, match="parser.name='nope' is unknown; registered: .*test_pass_fail"):
            verdict_parser(VerdictParserConfig(name="nope"))
    finally:
        VERDICT_PARSERS.pop("test_pass_fail")


# ---- sources combined --------------------------------------------------------------------------------------
class _Ready:
    def __init__(self, scores, valid, errors=None):
        self.value = SourceScores(torch.tensor(scores), torch.tensor(valid), errors)

    def result(self):
        return self.value


def test_sources_combine_with_weights_and_log_each_mean():
    rewards = PendingRewards([
        (SourceSpec("judge", "generative", 0.5), _Ready([1.0, 0.0, 0.5, 1.0], [True, False, True, True], 1)),
        (SourceSpec("task", "rule", 2.0), _Ready([0.25, 0.5, 0.75, 1.0], [True] * 4)),
        (SourceSpec("rm", "scalar", -1.0), _Ready([1.0, 1.0, 2.0, 0.0], [True] * 4)),
    ]).result()
    assert rewards.total.tolist() == [0.5 * 1.0 + 2 * 0.25 - 1.0, 0.0 + 1.0 - 1.0, 0.25 + 1.5 - 2.0, 0.5 + 2.0]
    assert rewards.keep.tolist() == [True, False, True, True]
    assert rewards.metrics == {"reward/judge_mean": pytest.approx(2.5 / 3), "reward/task_mean": 0.625,
                               "reward/rm_mean": 1.0, "reward/judge_parse_errors": 1.0, "reward/judge_dropped": 1.0}


def test_dropped_samples_take_their_groups_kept_mean():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.4, 0.9])
    keep = torch.tensor([True, False, True, False, False, True])
    index = torch.tensor([0, 0, 0, 1, 1, 2])
    assert fill_dropped(scores, keep, index).tolist() == pytest.approx([1.0, 0.75, 0.5, 0.0, 0.0, 0.9])


# ---- on-policy distillation --------------------------------------------------------------------------------
def test_reverse_kl_term_by_hand():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -2.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    base = torch.tensor([[0.2, 0.2, 0.2], [-1.0, -1.0, 0.0]])
    advantages, metrics = distill_advantages(base, student, teacher, mask, coef=0.5)
    # d = student - teacher: [[0.5, -1, 0], [0.2, -1, (padding)]]; advantage + (-0.5 * d)
    assert torch.allclose(advantages, torch.tensor([[0.2 - 0.25, 0.2 + 0.5, 0.2], [-1.0 - 0.1, -1.0 + 0.5, 0.0]]))
    assert metrics == {"distill/reverse_kl": pytest.approx((0.5 - 1.0 + 0.0 + 0.2 - 1.0) / 5)}


def test_opd_alone_is_the_teacher_term_and_needs_old_log_probs():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    result = compute_advantages("opd", torch.tensor([0.3, 0.9]), mask)
    assert result.advantages.abs().sum() == 0  # the task reward only shows in the metrics
    advantages, _ = distill_advantages(result.advantages, torch.tensor([[-1.0, -1.0], [-2.0, 0.0]]),
                                       torch.tensor([[-0.5, -1.0], [-1.0, 0.0]]), mask, coef=1.0)
    assert advantages.tolist() == [[0.5, 0.0], [1.0, 0.0]]
    spec = get_algorithm("opd")
    alg = AlgorithmConfig(name="opd", distill=DistillConfig(teacher="/t"))
    needs = step_needs(spec, alg, 8)
    assert needs.teacher and needs.old_log_probs and not needs.reference
    assert not step_needs(get_algorithm("grpo"), AlgorithmConfig(name="grpo"), 8).old_log_probs  # on-policy as before


# ---- the plan refuses, in one line --------------------------------------------------------------------------
def _refused(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        plan_run(load_config(None, overrides))
    assert "\n" not in str(info.value)


def test_opd_without_a_teacher_and_a_teacher_of_another_tokenizer_are_refused(tmp_path):
    _refused(["algorithm.name=opd"], "algorithm 'opd' distils from a teacher: set algorithm.distill.teacher")
    from hybridrl.models.tiny import create_tiny_model

    other = create_tiny_model(tmp_path / "other", vocab_size=96, hidden=32, layers=2)
    from conftest import save_rm_tokenizer

    save_rm_tokenizer(other, chat_template=False)
    _refused(["algorithm.name=opd", f"algorithm.distill.teacher={other}"],
             r"its tokenizer \(96 tokens\) is not the actor's \(64 tokens\)")
    plan = plan_run(load_config(None, ["algorithm.name=opd", "algorithm.distill.teacher=tiny:llama"]))
    assert plan.roles["teacher"].pool == "default" and plan.step.teacher and "ref" not in plan.roles
    assert typed(plan.distill).coef == 1.0


def test_the_opd_teacher_names_how_it_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_CACHE", str(tmp_path))
    _refused(["algorithm.name=opd", "algorithm.distill.teacher=tiny:opd_teacher"],
             "tiny:opd_teacher is not made yet: .*python scripts/make_opd_teacher.py")


def test_judge_sections_are_checked_before_anything_starts():
    _refused(["reward_model.kind=generative", "reward_model.model=tiny:charset_judge"],
             "reward_model.template is not set")
    _refused(JUDGE + ["reward_model.parser.name=choice_logprob", "reward_model.parser.choices=[ab, cd]",
                      "reward_model.parser.choice_values=[1, 0]"],
             "reward_model.parser.choices: 'ab' is 2 tokens of the judge's tokenizer")
    _refused(JUDGE + ["reward_model.generation.tp=2"], r"reward_model.generation.tp=2 with reward_model.parallel.tp=1")
    _refused(JUDGE + ["reward.fn=hybridrl.data.tasks:charset_reward"], "both reward_model.model and reward.fn")
    _refused(JUDGE + ["reward_model.format='{prompt} {response}'"], "reward_model.format is the text a scalar reward")
    _refused(["reward_model.model=tiny:charset_judge", 'reward_model.template="Q: {prompt}"'],
             "reward_model.template is a judge's prompt, but reward_model.kind='scalar'")
    _refused(JUDGE + ["reward_model.on_parse_error=drop", "algorithm.name=dapo", "rollout.n=2"],
             "drops unparsable verdicts .* max_refill_rounds")
    _refused(JUDGE + ["reward_model.pool=gen", "resources.pools={gen: 1}", "rollout.pool=gen",
                      "trainer.mode=one_step_off"], "rollout.pool='gen' also holds reward: generation replicas need")
    plan = plan_run(load_config(None, JUDGE + ["reward_model.generation.engine=native"]))
    source, = plan.sources
    assert (source.name, source.kind, source.role) == ("judge", "generative", "reward")
    gen = source.scorer.generation
    assert (gen.engine, gen.tp, gen.max_model_len) == ("native", 1, 2 * (32 + 16) + 64 + 16)


def test_reward_sources_are_named_once_and_one_kind_each():
    judge = '{name: j, model: {kind: generative, model: "tiny:charset_judge", template: "{prompt}|{response}="}}'
    rule = "{name: task, fn: hybridrl.data.tasks:charset_reward, weight: 0.5}"
    plan = plan_run(load_config(None, [f"reward.sources=[{judge}, {rule}]"]))
    assert [(s.name, s.kind, s.weight, s.role) for s in plan.sources] == [
        ("j", "generative", 1.0, "reward/j"), ("task", "rule", 0.5, "reward/task")]
    assert plan.roles["reward/j"].pool == "default" and plan.reward_fn is None
    _refused([f"reward.sources=[{rule}, {rule}]"], "reward.sources\\[1\\].name='task' is used twice")
    _refused(["reward.sources=[{name: x}]"], r"reward.sources\[0\] \(x\): give exactly one of fn")
    _refused([f"reward.sources=[{rule}]", "reward.fn=hybridrl.data.tasks:charset_reward"],
             "reward.sources is set together with reward.fn")
    _refused(["reward.sources=[{name: x, fn: no_such_module_xyz:f}]"], r"reward.sources\[0\].fn=")


def test_a_vllm_judge_does_not_share_processes_with_a_vllm_actor(head_dim_32_model):
    pytest.importorskip("vllm")
    base = [f"actor.model.path={head_dim_32_model}", "rollout.engine=vllm", "reward_model.generation.engine=vllm"]
    _refused(base + JUDGE, "pool 'default' already runs a vLLM engine \\(actor\\)")
    auto = plan_run(load_config(None, base[:2] + JUDGE))  # auto: the judge falls back to the native engine
    assert auto.sources[0].scorer.generation.engine == "native"
    own = plan_run(load_config(None, base + JUDGE + ["reward_model.pool=judge", "resources.pools={judge: 1}"]))
    assert own.sources[0].scorer.generation.engine == "vllm"
    assert math.isfinite(own.sources[0].scorer.generation.max_model_len)


# ---- the device-mapping search learns the judge and the teacher; the GPU recipes it wrote plan -----------------
JUDGE_RECIPES = sorted((Path(__file__).resolve().parent.parent / "configs" / "gpu" / "judge").glob("*.yaml"))


@pytest.fixture(scope="module")
def llama_shapes(tmp_path_factory) -> dict[str, str]:
    """config.json-only folders of the Llama-2 7B / 70B shapes (the plan reads only the config)."""
    from transformers import LlamaConfig

    from hybridrl.hybrid_engine.model_shapes import LLAMA_PRESETS

    root = tmp_path_factory.mktemp("llama")
    folders = {}
    for name in ("llama-7b", "llama-70b"):
        LlamaConfig(**LLAMA_PRESETS[name], architectures=["LlamaForCausalLM"]).save_pretrained(str(root / name))
        folders[name] = str(root / name)
    return folders


def _auto(*extra: str) -> dict:
    import argparse

    from hybridrl.automap.plan_auto import build_report
    from hybridrl.cli.plan import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_report(parser.parse_args(["--auto", "--model", "llama-7b", "--gpus", "16", "--gpu", "h100",
                                           *extra]))


def test_plan_auto_learns_the_judge_and_the_teacher():
    generated = _auto("--algorithm", "grpo", "--judge-model", "llama-70b", "--judge-tokens", "32", "--judge-pool")
    forward = _auto("--algorithm", "grpo", "--judge-model", "llama-70b", "--judge-tokens", "0", "--judge-pool")
    best = generated["best"]
    assert generated["roles"] == ["actor", "ref", "judge"] and best["placement"]["judge"]["roles"] == ["judge"]
    judge = best["roles"]["judge"]["parallel"]
    assert judge["pp"] == 1 and judge["tp"] * judge["dp"] == 8  # 70B in bf16 generating on 8 H100s
    # a generated verdict costs more than one forward over the same sequences, the judge's KV cache counted
    assert best["estimate"]["ops"]["judge.judge"] > forward["best"]["estimate"]["ops"]["judge.judge"] > 0
    assert best["memory"]["peak_gb_per_gpu"] <= best["memory"]["capacity_gb_per_gpu"]
    small = _auto("--algorithm", "grpo", "--judge-model", "llama-7b", "--judge-pool")["best"]
    assert small["estimate"]["ops"]["judge.judge"] < best["estimate"]["ops"]["judge.judge"]
    opd = _auto("--algorithm", "opd", "--reward-model", "none", "--teacher-model", "llama-70b")
    assert opd["roles"] == ["actor", "teacher"] and opd["best"]["estimate"]["ops"]["teacher.log_prob"] > 0
    with pytest.raises(ValueError, match="--teacher-model"):
        _auto("--algorithm", "opd", "--reward-model", "none")


@pytest.mark.parametrize("path", JUDGE_RECIPES, ids=lambda p: p.name)
def test_judge_gpu_recipes_are_what_plan_auto_writes_and_they_plan(path, llama_shapes, tmp_path):
    import shlex

    import yaml

    from hybridrl.cli import main

    command = next(line for line in path.read_text().splitlines() if line.startswith("# Laid out by: "))
    args = shlex.split(command.removeprefix("# Laid out by: hybridrl "))
    assert main([*args[:-1], str(tmp_path / "again.yaml")]) == 0
    strip = lambda text: yaml.safe_load(text)  # noqa: E731  (the comments aside)
    assert strip((tmp_path / "again.yaml").read_text()) == strip(path.read_text())
    judge = "llama-70b" if "70b" in path.name else "llama-7b"
    overrides = [f"actor.model.path={llama_shapes['llama-7b']}"]
    overrides.append(f"algorithm.distill.teacher={llama_shapes[judge]}" if "opd" in path.name else
                     f"reward_model.model={llama_shapes[judge]}")
    plan = plan_run(load_config(path, overrides))
    if "opd" in path.name:
        assert plan.roles["teacher"].layout == plan.roles["actor"].layout and plan.step.teacher
    else:
        assert plan.roles["reward"].pool == "judge" and plan.sources[0].kind == "generative"
        assert plan.roles["reward"].layout.tp * plan.roles["reward"].layout.dp == 8
