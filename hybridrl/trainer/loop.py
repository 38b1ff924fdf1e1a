"""The RL loop the CLI runs: one driver, plain serial Python over the role objects of hybridrl.api.

One step, for every algorithm, is five named stages (RLTrainer.train_step):
  _rollout     prompts -> actor.generate_many (hybrid engine transition + rollout) [+ greedy baseline], or
               multi-turn episodes with rollout.env (rollout/multiturn.py), or the rollout pool's replicas
               (rollout.pool apart from the actor's; trainer.mode sync / one_step_off / async: async_rollout.py)
  _score       rewards (the episodes', rule function or reward model) [+ costs]; overlong shaping, dynamic sampling
  _evaluate    reference log-probs, old log-probs (skipped when the update is exactly on-policy), values
  _advantages  the algorithm's registered estimator (algorithms/catalog/), KL as a reward penalty or a loss
  _update      critic update(s) -> actor update -> KL controller / Lagrange multiplier
then _metrics. What runs is decided by the algorithm's registry entry, never by its name.
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
from hybridrl.algorithms.kl_control import build_kl_controller
from hybridrl.algorithms.lagrangian import LagrangeMultiplier
from hybridrl.algorithms.losses import kl_penalty, masked_mean
from hybridrl.algorithms.shaping import overlong_penalty
from hybridrl.config import ConfigError
from hybridrl.controller.interrupts import Interrupted
from hybridrl.rollout.multiturn import episode_metrics
from hybridrl.trainer.dynamic_sampling import refill
from hybridrl.trainer.checkpoint import (CheckpointManager, load_driver_state, rng_states, save_driver_state,
                                         set_rng_states)
from hybridrl.trainer.plan import RunPlan
from hybridrl.trainer.timers import StageTimer

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """A step produced NaN/inf (loss, gradients or rewards) and trainer.on_nan=stop."""


class RestartsExhaustedError(RuntimeError):
    """A worker died and trainer.max_restarts recoveries were already used."""


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
    ref_log_probs: torch.Tensor | None = None
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
        from hybridrl.api import _tokenizer_for
        from hybridrl.data.dataset import prompt_dataset_from_config
        from hybridrl.data.loader import StatefulPromptLoader

        self.cfg, self.plan = cfg, plan
        alg = cfg.algorithm
        self.tokenizer = _tokenizer_for(plan.roles["actor"].model_path)
        try:
            dataset = prompt_dataset_from_config(cfg.data, self.tokenizer)
            self.loader = StatefulPromptLoader(dataset, cfg.data.batch_size, self.tokenizer.pad_token_id or 0,
                                               seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        except (ValueError, KeyError, FileNotFoundError) as exc:
            raise ConfigError(f"data: {exc.args[0] if isinstance(exc, KeyError) else exc}") from None
        kl = dict(alg.kl)
        self.kl_ctrl = build_kl_controller(**kl, total_steps=cfg.trainer.steps)
        self.kl_mode, self.kl_estimator = kl["mode"], kl["estimator"]
        self.lagrange = LagrangeMultiplier(alg.lagrangian_init, alg.lagrangian_lr, alg.cost_limit) \
            if plan.algorithm.needs_cost_model else None
        self.step = 0
        self.roles: dict[str, Any] = {}
        self.timer = StageTimer()
        self.episodes = self._episode_runner() if cfg.rollout.env else None
        self.rollouts = None  # RolloutQueue when generation has a pool of its own

    def _episode_runner(self) -> Any:
        from hybridrl.rollout.multiturn import EpisodeLimits, EpisodeRunner

        r = self.cfg.rollout
        limits = EpisodeLimits(r.max_turns, r.max_new_tokens, self.plan.response_length,
                               self.cfg.data.max_prompt_length, r.turn_discount)
        return EpisodeRunner(r.env, dict(r.env_kwargs), self.tokenizer, self.cfg.data.chat_template, limits)

    # ---- roles -----------------------------------------------------------------------------------------
    def start_ray(self) -> None:
        """Start Ray (local unless resources.ray_address), or reuse the one this driver runs."""
        from hybridrl.controller import ensure_ray

        ensure_ray(num_devices=sum(self.plan.pools.values()), address=self.cfg.resources.ray_address)

    def start(self) -> None:
        """Start Ray and every role on its pool."""
        from hybridrl.api import Actor, Critic, ReferencePolicy, RewardModel
        from hybridrl.controller import ResourcePool

        cfg, plan = self.cfg, self.plan
        self.start_ray()
        self.pools = {name: ResourcePool(devices=n, nodes=cfg.resources.nodes, name=name) for name, n in plan.pools.items()}
        seed = cfg.trainer.seed
        timeout = cfg.trainer.call_timeout_s

        def parallel(role: str) -> dict | None:
            layout = plan.roles[role].layout
            return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "sequence_parallel": layout.sequence_parallel,
                    "ep": layout.ep, "expert_tp": layout.etp}

        def pool(role: str):
            return self.pools[plan.roles[role].pool]

        a, r = cfg.actor, cfg.rollout
        rollout = {"engine": plan.rollout_engine, "tp": r.tp, "ep": r.ep, "reshard": r.reshard, "bucket_mb": r.bucket_mb,
                   "max_model_len": plan.max_model_len,
                   "max_batch_size": r.max_batch_size, "n": r.n, "temperature": r.temperature, "top_p": r.top_p,
                   "top_k": r.top_k, "max_new_tokens": r.max_new_tokens, "ignore_eos": r.ignore_eos,
                   "routing": "replay" if r.routing_replay else "measure" if r.record_routing else "off"}
        loss = {"clip_ratio": cfg.algorithm.clip_ratio, "entropy_coef": cfg.algorithm.entropy_coef,
                "kl_estimator": self.kl_estimator, "rollout_correction": cfg.algorithm.rollout_correction,
                "rollout_correction_cap": cfg.algorithm.rollout_correction_cap,
                "rollout_correction_level": cfg.algorithm.rollout_correction_level,
                "loss_agg": plan.loss_agg, "loss_agg_length": plan.response_length,
                "module": cfg.algorithm.module,  # the actor's workers import it to find a user's policy loss
                "policy_loss": plan.algorithm.policy_loss, "clip_ratio_high": cfg.algorithm.clip_ratio_high}
        self.roles["actor"] = Actor(plan.roles["actor"].model_path, parallel("actor"), rollout, pool("actor"),
                                    optim=dict(a.optim), loss=loss, micro_batch_size=a.micro_batch_size,
                                    max_tokens_per_micro_batch=a.max_tokens_per_micro_batch,
                                    dtype=a.model.dtype, tokenizer=self.tokenizer, seed=seed, call_timeout_s=timeout,
                                    moe=dict(a.moe))
        if "ref" in plan.roles:
            self.roles["ref"] = ReferencePolicy(plan.roles["ref"].model_path, pool("ref"), parallel("ref"),
                                                cfg.ref.micro_batch_size, cfg.ref.max_tokens_per_micro_batch,
                                                cfg.ref.model.dtype, seed, call_timeout_s=timeout)
        for role in ("critic", "cost_critic"):
            if role in plan.roles:
                c = cfg.critic
                self.roles[role] = Critic(plan.roles[role].model_path, pool(role), parallel(role), dict(c.optim),
                                          c.micro_batch_size, c.max_tokens_per_micro_batch, c.model.dtype, seed,
                                          role=role, call_timeout_s=timeout)
        scorers = (("reward", plan.reward_fn, cfg.reward_model), ("cost", plan.cost_fn, cfg.cost_model))
        for role, fn, section in scorers:
            if role in plan.roles:
                self.roles[role] = RewardModel(model=plan.roles[role].model_path, resource_pool=pool(role),
                                               parallel=parallel(role), micro_batch_size=section.micro_batch_size,
                                               max_tokens_per_micro_batch=section.max_tokens_per_micro_batch,
                                               dtype=section.dtype, tokenizer=section.tokenizer,
                                               chat_template=section.chat_template, seed=seed, role=role,
                                               call_timeout_s=timeout)
            elif fn:
                self.roles[role] = RewardModel(fn=fn, num_workers=cfg.reward.num_workers)
        if "rollout" in plan.roles:
            self._start_rollout_pool()

    def _start_rollout_pool(self) -> None:
        """Generation replicas on rollout.pool, fed shard to shard by the actor, and the queue ahead of training."""
        from hybridrl.api import RolloutReplicas
        from hybridrl.trainer.async_rollout import RolloutQueue

        cfg, plan = self.cfg, self.plan
        self.roles["rollout"] = RolloutReplicas(self.roles["actor"], self.pools[plan.roles["rollout"].pool],
                                                tp=cfg.rollout.tp, engine=plan.rollout_engine,
                                                max_batch_size=cfg.rollout.max_batch_size,
                                                seed=cfg.trainer.seed, call_timeout_s=cfg.trainer.call_timeout_s,
                                                partial=cfg.rollout.partial, ep=cfg.rollout.ep)
        greedy = plan.algorithm.needs_greedy_baseline
        self.rollouts = RolloutQueue(self.roles["rollout"], self.loader, plan.rollout_ahead,
                                     cfg.algorithm.max_staleness,
                                     lambda seed: [{"seed": seed}] + ([{"greedy": True, "seed": seed}] if greedy else []),
                                     self._step_seed)

    def _restart_rollout_pool(self) -> None:
        """New replicas on a fresh rollout pool, the actor's current weights sent to them; the trainer's state (the
        actor, the optimizer, the step) is untouched; the batches in flight are drawn again."""
        from hybridrl.controller import ResourcePool

        name = self.plan.roles["rollout"].pool
        state = self.rollouts.loader_state()
        try:
            self.roles.pop("rollout").close()
        except Exception:  # noqa: BLE001 - its processes are dead or dying
            logger.debug("closing the dead rollout pool failed", exc_info=True)
        self.pools[name].shutdown()
        self.pools[name] = ResourcePool(devices=self.plan.pools[name], nodes=self.cfg.resources.nodes, name=name)
        self.loader.load_state_dict(state)
        self._start_rollout_pool()
        self.roles["rollout"].sync()  # the actor's weights now, not the model folder's

    def close(self) -> None:
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
        """One RL step as named stages; which roles run and what they produce comes from the algorithm's
        registry entry (plan.algorithm), never from its name."""
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
        spec = self.plan.algorithm
        if self.rollouts is not None:
            with self.timer("generation"):  # the trainer's wait: the replicas work ahead of it
                prompts, seed, (out, *rest), metrics = self.rollouts.next(self.step)
            return StepData(groups=len(prompts), seed=seed, out=out, greedy=rest[0] if rest else None,
                            metrics=metrics)
        prompts = self.loader.next_batch()
        seed = self._step_seed(self.step)
        # ReMax's greedy baseline shares the sampled responses' transition
        settings = [{"seed": seed}] + ([{"greedy": True, "seed": seed}] if spec.needs_greedy_baseline else [])
        out, *rest = self._sample(prompts, settings)
        return StepData(groups=len(prompts), seed=seed, out=out, greedy=rest[0] if rest else None)

    def _step_seed(self, step: int) -> int:
        return self.cfg.trainer.seed * 100_003 + step

    def _sample(self, prompts: Any, settings: list[dict]) -> list[Any]:
        """One Rollout per sampling setting: single responses, or episodes with rollout.env."""
        actor, timer = self.roles.get("rollout", self.roles["actor"]), self.timer
        with timer("generation"):
            outs = actor.generate_many(prompts, settings) if self.episodes is None else \
                self.episodes.run(actor, prompts, settings)
        timing = outs[0].sequences.meta.get("timing", {})
        timer.add("transition", timing.get("transition", 0.0))
        if "env" in timing:  # inside "generation": the environments' share of it
            timer.add("env", timing["env"])
        return outs

    def _score(self, step: StepData) -> bool:
        """Rewards (and costs) of the responses; shaping and dynamic sampling. False: skip the step (NaN)."""
        n, spec = self.cfg.rollout.n, self.plan.algorithm
        with self.timer("reward"):
            step.scores = self._rewards(step.out)
            if step.greedy is not None:
                step.baseline = self._rewards(step.greedy).repeat_interleave(n)
            step.costs = self._scores_of("cost", step.out) if spec.needs_cost_model else None
        if not self._finite_scores(step.scores, step.baseline, step.costs):
            return False
        step.out, step.scores, shaping = self._shape_and_filter(step.out, step.scores, step.seed)
        step.metrics.update(shaping)
        return True

    def _evaluate(self, step: StepData) -> None:
        """The passes over the batch the algorithm needs: reference, old log-probs, critic values."""
        alg, roles, timer, out = self.cfg.algorithm, self.roles, self.timer, step.out
        if "ref" in roles:
            with timer("reference"):
                step.ref_log_probs = roles["ref"].get_log_probs(out)
        # One update over the whole batch is exactly on-policy: the update's own forward gives the old
        # log-probs (detached), so a separate pass is only needed for a KL penalty in the reward.
        on_policy = alg.ppo_epochs == 1 and self.plan.mini_batches == 1
        if not on_policy or (step.ref_log_probs is not None and self.kl_mode == "reward"):
            with timer("old_log_probs"):
                step.old_log_probs = roles["actor"].compute_log_probs(out)
        if "critic" in roles:
            with timer("critic"):
                step.values = roles["critic"].compute_values(out)
                if "cost_critic" in roles:
                    step.cost_values = roles["cost_critic"].compute_values(out)

    def _advantages(self, step: StepData) -> None:
        """The algorithm's registered estimator on this batch (KL-penalised token rewards when the KL is a
        reward penalty)."""
        alg, mask = self.cfg.algorithm, step.out.mask
        step.kl_coef = self.kl_ctrl.value
        token_kl = None
        if step.ref_log_probs is not None and step.old_log_probs is not None and self.kl_mode == "reward":
            token_kl = kl_penalty(step.old_log_probs, step.ref_log_probs, self.kl_estimator) * mask
        index = torch.arange(step.groups).repeat_interleave(self.cfg.rollout.n)
        step.result = compute_advantages(
            alg.name, step.scores, mask, kl=token_kl, kl_coef=step.kl_coef, index=index,
            baseline_scores=step.baseline, values=step.values, cost_scores=step.costs, cost_values=step.cost_values,
            lagrange_multiplier=self.lagrange.value if self.lagrange else None, gamma=alg.gamma, lam=alg.lam)

    def _update(self, step: StepData) -> None:
        """Critic(s), then the actor; then the KL controller and the Lagrange multiplier see this step."""
        alg, roles, timer, out, result = self.cfg.algorithm, self.roles, self.timer, step.out, step.result
        epochs, minis, metrics = alg.ppo_epochs, self.plan.mini_batches, step.metrics
        if "critic" in roles:
            with timer("critic"):
                metrics.update(roles["critic"].update(out, result.returns, step.values, alg.value_clip, minis, epochs))
                if "cost_critic" in roles:
                    cost_metrics = roles["cost_critic"].update(out, result.cost_returns, step.cost_values,
                                                               alg.value_clip, minis, epochs)
                    metrics.update({k.replace("critic/", "cost_critic/"): v for k, v in cost_metrics.items()})
        with timer("actor_update"):
            kl_loss = self.kl_mode == "loss" and step.ref_log_probs is not None
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
        metrics.update({
            "reward_mean": float(scores.mean()), "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
            "kl_mean": step.sequence_kl, "kl_coef": step.kl_coef,
            "advantage_mean": float(masked_mean(step.result.advantages, mask)),
            "response_length_mean": response_tokens / len(out), "prompt_length_mean": prompt_tokens / len(out),
            "tokens_per_s": (prompt_tokens + response_tokens) / max(times.get("time/step", 0.0), 1e-9),
            **({"baseline_reward_mean": float(step.baseline.mean())} if step.baseline is not None else {}),
            **episode_metrics(out.sequences), **times})
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
        """[B] rewards: an episode's (discounted turn rewards), plus the reward function's / model's if any."""
        episode = rollout.sequences.non_tensors.get("episode_rewards")
        scores = None if episode is None else torch.tensor(episode.astype(float), dtype=torch.float32)
        if "reward" in self.roles:
            scored = self._scores_of("reward", rollout)
            scores = scored if scores is None else scores + scored
        return scores

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
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return checkpoints.commit(tmp, self.step)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore the trained roles (at their current layouts) and the driver state from a checkpoint."""
        from hybridrl.models.config import CheckpointError

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

    # ---- the run -----------------------------------------------------------------------------------------
    def fit(self, tracker: Any, checkpoints: CheckpointManager | None = None) -> list[dict[str, float]]:
        history = []
        save_every = self.cfg.trainer.save_every
        skipped_in_a_row = 0
        while self.step < self.cfg.trainer.steps:
            metrics = self.train_step()
            skipped_in_a_row = 0 if step_was_finite(metrics) else skipped_in_a_row + 1
            tracker.log(self.step, metrics)
            if self.cfg.trainer.log_every and self.step % self.cfg.trainer.log_every == 0:
                line = tracker.show(self.step, metrics) if self.cfg.trainer.progress_bar else \
                    tracker.console_line(self.step, metrics)
                if not self.cfg.trainer.progress_bar:
                    print(line, flush=True)
            history.append(metrics)
            if checkpoints is not None and save_every and self.step % save_every == 0:
                if step_was_finite(metrics):
                    self.save_checkpoint(checkpoints)
                else:  # a poisoned step: keep the previous checkpoint as the one to come back to
                    logger.warning("step %d was not finite: no checkpoint written for it", self.step)
            if skipped_in_a_row >= self.cfg.trainer.max_skipped_steps:  # nothing is being learned any more
                raise NonFiniteError(f"{skipped_in_a_row} steps in a row (up to step {self.step}) were not finite "
                                     f"and skipped (trainer.max_skipped_steps={self.cfg.trainer.max_skipped_steps}); "
                                     f"check the reward function and lower actor.optim.lr")
        return history

    def run(self, tracker: Any, run_dir: str | Path, resume_from: str | Path | None = None) -> list[dict[str, float]]:
        """Start the roles, resume from `resume_from`, train to trainer.steps with checkpoints every
        trainer.save_every steps, and recover from dead workers (tear down, restart, reload the latest
        checkpoint) up to trainer.max_restarts times. The caller closes the trainer."""
        from hybridrl.controller.watchdog import WATCHDOG

        WATCHDOG.configure(self.cfg.trainer.hang_timeout_s, run_dir)
        try:
            return self._run_with_restarts(tracker, run_dir, resume_from)
        finally:
            WATCHDOG.configure(None, None)

    def _run_with_restarts(self, tracker: Any, run_dir: str | Path, resume_from: str | Path | None) -> list[dict]:
        from hybridrl.controller import WorkerDiedError, WorkerHungError

        tr = self.cfg.trainer
        checkpoints = CheckpointManager(run_dir, tr.keep_last)
        self.start()
        initial = self.driver_state()
        if resume_from is not None:
            self.load_checkpoint(resume_from)
            tracker.truncate_after(self.step)
            checkpoints.discard_after(self.step)
        restarts = 0
        while True:
            try:
                return self.fit(tracker, checkpoints)
            except WorkerDiedError as exc:  # WorkerHungError too: the watchdog stopped a call without progress
                restarts += 1
                what = "hung" if isinstance(exc, WorkerHungError) else "died"
                if restarts <= tr.max_restarts and exc.role == "rollout" and self.rollouts is not None:
                    logger.warning("rollout pool worker %s during step %d (rank %s: %s); restart %d/%d of the rollout "
                                   "pool only, from the actor's current weights", what, self.step + 1, exc.rank,
                                   exc.cause, restarts, tr.max_restarts)
                    self._restart_rollout_pool()
                    continue
                if restarts > tr.max_restarts:
                    raise RestartsExhaustedError(
                        f"a worker {what} at step {self.step + 1} ({exc.role} rank {exc.rank}: {exc.cause}) and "
                        f"trainer.max_restarts={tr.max_restarts} restart(s) are used up; raise trainer.max_restarts "
                        f"or resume later with trainer.resume=auto") from exc
                logger.warning("worker %s during step %d (%s rank %s: %s); restart %d/%d from the last checkpoint",
                               what, self.step + 1, exc.role, exc.rank, exc.cause, restarts, tr.max_restarts)
                self.close()
                self.start()
                latest = checkpoints.latest()
                if latest is not None:
                    self.load_checkpoint(latest)
                else:  # nothing saved yet: the fresh roles hold the initial weights; rewind the driver too
                    self.load_driver_state(initial)
                tracker.truncate_after(self.step)


def step_was_finite(metrics: dict[str, float]) -> bool:
    """False for a skipped step or one with NaN/inf metrics or a skipped optimizer step: never checkpointed."""
    if metrics.get("skipped"):
        return False
    if metrics.get("actor/update_ok", 1.0) < 1:
        return False
    return all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


def run_dir_for(cfg: Any) -> Path:
    from hybridrl.trainer.tracking import new_run_dir

    return new_run_dir(cfg.trainer.run_dir, cfg.algorithm.name)
