"""Agent programs on the real actor and engine (rollout.agent, rollout/agent.py): a 3-request agent run trains on
exactly the tokens the engine consumed and produced (checked token by token, log-probs included), the same
conversation through rollout.env and through the endpoint gives identical token ids and masks, the trainer runs
agent rollouts that split on a rollout pool of its own, one step off with partial rollouts (each token's policy
version recorded), PPO with its critic trains on split runs that vLLM served (token by token against vLLM's output),
and the bundled agent config learns its task. (Agent rows have the layout of rollout.env's episodes, which every
algorithm trains on in tests/test_multiturn.py.)"""
from __future__ import annotations

import math

import pytest
import torch

import hybridrl
from agent_programs import SERVED
from test_multiturn import _model_spans as spans_of_ones
from hybridrl.config import EndpointConfig
from hybridrl.data.dataset import PromptRow
from hybridrl.data.loader import collate_prompts
from hybridrl.envs import Environment, StepResult, register_env
from hybridrl.rollout.agent import AgentRunner, AgentSettings
from hybridrl.rollout.agent_trace import TraceLimits
from hybridrl.rollout.multiturn import EpisodeLimits, EpisodeRunner

MAX_MODEL_LEN = 128


@register_env("test_turns")
class TurnsEnv(Environment):
    """The conversation agent_programs.turns_like_the_env makes: three turns, "digits:" then "vowels:" between."""

    def reset(self, row):
        self.turn = 0
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        return StepResult(("digits:", "vowels:")[(self.turn - 1) % 2], 0.0, self.turn == 3)


POOLS: list = []  # the actor fixture's pool: the trainer tests free its devices first


@pytest.fixture(scope="module")
def actor(ray_four_devices):
    pool = hybridrl.ResourcePool(devices=2)
    POOLS.append(pool)
    actor = hybridrl.Actor(model=None, parallel={"tp": 2}, resource_pool=pool,
                           rollout={"tp": 1, "n": 2, "max_new_tokens": 6, "max_model_len": MAX_MODEL_LEN})
    yield actor
    pool.shutdown()


@pytest.fixture
def devices(ray_four_devices):
    """All four devices for a trainer (the actor fixture's pool, if started, is shut down)."""
    while POOLS:
        POOLS.pop().shutdown()


def _prompts(rows: list[dict]):
    return collate_prompts([PromptRow(i, [1], row["prompt"], {k: v for k, v in row.items() if k != "prompt"})
                            for i, row in enumerate(rows)], 0)


def _runner(actor, agent: str, limits: TraceLimits) -> AgentRunner:
    settings = AgentSettings(64, 60.0, None, EndpointConfig(), scored_elsewhere=False)
    return AgentRunner(agent, settings, actor.tokenizer, True, limits, "tiny")


def _trajectories(rollout) -> list[tuple]:
    """Each row without its padding: (prompt ids, tokens after it, response mask, rollout log-probs, versions)."""
    seqs, width = rollout.sequences, rollout.sequences["prompts"].shape[1]
    rows = []
    for i in range(len(rollout)):
        prompt = seqs["prompts"][i][seqs["attention_mask"][i, :width].bool()].tolist()
        real_tokens = seqs["attention_mask"][i, width:].bool()
        rows.append((prompt, seqs["responses"][i][real_tokens].tolist(), seqs["response_mask"][i][real_tokens].tolist(),
                     seqs["rollout_log_probs"][i][real_tokens].tolist(),
                     seqs["policy_versions"][i][real_tokens].tolist()))
    return rows


def test_an_agent_run_trains_on_exactly_the_served_tokens(actor, monkeypatch):
    """3 requests per run, 2 runs per row (sampling); the rows with "edit" rewrite the history before their third
    request. Every request's prompt ids are what the engine got, its tokens what the engine returned; the
    trajectory is prompt 1 + answer 1 + observation + answer 2 + observation + answer 3, the mask exactly on the
    answers, the rollout log-probs the engine's, and the trainer's log-probs of the trajectory equal them."""
    engine_io: dict[tuple, list[list[int]]] = {}
    real = actor.generate_turn

    def recording(prompt_ids, params):
        out = real(prompt_ids, params)
        for ids, row, keep in zip(prompt_ids, out["responses"], out["response_mask"].bool()):
            engine_io.setdefault(tuple(ids), []).append(row[keep].tolist())
        return out

    monkeypatch.setattr(actor, "generate_turn", recording)
    SERVED.clear()
    runner = _runner(actor, "agent_programs:three_requests", TraceLimits(3, 6, 80, MAX_MODEL_LEN))
    try:
        rollout, = runner.run(actor, _prompts([{"prompt": "vowels: qzk"}, {"prompt": "digits: xy"},
                                               {"prompt": "vowels: b", "edit": True}]), [{"seed": 11}], version=5)
    finally:
        runner.close()
    assert len(SERVED) == 6 and len(rollout) == 4 + 2 * 2  # the two edited runs split into two trajectories
    assert list(rollout.sequences.non_tensors["group_index"]) == [0, 0, 1, 1, 2, 2, 2, 2]
    trajectories = _trajectories(rollout)
    for run in SERVED:
        served = run["responses"]
        for request in served:  # the engine consumed the prompt ids and produced the tokens served
            assert request["token_ids"] in engine_io[tuple(request["prompt_ids"])] and request["version"] == 5
        requests = served[:2] if run["edit"] else served
        mine = [t for t in trajectories if t[0] == requests[0]["prompt_ids"]
                and [t[1][a:b] for a, b in spans_of_ones(torch.tensor(t[2]))] == [r["token_ids"] for r in requests]]
        assert len(mine) == 1, run
        prompt, tokens, mask, log_probs, versions = mine[0]
        spans = spans_of_ones(torch.tensor(mask))
        for request, (start, end) in zip(requests, spans):
            assert prompt + tokens[:start] == request["prompt_ids"]  # the whole trajectory before the answer
            assert log_probs[start:end] == pytest.approx(request["log_probs"], abs=1e-6)
            assert set(versions[start:end]) == {5}
        assert all(lp == 0.0 for lp, m in zip(log_probs, mask) if not m) and end == len(tokens)
        if run["edit"]:  # the third request: a trajectory of its own, its prompt the served tokens up to answer 1
            third = served[2]
            split = [t for t in trajectories if t[0] == third["prompt_ids"]]
            assert len(split) == 1 and split[0][1] == third["token_ids"] and sum(split[0][2]) == len(split[0][1])
            first_answer_end = len(requests[0]["prompt_ids"]) + len(requests[0]["token_ids"])
            assert third["prompt_ids"][:first_answer_end] == requests[1]["prompt_ids"][:first_answer_end]
    trained = actor.compute_log_probs(rollout)
    assert ((trained - rollout.log_probs) * rollout.mask).abs().max().item() < 1e-4


def test_the_same_conversation_through_env_and_endpoint(actor):
    """Greedy: rollout.env's EpisodeRunner and the endpoint give identical token ids and masks."""
    rows = [{"prompt": p} for p in ("vowels: qzk", "digits: xy", "vowels: b")]
    env = EpisodeRunner("test_turns", {}, actor.tokenizer, True, EpisodeLimits(3, 6, 80, 32))
    agents = _runner(actor, "agent_programs:turns_like_the_env", TraceLimits(3, 6, 80, MAX_MODEL_LEN))
    try:
        by_agent, = agents.run(actor, _prompts(rows), [{"greedy": True, "seed": 0}])
    finally:
        agents.close()
    by_env, = env.run(actor, _prompts(rows), [{"greedy": True, "seed": 0}])
    a, e = by_agent.sequences, by_env.sequences
    for key in ("prompts", "responses", "attention_mask", "response_mask"):
        assert torch.equal(a[key], e[key]), key
    assert torch.allclose(a["rollout_log_probs"], e["rollout_log_probs"], atol=1e-5)
    assert a["response_mask"].sum(-1).gt(0).all() and (a["response_mask"] < a["attention_mask"][:, a["prompts"]
                                                                                                 .shape[1]:]).any()
    assert by_agent.texts == by_env.texts


def _train(overrides: list[str], config: str | None = None):
    from test_trainer_e2e import run_steps

    return run_steps(overrides, config)


@pytest.mark.slow
def test_remax_one_step_off_on_a_rollout_pool_with_partial_rollouts(devices):
    """Generation on a pool of its own, one step off, partial rollouts, a LoRA actor: agent requests are served by
    the replicas (the adapters sent to them alone), each model token records the policy version that generated it
    (staleness <= 1); ReMax's greedy runs give each prompt group its baseline while half the runs split into two
    trajectories (groups of other sizes than rollout.n reach the estimator and the update); the reference is the
    actor with its adapters off."""
    trainer, history = _train(["algorithm.name=remax", "rollout.agent=agent_programs:splitting",
                               "data.chat_template=true", "rollout.max_turns=2", "rollout.n=1",
                               "actor.parallel.tp=2", "rollout.tp=1", "resources.pools={gen: 1}", "rollout.pool=gen",
                               "trainer.mode=one_step_off", "rollout.partial=true", "actor.lora.rank=4"])
    assert trainer.step == 2 and trainer.plan.step.reference_from_actor and "ref" not in trainer.plan.roles
    for metrics in history:
        assert metrics["actor/update_ok"] == 1.0 and all(math.isfinite(v) for v in metrics.values())
        assert metrics["agent/requests_mean"] == 2.0 and metrics["agent/errors"] == 0.0
        assert 1.0 < metrics["agent/trajectories_mean"] < 2.0 and "baseline_reward_mean" in metrics  # odd ids split
        assert 0.0 <= metrics["async/staleness_mean"] <= metrics["async/staleness_max"] <= 1.0
    assert history[0]["async/staleness_max"] == 0.0 and history[1]["async/staleness_max"] == 1.0


@pytest.mark.slow
def test_ppo_with_a_critic_on_vllm_served_agent_runs_that_split(devices, head_dim_32_model, monkeypatch):
    """rollout.engine=vllm serves the endpoint: an AsyncOpenAI agent makes three requests and rewrites its history
    before the third (every run: two trajectories), and PPO with its critic trains on the runs for 2 steps. Each
    row is exactly the token ids vLLM consumed and produced, the mask on the model's tokens only, the rollout
    log-probs vLLM's (the trainer's within 1e-3 of them, fp32: measured 5e-7); GAE on the critic's values leaves
    the observations out; the critic and the actor updated."""
    from hybridrl.data.tasks import charset_reward
    from hybridrl.roles.actor import Actor
    from hybridrl.roles.critic import Critic
    from test_trainer_e2e import expected_advantages, spy_on_advantages

    engine_io: dict[tuple, list[tuple[list[int], list[float]]]] = {}  # prompt ids -> (tokens, log-probs) vLLM gave
    trained, critic_updates = [], []
    real_turn, real_log_probs, real_critic_update = Actor.generate_turn, Actor.compute_log_probs, Critic.update

    def generate_turn(self, prompt_ids, params):
        out = real_turn(self, prompt_ids, params)
        for ids, tokens, log_probs, keep in zip(prompt_ids, out["responses"], out["rollout_log_probs"],
                                                out["response_mask"].bool()):
            engine_io.setdefault(tuple(ids), []).append((tokens[keep].tolist(), log_probs[keep].tolist()))
        return out

    def compute_log_probs(self, sequences):
        log_probs = real_log_probs(self, sequences)
        trained.append((sequences, log_probs))
        return log_probs

    def critic_update(self, *args, **kwargs):
        critic_updates.append(real_critic_update(self, *args, **kwargs))
        return critic_updates[-1]

    monkeypatch.setattr(Actor, "generate_turn", generate_turn)
    monkeypatch.setattr(Actor, "compute_log_probs", compute_log_probs)
    monkeypatch.setattr(Critic, "update", critic_update)
    inputs, fed = spy_on_advantages(monkeypatch)
    SERVED.clear()
    trainer, history = _train(["algorithm.name=ppo", "algorithm.ppo_epochs=2", "algorithm.mini_batch_size=2",
                               "rollout.engine=vllm", f"actor.model.path={head_dim_32_model}", "actor.parallel.tp=2",
                               "rollout.tp=1", "rollout.n=1", "rollout.agent=agent_programs:edits_history",
                               "data.chat_template=true", "rollout.max_turns=3"])
    assert trainer.step == 2 and trainer.plan.rollout.engine == "vllm" and "critic" in trainer.plan.roles
    assert len(SERVED) == 8 and len(trained) == len(inputs) == len(fed) == len(critic_updates) == 2
    for step, ((rollout, trainer_log_probs), x, advantages, critic, metrics) in enumerate(
            zip(trained, inputs, fed, critic_updates, history)):
        runs = SERVED[4 * step:4 * (step + 1)]  # a step's runs all end before the next step's start
        assert len(rollout) == 8 and list(rollout.sequences.non_tensors["group_index"]) == [0, 0, 1, 1, 2, 2, 3, 3]
        rows = _trajectories(rollout)
        for run in runs:
            first, second, third = run["responses"]
            for request in run["responses"]:  # served: what vLLM consumed and produced, its log-probs
                got = [lp for tokens, lp in engine_io[tuple(request["prompt_ids"])] if tokens == request["token_ids"]]
                assert got and request["log_probs"] == pytest.approx(got[0], abs=1e-6) and request["version"] == step
            # the run's first trajectory: prompt, answer 1, observation, answer 2; the mask on the answers only
            mine = [t for t in rows if t[0] == first["prompt_ids"] and [t[1][a:b] for a, b in spans_of_ones(
                torch.tensor(t[2]))] == [first["token_ids"], second["token_ids"]]]
            assert len(mine) == 1, run
            prompt, tokens, mask, log_probs, versions = mine[0]
            for request, (start, end) in zip((first, second), spans_of_ones(torch.tensor(mask))):
                assert prompt + tokens[:start] == request["prompt_ids"]
                assert log_probs[start:end] == pytest.approx(request["log_probs"], abs=1e-6)
                assert set(versions[start:end]) == {step}
            assert end == len(tokens) and sum(mask) == len(first["token_ids"]) + len(second["token_ids"])
            assert all(lp == 0.0 for lp, m in zip(log_probs, mask) if not m) and 0 in mask  # the observation
            # the edit: a trajectory of its own whose prompt is the served tokens up to answer 1, then the new message
            split = [t for t in rows if t[0] == third["prompt_ids"]]
            assert len(split) == 1 and split[0][1] == third["token_ids"] and split[0][2] == [1] * len(split[0][1])
            assert third["prompt_ids"][:len(first["prompt_ids"]) + len(first["token_ids"])] == \
                first["prompt_ids"] + first["token_ids"]
            assert split[0][3] == pytest.approx(third["log_probs"], abs=1e-6)
        # the trainer's log-probs of the rows (Megatron, the weights vLLM generated with) against vLLM's
        mask = rollout.mask
        assert ((trainer_log_probs - rollout.log_probs) * mask).abs().max().item() < 1e-3
        assert 0.0 <= metrics["mismatch/log_prob_diff"] < 1e-3
        # every trajectory of a run gets the run's reward (the agent's: its third answer's charset score)
        rewards = [charset_reward(run["prompt"], trainer.tokenizer.decode(run["responses"][2]["token_ids"],
                                                                           skip_special_tokens=True)) for run in runs]
        assert sorted(x["scores"].tolist()) == pytest.approx(sorted(rewards * 2))
        # GAE with the critic's values: on the model's tokens only
        assert x["values"] is not None and torch.isfinite(x["values"]).all()
        assert torch.allclose(advantages, expected_advantages(x), atol=1e-6)
        assert (advantages * (1 - mask)).abs().sum() == 0 and (advantages * mask).abs().sum() > 0
        assert critic["update_ok"] == 1.0 and math.isfinite(critic["grad_norm"]) and critic["grad_norm"] > 0
        assert math.isfinite(critic["critic/value_loss"]) and metrics["critic/value_loss"] > 0
        assert metrics["critic/update_ok"] == 1.0 and metrics["critic/grad_norm"] == critic["grad_norm"]
        assert metrics["actor/update_ok"] == 1.0 and all(math.isfinite(v) for v in metrics.values())
        assert metrics["agent/requests_mean"] == 3.0 and metrics["agent/trajectories_mean"] == 2.0
        assert metrics["agent/errors"] == metrics["agent/timeouts"] == metrics["agent/request_errors"] == 0.0
        assert metrics["agent/tokens_mean"] == sum(len(r["token_ids"]) for run in runs
                                                   for r in run["responses"]) / 4
        assert metrics["time/agent"] > 0


@pytest.mark.slow
def test_agent_config_learns(devices, tmp_path):
    """configs/grpo_agent_tiny.yaml: the openai-client agent learns the task (first < 0.2, last-5 mean > 0.8;
    measured 0.08 -> 0.98)."""
    _, history = _train([f"trainer.run_dir={tmp_path}"], "grpo_agent_tiny.yaml")
    rewards = [m["reward_mean"] for m in history]
    assert rewards[0] < 0.2 and sum(rewards[-5:]) / 5 > 0.8, rewards
    assert all(m["agent/requests_mean"] == 2.0 and m["agent/errors"] == 0 for m in history)
    assert all(m["agent/tokens_mean"] > 0 and m["time/agent"] > 0 for m in history)
