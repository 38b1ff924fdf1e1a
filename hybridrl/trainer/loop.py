"""The RL loop the CLI runs: one driver, plain serial Python over the role objects of hybridrl.roles.

One step, for every algorithm, is five named stages (RLTrainer.train_step):
  _rollout     prompts -> actor.generate_many (hybrid engine transition + rollout) [+ greedy baseline], or
               multi-turn episodes with rollout.env (rollout/multiturn.py), or agent programs with rollout.agent
               (rollout/agent.py, through the OpenAI-compatible endpoint), or the rollout pool's replicas
               (rollout.pool apart from the actor's; trainer.mode sync / one_step_off / async: async_rollout.py)
  _score       rewards (the episodes' and the reward sources': rule functions, reward models, judges; roles/sources.py)
               [+ costs]; overlong shaping, dynamic sampling
  _evaluate    reference log-probs, old log-probs (skipped when the update is exactly on-policy), values, a
               distillation teacher's log-probs
  _advantages  the algorithm's registered estimator (algorithms/catalog/), KL as a reward penalty or a loss, the
               teacher's per-token term (algorithms/distill.py); samples a judge dropped leave the update
  _update      critic update(s) -> actor update -> KL controller / Lagrange multiplier
then _metrics. What runs is decided by the run plan's step needs (plan.step, from the algorithm's registry
entry), never by the algorithm's name.
"""
from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridrl.algorithms.compute import compute_advantages
from hybridrl.algorithms.distill import distill_advantages
from hybridrl.algorithms.kl_control import build_kl_controller
from hybridrl.algorithms.lagrangian import LagrangeMultiplier
from hybridrl.algorithms.losses import kl_penalty, masked_mean
from hybridrl.algorithms.shaping import fill_dropped, overlong_penalty
from hybridrl.config import ConfigError
from hybridrl.controller import ResourcePool, ensure_ray
from hybridrl.controller.interrupts import Interrupted
from hybridrl.data.dataset import prompt_dataset_from_config
from hybridrl.data.loader import StatefulPromptLoader
from hybridrl.data.tokenizer import tokenizer_for
from hybridrl.envs import resolve_sandbox, set_default_sandbox
from hybridrl.models.config import CheckpointError
from hybridrl.models.peft import tokenizer_folder
from hybridrl.rollout.agent import AgentReplicas, AgentRunner, AgentSettings, agent_metrics
from hybridrl.rollout.agent_trace import TraceLimits
from hybridrl.rollout.multiturn import EpisodeLimits, EpisodeRunner, episode_metrics
from hybridrl.rollout.types import group_baseline, group_index
from hybridrl.trainer.async_rollout import RolloutQueue
from hybridrl.trainer.checkpoint import (CheckpointManager, load_driver_state, rng_states, save_driver_state,
                                         set_rng_states)
from hybridrl.trainer.dynamic_sampling import refill
from hybridrl.trainer.plan import RunPlan
from hybridrl.trainer.roles import start_reward_sources, start_roles, start_rollout_replicas
from hybridrl.trainer.timers import StageTimer

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """A step produced NaN/inf (loss, gradients or rewards) and trainer.on_nan=stop."""


# Roles whose weights and optimizer change during training: the ones a checkpoint holds.
TRAINED_ROLES = ("actor", "critic", "cost_critic")


@dataclass
class StepData:
    """What one step's stages hand on to the next."""
    groups: int  # prompts in the batch (each with rollout.n responses)
    seed: int
    out: Any  # the Rollout trained on
    greedy: Any = None  # ReMax's greedy responses
    scores: torch.Tensor | None = None
    baseline: torch.Tensor | None = None
    costs: torch.Tensor | None = None
    keep: torch.Tensor | None = None  # [B] bool: False for samples a judge dropped (None: all kept)
    ref_log_probs: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None  # on-policy distillation
    old_log_probs: torch.Tensor | None = None  # None: the update is exactly on-policy
    values: torch.Tensor | None = None
    cost_values: torch.Tensor | None = None
    result: Any = None  # AdvantageResult
    kl_coef: float = 0.0
    sequence_kl: float = 0.0
    metrics: dict = field(default_factory=dict)


class RLTrainer:
    """Builds the data, the controllers and the roles from a checked RunPlan, then runs steps."""

    def __init__(self, cfg: Any, plan: RunPlan) -> None:
        self.cfg, self.plan = cfg, plan
        alg = cfg.algorithm
        self.tokenizer = tokenizer_for(tokenizer_folder(plan.roles["actor"].model_path))
        try:
            dataset = prompt_dataset_from_config(cfg.data, self.tokenizer)
            self.loader = StatefulPromptLoader(dataset, cfg.data.batch_size, self.tokenizer.pad_token_id or 0,
                                               seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        except (ValueError, KeyError, FileNotFoundError) as exc:
            raise ConfigError(f"data: {exc.args[0] if isinstance(exc, KeyError) else exc}") from None
        self.kl_ctrl = build_kl_controller(**dict(alg.kl), total_steps=cfg.trainer.steps)
        self.lagrange = LagrangeMultiplier(alg.lagrangian_init, alg.lagrangian_lr, alg.cost_limit) \
            if plan.step.cost else None
        self.step = 0
        self.roles: dict[str, Any] = {}
        self.timer = StageTimer()
        self.episodes = self._episode_runner() if cfg.rollout.env else None
        self.agents = self._agent_runner() if cfg.rollout.agent else None
        self.rollouts = None  # RolloutQueue when generation has a pool of its own

    def _episode_runner(self) -> EpisodeRunner:
        r = self.cfg.rollout
        limits = EpisodeLimits(r.max_turns, r.max_new_tokens, self.plan.response_length,
                               self.cfg.data.max_prompt_length, r.turn_discount)
        if self.plan.rollout.tool_sandbox != "auto":  # the plan's choice for tools that run code (envs/sandbox.py)
            set_default_sandbox(resolve_sandbox(self.plan.rollout.tool_sandbox, r.tool_sandbox_url))
        return EpisodeRunner(r.env, dict(r.env_kwargs), self.tokenizer, self.cfg.data.chat_template, limits)

    def _agent_runner(self) -> AgentRunner:
        r, plan = self.cfg.rollout, self.plan
        settings = AgentSettings(r.agent_concurrency, r.agent_timeout_s, r.agent_failure_reward, plan.rollout.endpoint,
                                 scored_elsewhere=bool(plan.sources))  # reward.fn, reward_model, reward.sources
        limits = TraceLimits(r.max_turns, r.max_new_tokens, plan.response_length, plan.rollout.max_model_len)
        return AgentRunner(r.agent, settings, self.tokenizer, self.cfg.data.chat_template, limits,
                           Path(plan.roles["actor"].model_path).name)

    # ---- roles -----------------------------------------------------------------------------------------
    def start_ray(self) -> None:
        """Start Ray (local unless resources.ray_address), or reuse the one this driver runs."""
        ensure_ray(num_devices=sum(self.plan.pools.values()), address=self.cfg.resources.ray_address)

    def start(self) -> None:
        """Start Ray and every role on its pool."""
        self.start_ray()
        self.pools = {name: self._pool(name) for name in self.plan.node_devices}
        self.roles = start_roles(self.cfg, self.plan, self.pools, self.tokenizer)
        self.rewards = start_reward_sources(self.cfg, self.plan, self.pools)
        self.roles.update(self.rewards.scorers)
        if "rollout" in self.plan.roles:
            self._start_rollout_pool()

    def _pool(self, name: str) -> ResourcePool:
        """Pool `name` on the plan's nodes (resources.node_devices: whole nodes, or an even share of each)."""
        split = self.plan.node_devices[name]
        return ResourcePool(nodes=len(split), devices_per_node=split, name=name,
                            start_timeout_s=self.plan.start_timeout_s)

    def _start_rollout_pool(self) -> None:
        """Generation replicas on rollout.pool, fed shard to shard by the actor, and the queue ahead of training."""
        plan = self.plan
        self.roles["rollout"] = start_rollout_replicas(self.cfg, plan, self.roles["actor"],
                                                       self.pools[plan.roles["rollout"].pool])
        greedy = plan.step.greedy_baseline
        source = self.roles["rollout"]
        if self.agents is not None:  # agent runs generate on the replicas; a restart abandons the old ones
            self.agents.cancel()
            source = AgentReplicas(self.agents, source)
        self.rollouts = RolloutQueue(source, self.loader, plan.rollout_ahead,
                                     self.cfg.algorithm.max_staleness,
                                     lambda seed: [{"seed": seed}] + ([{"greedy": True, "seed": seed}] if greedy else []),
                                     self._step_seed)

    def restart_rollout_pool(self) -> None:
        """New replicas on a fresh rollout pool, the actor's current weights sent to them; the trainer's state (the
        actor, the optimizer, the step) is untouched; the batches in flight are drawn again."""
        name = self.plan.roles["rollout"].pool
        state = self.rollouts.loader_state()
        try:
            self.roles.pop("rollout").close()
        except Exception:  # noqa: BLE001 - its processes are dead or dying
            logger.debug("closing the dead rollout pool failed", exc_info=True)
        self.pools[name].shutdown()
        self.pools[name] = self._pool(name)  # on the same nodes as before
        self.loader.load_state_dict(state)
        self._start_rollout_pool()
        self.roles["rollout"].sync()  # the actor's weights now, not the model folder's

    def close(self) -> None:
        if self.agents is not None:  # the agent runs first: they call the roles (start() serves again)
            self.agents.close()
        # the rollout replicas first: they may wait on the actor's weights, never the other way round
        for role in sorted(self.roles.values(), key=lambda r: r is not self.roles.get("rollout")):
            try:
                role.close()
            except Exception:  # noqa: BLE001 - closing after a failure must not hide it
                logger.debug("closing a role failed", exc_info=True)
        for pool in getattr(self, "pools", {}).values():
            pool.shutdown()
        self.roles = {}

    # ---- one step --------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One RL step as named stages; which roles run and what they produce comes from the run plan's step
        needs (plan.step), never from the algorithm's name."""
        self.timer.start_step()
        step = self._rollout()
        if not self._score(step):
            self.timer.pop()
            self.step += 1
            return {"skipped": 1.0}
        self._evaluate(step)
        self._advantages(step)
        self._update(step)
        metrics = self._metrics(step)
        if self.rollouts is not None and self.step < self.cfg.trainer.steps:  # before the replicas' next batch
            metrics.update(self.rollouts.after_update())
        return metrics

    # ---- the stages --------------------------------------------------------------------------------------
    def _rollout(self) -> StepData:
        """Sample rollout.n responses per prompt (and ReMax's greedy baseline) with the current policy."""
        if self.rollouts is not None:
            with self.timer("generation"):  # the trainer's wait: the replicas work ahead of it
                prompts, seed, (out, *rest), metrics = self.rollouts.next(self.step)
            self.timer.add("agent", out.sequences.meta.get("timing", {}).get("agent", 0.0))
            return StepData(groups=len(prompts), seed=seed, out=out, greedy=rest[0] if rest else None,
                            metrics=metrics)
        prompts = self.loader.next_batch()
        seed = self._step_seed(self.step)
        # ReMax's greedy baseline shares the sampled responses' transition
        settings = [{"seed": seed}] + ([{"greedy": True, "seed": seed}] if self.plan.step.greedy_baseline else [])
        out, *rest = self._sample(prompts, settings)
        return StepData(groups=len(prompts), seed=seed, out=out, greedy=rest[0] if rest else None)

    def _step_seed(self, step: int) -> int:
        return self.cfg.trainer.seed * 100_003 + step

    def _sample(self, prompts: Any, settings: list[dict]) -> list[Any]:
        """One Rollout per sampling setting: single responses, episodes with rollout.env, or agent runs with
        rollout.agent (their requests served by the policy after self.step updates)."""
        actor, timer = self.roles.get("rollout", self.roles["actor"]), self.timer
        with timer("generation"):
            if self.agents is not None:
                outs = self.agents.run(actor, prompts, settings, version=self.step)
            elif self.episodes is not None:
                outs = self.episodes.run(actor, prompts, settings)
            else:
                outs = actor.generate_many(prompts, settings)
        timing = outs[0].sequences.meta.get("timing", {})
        timer.add("transition", timing.get("transition", 0.0))
        for stage in ("env", "agent"):  # inside "generation": the environments' or agents' share of it
            if stage in timing:
                timer.add(stage, timing[stage])
        return outs

    def _score(self, step: StepData) -> bool:
        """Rewards (and costs) of the responses; shaping and dynamic sampling. False: skip the step (NaN)."""
        n = self.cfg.rollout.n
        with self.timer("reward"):
            # every source of both batches is submitted before any is waited for: judges and reward models on
            # pools of their own score at once
            pending = [self.rewards.submit(r) for r in (step.out, step.greedy) if r is not None]
            sampled, *greedy = [p.result() for p in pending]
            step.scores = self._with_episode_rewards(step.out, sampled.total)
            step.metrics.update(sampled.metrics)
            keep = sampled.keep
            if greedy:  # a prompt group's baseline: its greedy rows' mean (agent runs may split into several)
                def per_row(values: torch.Tensor) -> torch.Tensor:
                    return group_baseline(values, step.greedy.sequences, step.out.sequences, step.groups, n)

                step.baseline = per_row(self._with_episode_rewards(step.greedy, greedy[0].total))
                # a group without its baseline leaves the update: a greedy verdict dropped, or a greedy agent run
                # that failed (no greedy row: group_baseline would give it 0)
                greedy_keep = greedy[0].keep if greedy[0].keep is not None else torch.ones(len(step.greedy),
                                                                                         dtype=torch.bool)
                kept = per_row(greedy_keep.float()) == 1.0
                keep = keep & kept if keep is not None else kept
            step.keep = keep if keep is not None and not bool(keep.all()) else None
            step.costs = self._scores_of("cost", step.out) if self.plan.step.cost else None
        if not self._finite_scores(step.scores, step.baseline, step.costs):
            return False
        step.out, step.scores, shaping = self._shape_and_filter(step.out, step.scores, step.seed)
        step.metrics.update(shaping)
        return True

    def _evaluate(self, step: StepData) -> None:
        """The passes over the batch the algorithm needs: reference, old log-probs, critic values."""
        roles, timer, out = self.roles, self.timer, step.out
        if "ref" in roles:
            with timer("reference"):
                step.ref_log_probs = roles["ref"].get_log_probs(out)
        elif self.plan.step.reference_from_actor:  # a LoRA actor's base model: its adapters off
            with timer("reference"):
                step.ref_log_probs = roles["actor"].reference_log_probs(out)
        # exactly on-policy, the update's own forward gives the old log-probs: see StepNeeds.old_log_probs
        if self.plan.step.old_log_probs:
            with timer("old_log_probs"):
                step.old_log_probs = roles["actor"].compute_log_probs(out)
        if "critic" in roles:
            with timer("critic"):
                step.values = roles["critic"].compute_values(out)
                if "cost_critic" in roles:
                    step.cost_values = roles["cost_critic"].compute_values(out)
        if "teacher" in roles:
            with timer("teacher"):
                step.teacher_log_probs = roles["teacher"].get_log_probs(out)

    def _advantages(self, step: StepData) -> None:
        """The algorithm's registered estimator on this batch (KL-penalised token rewards when the KL is a
        reward penalty), plus the distillation teacher's per-token term; dropped samples leave the update."""
        alg, mask = self.cfg.algorithm, step.out.mask
        step.kl_coef = self.kl_ctrl.value
        token_kl = None
        if step.ref_log_probs is not None and step.old_log_probs is not None and self.plan.step.kl_mode == "reward":
            token_kl = kl_penalty(step.old_log_probs, step.ref_log_probs, self.plan.loss.kl_estimator) * mask
        index = group_index(step.out.sequences, step.groups, self.cfg.rollout.n)
        scores = step.scores if step.keep is None else fill_dropped(step.scores, step.keep, index)
        step.result = compute_advantages(
            alg.name, scores, mask, kl=token_kl, kl_coef=step.kl_coef, index=index,
            baseline_scores=step.baseline, values=step.values, cost_scores=step.costs, cost_values=step.cost_values,
            lagrange_multiplier=self.lagrange.value if self.lagrange else None, gamma=alg.gamma, lam=alg.lam)
        if self.plan.distill is not None:
            distill = self.plan.distill
            step.result.advantages, metrics = distill_advantages(step.result.advantages, step.old_log_probs,
                                                                 step.teacher_log_probs, mask, distill.coef,
                                                                 distill.mode)
            step.metrics.update(metrics)
        if step.keep is not None:  # no loss, no tokens counted for the samples a judge dropped
            keep = step.keep.unsqueeze(1)
            step.result.advantages = step.result.advantages * keep
            step.out.sequences["response_mask"] = step.out.sequences["response_mask"] * keep

    def _update(self, step: StepData) -> None:
        """Critic(s), then the actor; then the KL controller and the Lagrange multiplier see this step."""
        alg, roles, timer, out, result = self.cfg.algorithm, self.roles, self.timer, step.out, step.result
        epochs, minis, metrics = self.plan.step.epochs, self.plan.step.mini_batches, step.metrics
        if "critic" in roles:
            with timer("critic"):
                critic_metrics = roles["critic"].update(out, result.returns, step.values, alg.value_clip, minis,
                                                        epochs)
                # every key under its role (the update's own grad_norm / update_ok / lr come unprefixed)
                metrics.update({f"critic/{k.removeprefix('critic/')}": v for k, v in critic_metrics.items()})
                if "cost_critic" in roles:
                    cost_metrics = roles["cost_critic"].update(out, result.cost_returns, step.cost_values,
                                                               alg.value_clip, minis, epochs)
                    metrics.update({f"cost_critic/{k.removeprefix('critic/')}": v for k, v in cost_metrics.items()})
        with timer("actor_update"):
            kl_loss = self.plan.step.kl_loss
            metrics.update({f"actor/{k}" if "/" not in k else k: v for k, v in roles["actor"].update(
                actions=out, advantages=result.advantages, old_log_probs=step.old_log_probs,
                ref_log_probs=step.ref_log_probs if kl_loss else None,
                kl_loss_coef=step.kl_coef if kl_loss else 0.0, mini_batches=minis, epochs=epochs).items()})
        # the KL the controller sees: trainer log-probs when computed, else the rollout's (same policy)
        policy_log_probs = step.old_log_probs if step.old_log_probs is not None else out.log_probs
        step.sequence_kl = float(((policy_log_probs - step.ref_log_probs) * out.mask).sum(-1).mean()) \
            if step.ref_log_probs is not None else 0.0
        self.kl_ctrl.update(step.sequence_kl, n_steps=len(out))
        if self.lagrange is not None:
            metrics["lagrange_multiplier"] = self.lagrange.value
            metrics["cost_mean"] = float(step.costs.mean())
            self.lagrange.update(float(step.costs.mean()))

    def _metrics(self, step: StepData) -> dict[str, float]:
        """The step's metrics and stage times; the step counter moves on."""
        out, scores, mask = step.out, step.scores, step.out.mask
        self.step += 1
        times = self.timer.pop()
        prompt_tokens = float(out.sequences["attention_mask"][:, :out.sequences["prompts"].shape[1]].sum())
        response_tokens = float(mask.sum())
        metrics = step.metrics
        row_steps = out.sequences.meta.get("decode_row_steps")
        if row_steps:  # the share of the rows the decode steps computed that sampled a real token
            metrics["rollout/decode_fill"] = response_tokens / row_steps
        metrics.update({
            "reward_mean": float(scores.mean()), "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
            "kl_mean": step.sequence_kl, "kl_coef": step.kl_coef,
            "advantage_mean": float(masked_mean(step.result.advantages, mask)),
            "response_length_mean": response_tokens / len(out), "prompt_length_mean": prompt_tokens / len(out),
            "tokens_per_s": (prompt_tokens + response_tokens) / max(times.get("time/step", 0.0), 1e-9),
            **({"baseline_reward_mean": float(step.baseline.mean())} if step.baseline is not None else {}),
            **episode_metrics(out.sequences), **agent_metrics(out.sequences), **times})
        self._check_finite(metrics)
        return metrics

    def _overlong(self, rollout: Any, scores: torch.Tensor) -> torch.Tensor:
        alg = self.cfg.algorithm
        if not alg.overlong_buffer:
            return scores
        # the tokens after the prompt against their budget: an episode's observations count (they fill it too)
        lengths = rollout.sequences["attention_mask"][:, rollout.sequences["prompts"].shape[1]:].sum(-1)
        penalty = alg.overlong_penalty if alg.overlong_penalty is not None else 1.0
        return scores + overlong_penalty(lengths, self.plan.response_length, alg.overlong_buffer, penalty)

    def _shape_and_filter(self, out: Any, scores: torch.Tensor, seed: int) -> tuple[Any, torch.Tensor, dict]:
        """DAPO's overlong shaping and dynamic sampling, when algorithm.overlong_buffer / max_refill_rounds ask."""
        alg, n, timer = self.cfg.algorithm, self.cfg.rollout.n, self.timer
        metrics: dict = {}
        if alg.overlong_buffer:
            shaped = self._overlong(out, scores)
            metrics["overlong/penalised_fraction"] = float((shaped < scores).float().mean())
            scores = shaped
        if alg.max_refill_rounds:
            actor = self.roles["actor"]

            def more(round_: int):
                extra, = self._sample(self.loader.next_batch(), [{"seed": seed + 7919 * round_}])
                with timer("reward"):
                    return extra, self._overlong(extra, self._rewards(extra))

            pad = actor.tokenizer.pad_token_id or 0
            out, scores, refill_metrics = refill(out, scores, n, alg.max_refill_rounds, more, pad)
            metrics.update(refill_metrics)
        return out, scores, metrics

    def _rewards(self, rollout: Any) -> torch.Tensor:
        """[B] rewards: an episode's (discounted turn rewards), plus the reward sources' weighted sum if any."""
        return self._with_episode_rewards(rollout, self.rewards.score(rollout).total)

    @staticmethod
    def _with_episode_rewards(rollout: Any, scored: torch.Tensor | None) -> torch.Tensor:
        episode = rollout.sequences.non_tensors.get("episode_rewards")
        scores = None if episode is None else torch.tensor(episode.astype(float), dtype=torch.float32)
        return scored if scores is None else scores if scored is None else scores + scored

    def _scores_of(self, role: str, rollout: Any) -> torch.Tensor:
        # the rollout carries its prompts (one per response): a reward model reuses the token ids when it
        # shares the actor's tokenizer, else re-tokenizes prompt + response text with its own
        return self.roles[role].score(rollout.prompt_texts, rollout).float()

    def _finite_scores(self, *scores: torch.Tensor | None) -> bool:
        """False (skip the step) when a reward / cost is NaN or inf and trainer.on_nan=skip; raises on stop."""
        if all(s is None or bool(torch.isfinite(s).all()) for s in scores):
            return True
        message = f"step {self.step + 1}: non-finite rewards or costs"
        if self.cfg.trainer.on_nan == "stop":
            raise NonFiniteError(message + " (trainer.on_nan=stop; set trainer.on_nan=skip to skip such steps)")
        logger.warning("%s: step skipped, no update (trainer.on_nan=skip)", message)
        return False

    def _check_finite(self, metrics: dict[str, float]) -> None:
        bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
        if "actor/update_ok" in metrics and metrics["actor/update_ok"] < 1:
            bad.append("actor gradients")
        if bad:
            message = f"step {self.step + 1}: non-finite values in {bad}"
            if self.cfg.trainer.on_nan == "stop":
                raise NonFiniteError(message + " (trainer.on_nan=stop; set trainer.on_nan=skip to skip such steps)")
            logger.warning("%s: update skipped (trainer.on_nan=skip)", message)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def driver_state(self) -> dict[str, Any]:
        """Everything on the driver that the next steps depend on."""
        loader = self.rollouts.loader_state() if self.rollouts is not None else self.loader.state_dict()
        return {"step": self.step, "algorithm": self.cfg.algorithm.name, "loader": loader,
                "kl_ctrl": self.kl_ctrl.state_dict(),
                "lagrange": self.lagrange.state_dict() if self.lagrange is not None else None,
                "actor_sampling_seed": self.roles["actor"].sampling_seed if "actor" in self.roles else None,
                "rng": rng_states()}

    def load_driver_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        if self.rollouts is not None:  # batches in flight were drawn after the saved position: generate them again
            self.rollouts.discard()
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.lagrange is not None and state.get("lagrange") is not None:
            self.lagrange.load_state_dict(state["lagrange"])
        if state.get("actor_sampling_seed") is not None and "actor" in self.roles:
            self.roles["actor"].sampling_seed = state["actor_sampling_seed"]
        set_rng_states(state["rng"])

    def save_checkpoint(self, checkpoints: CheckpointManager) -> Path:
        """Write RUN/ckpt/step_N atomically (see trainer/checkpoint.py); the driver state goes in last."""
        tmp = checkpoints.begin(self.step)
        try:
            for role in TRAINED_ROLES:
                if role in self.roles:
                    self.roles[role].save_checkpoint(str(tmp / role))
            save_driver_state(tmp, self.driver_state())
        except Interrupted:  # the workers may still be writing into tmp: it is discarded once they are gone
            raise
        except BaseException as exc:
            full = checkpoints.out_of_space(exc, self.step)  # judged before the partial save frees its space
            shutil.rmtree(tmp, ignore_errors=True)
            if full is not None:
                raise full from exc
            raise
        return checkpoints.commit(tmp, self.step)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore the trained roles (at their current layouts) and the driver state from a checkpoint."""
        path = Path(path)
        state = load_driver_state(path)
        if state.get("algorithm") != self.cfg.algorithm.name:
            raise CheckpointError(f"{path} was saved by algorithm {state.get('algorithm')!r}, this run is "
                                  f"{self.cfg.algorithm.name!r}; resume with the same algorithm.name")
        missing = [role for role in TRAINED_ROLES if role in self.roles and not (path / role).is_dir()]
        if missing:
            raise CheckpointError(f"{path} holds no {missing} state; it was saved by a run without those roles")
        for role in TRAINED_ROLES:
            if role in self.roles:
                self.roles[role].load_checkpoint(str(path / role))
        if "rollout" in self.roles:  # the replicas hold the model folder's weights: send the checkpoint's
            self.roles["rollout"].sync()
        self.load_driver_state(state)
        logger.info("resumed from %s at step %d", path, self.step)
