"""Multi-turn episodes (rollout/multiturn.py) with the real actor on both engines: the tokens of an episode are
the model's turns exactly as generated and the environment's observations encoded on their own, the response
mask covers the model's tokens only (checked token by token), the trainer's log-probs of those tokens see the
observations as context, every algorithm trains on episodes, and the bundled multi-turn task is learnt."""
from __future__ import annotations

import json
import math

import pytest
import torch

import hybridrl
from hybridrl.algorithms.advantages import gae
from hybridrl.data.dataset import PromptRow
from hybridrl.data.loader import collate_prompts
from hybridrl.envs import Environment, EnvironmentStepError, StepResult, register_env
from hybridrl.rollout.multiturn import ConversationFormat, EpisodeLimits, EpisodeRunner, episode_metrics

RECORD: list["CountdownEnv"] = []  # every CountdownEnv the runner built, in episode order


@register_env("test_countdown")
class CountdownEnv(Environment):
    """Shows "k:" with the turns left; rewards a turn by its length; records what the model said."""

    def __init__(self, turns: int = 3, fail_at: int | None = None) -> None:
        self.turns, self.fail_at = turns, fail_at

    def reset(self, row):
        self.left, self.actions = self.turns, []
        RECORD.append(self)
        return row["prompt"]

    def step(self, action):
        if self.fail_at is not None and len(self.actions) + 1 == self.fail_at:
            raise RuntimeError("the environment broke")
        self.actions.append(action)
        self.left -= 1
        return StepResult(f"{self.left}:" if self.left else "", len(action) / 10, self.left == 0,
                          {"tool_calls": 1, "tool_errors": int(not action)})


def _prompts(texts: list[str]):
    return collate_prompts([PromptRow(i, [1], text, {"row": i}) for i, text in enumerate(texts)], 0)


def _runner(tokenizer, turns: int = 3, **env_kwargs) -> EpisodeRunner:
    limits = EpisodeLimits(max_turns=turns, max_new_tokens=6, max_episode_tokens=40, max_prompt_length=16)
    return EpisodeRunner("test_countdown", {"turns": turns, **env_kwargs}, tokenizer, False, limits)


def _model_spans(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    spans, start = [], None
    for i, m in enumerate(mask.tolist() + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def check_episode_tokens(rollout, envs, runner) -> None:
    """Token by token: model turn, observation, model turn, ...; the mask is 1 exactly on the model's turns."""
    seqs, tokenizer = rollout.sequences, runner.tokenizer
    width = seqs["prompts"].shape[1]
    for i, env in enumerate(envs):
        responses, mask = seqs["responses"][i], seqs["response_mask"][i]
        real = seqs["attention_mask"][i, width:]
        spans = _model_spans(mask)
        assert len(spans) == len(env.actions) >= 1
        position = 0
        for turn, ((start, end), action) in enumerate(zip(spans, env.actions)):
            assert start == position  # nothing between an observation and the next turn
            assert tokenizer.decode(responses[start:end].tolist(), skip_special_tokens=True) == action
            position = end
            if turn + 1 < len(spans):  # the observation shown after this turn, encoded on its own
                eos = tokenizer.eos_token_id
                after = eos if responses[end - 1] == eos else None
                observation = runner.format.observation(f"{env.turns - turn - 1}:", after_token=after)
                assert responses[end:end + len(observation)].tolist() == observation
                assert mask[end:end + len(observation)].sum() == 0 and real[end:end + len(observation)].all()
                position = end + len(observation)
        assert real[:position].all() and real[position:].sum() == 0  # nothing after the last turn
        assert (seqs["rollout_log_probs"][i] * (1 - mask)).abs().sum() == 0  # observations carry no log-prob


@pytest.mark.parametrize("engine", ["native", "vllm"])
def test_episodes_on_the_real_actor(ray_two_devices, head_dim_32_model, engine):
    from hybridrl.models.tiny import default_model_dir

    path = head_dim_32_model if engine == "vllm" else str(default_model_dir())
    pool = hybridrl.ResourcePool(devices=2)
    try:
        actor = hybridrl.Actor(model=path, parallel={"tp": 2}, resource_pool=pool,
                               rollout={"engine": engine, "tp": 1, "max_new_tokens": 6, "n": 2, "max_model_len": 64})
        runner = _runner(actor.tokenizer)
        prompts = _prompts(["vowels: qzk", "digits: xy", "vowels: b"])

        RECORD.clear()
        sampled, = runner.run(actor, prompts, [{"seed": 5}])
        envs = list(RECORD)
        assert len(sampled) == len(envs) == 6  # n=2 episodes per prompt, prompt-major
        assert [m["row"] for m in sampled.metadata] == [0, 0, 1, 1, 2, 2]
        check_episode_tokens(sampled, envs, runner)
        assert sampled.finish_reasons == ["stop"] * 6 and all(len(e.actions) == 3 for e in envs)
        expected_rewards = [sum(len(a) / 10 for a in e.actions) for e in envs]
        assert sampled.sequences.non_tensors["episode_rewards"].astype(float).tolist() == \
            pytest.approx(expected_rewards)
        metrics = episode_metrics(sampled.sequences)
        assert metrics["rollout/turns_mean"] == 3.0 and metrics["rollout/tool_calls_mean"] == 3.0
        assert metrics["rollout/episode_tokens_mean"] > float(sampled.mask.sum(-1).mean())  # + observations

        # the trainer's log-probs of the model's tokens, with the observations as context, equal the engine's
        trained = actor.compute_log_probs(sampled)
        mask = sampled.mask
        diff = ((trained - sampled.log_probs) * mask).abs().max().item()
        assert diff < (1e-4 if engine == "native" else 0.05), diff

        # what a turn was generated from is exactly the token ids before it: greedy episodes, then each later
        # turn regenerated alone from prompt + the episode's tokens up to it
        RECORD.clear()
        greedy, = runner.run(actor, prompts, [{"greedy": True, "seed": 0}])
        envs = list(RECORD)
        check_episode_tokens(greedy, envs, runner)
        seqs, width = greedy.sequences, greedy.sequences["prompts"].shape[1]
        contexts, expected = [], []
        for i in range(len(envs)):
            prompt = seqs["prompts"][i][seqs["attention_mask"][i, :width].bool()].tolist()
            for start, end in _model_spans(seqs["response_mask"][i])[1:]:
                contexts.append(prompt + seqs["responses"][i][:start].tolist())
                expected.append(seqs["responses"][i][start:end].tolist())
        again = actor.generate_sequences(contexts, greedy=True, max_new_tokens=6)
        for row, tokens in enumerate(expected):
            got = again.sequences["responses"][row][again.sequences["response_mask"][row].bool()].tolist()
            assert got[:len(tokens)] == tokens

        # an environment that raises: one line naming it, and the actor is back in the training layout
        broken = _runner(actor.tokenizer, fail_at=2)
        with pytest.raises(EnvironmentStepError, match="test_countdown.*step\\(\\) raised RuntimeError: the "
                                                        "environment broke.*vowels: qzk"):
            broken.run(actor, prompts, [{"seed": 1}])
        assert len(actor.generate_sequences(["vowels: a"], seed=2)) == 2
    finally:
        pool.shutdown()


def test_conversation_format_plain_and_chat():
    from hybridrl.data.tokenizer import tokenizer_for
    from hybridrl.models.tiny import default_model_dir

    tokenizer = tokenizer_for(str(default_model_dir()))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    plain = ConversationFormat(tokenizer, chat=False)
    assert plain.first("vowels:") == [tokenizer.bos_token_id] + encode("vowels:")  # like a dataset prompt
    assert plain.observation("digits:") == encode("digits:")
    # the tiny template: "<s>u:...\na:" -- an observation is the user message and the next generation prompt
    chat = ConversationFormat(tokenizer, chat=True)
    assert chat.first("vowels:") == encode("<s>u:vowels:\na:")
    assert chat.observation("digits:") == encode("\nu:digits:\na:")
    assert chat.observation("42", role="tool") == encode("\nt:42\na:")
    # a template that closes the model's turn with EOS: the EOS the model generated is not repeated
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
                               "{% if m['role'] == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}a:{% endif %}")
    closing = ConversationFormat(tokenizer, chat=True)
    eos = tokenizer.eos_token_id
    assert closing.observation("x", after_token=eos) == encode("\nu:x\na:")
    assert closing.observation("x") == [eos] + encode("\nu:x\na:")


def test_gae_skips_observation_tokens():
    """An episode's observations (mask 0 inside the response) are skipped: GAE equals GAE on the model's
    tokens alone, whatever values the critic gives the observations."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 1, 0], [1, 0, 0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    rewards, values = torch.randn(2, 10) * mask, torch.randn(2, 10)
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    for row in range(2):
        keep = mask[row].bool()
        compact, compact_returns = gae(rewards[row][keep][None], values[row][keep][None], torch.ones(1, int(keep.sum())),
                                       gamma=0.9, lam=0.8, whiten=False)
        assert torch.allclose(advantages[row][keep], compact[0]) and torch.allclose(returns[row][keep], compact_returns[0])
        assert (advantages[row][~keep] == 0).all()


EPISODES = ["rollout.env=charset_turns", "rollout.env_kwargs={turns: 2}", "rollout.max_turns=2"]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dapo", "grpo", "ppo", "reinforce_pp", "remax", "rloo", "safe_rlhf"])
def test_every_algorithm_trains_on_episodes(ray_two_devices, algorithm, monkeypatch):
    from test_trainer_e2e import CASES, expected_advantages, run_steps, spy_on_advantages

    overrides = list(CASES[algorithm])  # dapo: overlong shaping against the episode's token budget
    if algorithm == "safe_rlhf":  # a rule cost on the episode's text
        overrides.append("reward.cost_fn=hybridrl.data.tasks:digit_cost")
    inputs, fed = spy_on_advantages(monkeypatch)
    trainer, history = run_steps([f"algorithm.name={algorithm}", *overrides, *EPISODES])
    assert trainer.step == 2 and len(inputs) == len(fed) == 2
    for x, advantages in zip(inputs, fed):
        expected = expected_advantages(x)
        if expected is not None:
            assert torch.allclose(advantages, expected, atol=1e-6), (algorithm, advantages, expected)
    for metrics in history:
        assert metrics["actor/update_ok"] == 1.0 and all(math.isfinite(v) for v in metrics.values())
        low = -1.0 if algorithm == "dapo" else 0.0  # overlong shaping subtracts up to 1
        assert low <= metrics["reward_mean"] <= 1.0  # the mean of the turns' charset rewards
        assert 1.0 <= metrics["rollout/turns_mean"] <= 2.0
        assert metrics["rollout/episode_tokens_mean"] >= metrics["response_length_mean"]
        assert metrics["time/env"] >= 0.0
    assert any(m["rollout/turns_mean"] > 1.0 for m in history)
    if algorithm in ("ppo", "safe_rlhf"):
        assert all(m["critic/value_loss"] > 0 for m in history)


@pytest.mark.slow
def test_multiturn_config_learns(ray_two_devices, tmp_path):
    """configs/grpo_multiturn_tiny.yaml: reward first < 0.3 -> last > 0.7, more than one turn per episode."""
    from test_trainer_e2e import run_steps

    _, history = run_steps([f"trainer.run_dir={tmp_path}"], "grpo_multiturn_tiny.yaml")
    rewards = [m["reward_mean"] for m in history]
    assert rewards[0] < 0.3 and sum(rewards[-5:]) / 5 > 0.7, rewards
    assert sum(m["rollout/turns_mean"] for m in history) / len(history) > 1.0


def test_python_tool_gpu_recipe_plans_for_qwen2_5_7b(tmp_path):
    """configs/gpu/tools/: refuses its placeholders; with a config-only Qwen2.5-7B folder it plans the layout its
    header justifies (t=2, d=4, t_g=2 on 8 GPUs) and the episode budget (512 + 3072 tokens)."""
    from transformers import Qwen2Config

    from hybridrl.config import CONFIG_DIR, ConfigError, load_config
    from hybridrl.trainer.plan import plan_run

    recipe = CONFIG_DIR / "gpu" / "tools" / "grpo_qwen2_5_7b_python_8gpu.yaml"
    with pytest.raises(ConfigError, match="actor.model.path='/path/to/"):
        plan_run(load_config(recipe))
    Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, architectures=["Qwen2ForCausalLM"]) \
        .save_pretrained(str(tmp_path / "qwen"))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "What is 17 * 23? Use the python tool.", "answer": "391"}) + "\n")
    cfg = load_config(recipe, [f"actor.model.path={tmp_path / 'qwen'}", f"data.train_files=[{data}]"])
    plan = plan_run(cfg)
    assert cfg.rollout.env == "tool_answer" and cfg.data.chat_template
    assert set(plan.roles) == {"actor", "ref"} and plan.reward_fn is None  # the environment rewards
    actor = plan.roles["actor"].layout
    assert (actor.tp, actor.pp, actor.dp) == (2, 1, 4) and cfg.rollout.tp == 2
    assert plan.response_length == 3072 and plan.rollout.max_model_len == 512 + 3072 and plan.step.mini_batches == 4
