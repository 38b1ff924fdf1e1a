"""The short API: RL roles as plain Python objects, so a new algorithm is a few lines of driver code.

    pool = hybridrl.ResourcePool(devices=4)
    actor = hybridrl.Actor(model=PATH, parallel={"tp": 2, "pp": 1}, rollout={"tp": 1}, resource_pool=pool)
    ref_policy = hybridrl.ReferencePolicy(model=PATH, resource_pool=pool)
    reward_model = hybridrl.RewardModel(fn=my_reward)          # or model=RM_PATH, resource_pool=pool
    out = actor.generate_sequences(prompts)                    # Rollout: .sequences .texts .log_probs .mask
    ...
    actor.update(states=prompts, actions=out.sequences, advantages=advantages)

Each role is a WorkerGroup of Megatron-backed workers (workers/) on a ResourcePool; roles on one pool
colocate (share processes, devices and layout). The trainer (trainer/loop.py) drives these same objects.
Ray is started locally on first use when no cluster is running (enough fake devices for the pool).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from hybridrl.controller import ResourcePool, WorkerGroup, ensure_ray
from hybridrl.parallel.layout import ParallelLayout
from hybridrl.protocol import Batch
from hybridrl.rollout.base import concat_batches

logger = logging.getLogger(__name__)

SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "ignore_eos")
# Micro-batches pack sequences up to this many tokens (None: micro_batch_size sequences, one per row).
DEFAULT_MAX_TOKENS_PER_MICRO_BATCH = 8192
ROLLOUT_ENGINE_KEYS = ("engine", "tp", "ep", "reshard", "bucket_mb", "max_model_len", "max_batch_size", "options",
                       "routing")


def _model_path(model: str | None) -> str:
    from hybridrl.models.tiny import resolve_model_path

    return resolve_model_path(model)


def _tokenizer_for(model_path: str, tokenizer: Any = None):
    from pathlib import Path

    from hybridrl.data.tokenizer import load_tokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if (Path(model_path) / "tokenizer_config.json").is_file() or (Path(model_path) / "tokenizer.json").is_file():
        return load_tokenizer(model_path)
    return load_tokenizer(None)


def _layout_on(pool: ResourcePool, parallel: dict | None) -> ParallelLayout:
    """The role's layout: explicit tp/pp (dp fills the pool), else the layout the pool already holds."""
    held = pool._hosts.layout if pool._hosts is not None else None
    if parallel is None:
        return held or ParallelLayout(dp=pool.world_size)
    tp, pp = int(parallel.get("tp", 1)), int(parallel.get("pp", 1))
    if pool.world_size % (tp * pp):
        raise ValueError(f"parallel tp={tp} x pp={pp} does not divide the pool's {pool.world_size} devices")
    dp = parallel.get("dp") or pool.world_size // (tp * pp)
    return ParallelLayout(tp=tp, pp=pp, dp=int(dp), sequence_parallel=bool(parallel.get("sequence_parallel", False)),
                          ep=int(parallel.get("ep", 1)),
                          etp=int(parallel["expert_tp"]) if parallel.get("expert_tp") is not None else None)


def _start(pool: ResourcePool | None, ray_address: str | None = None) -> ResourcePool:
    pool = pool or ResourcePool(devices=1)
    ensure_ray(num_devices=None if _ray_running() else pool.world_size, address=ray_address)
    return pool


def _ray_running() -> bool:
    import ray

    return ray.is_initialized()


@dataclass
class Rollout:
    """Generated sequences: the Batch the rollout engine returned, plus decoded texts.

    sequences: Batch with prompts / responses / input_ids / attention_mask / response_mask /
               rollout_log_probs (see rollout/base.py); prompt-major when n > 1.
    prompt_texts, metadata: one per response (a prompt's are repeated n times).
    tokenizer: the actor's, which made the token ids (a reward model reuses them when it shares it).

    Per-token tensors ([B, R], e.g. log_probs) are right-padded to the batch's longest response R and are 0 on
    padding. So `x.mean(dim=-1)` is each row's SUM over its own tokens divided by the same R for every row:
    the sequence total scaled by 1/R, not a per-token mean (short responses count less). `masked_mean(x)`
    divides by each response's own length instead; `(x * mask).sum(-1)` is the sequence total.
    """

    sequences: Batch
    texts: list[str]
    prompt_texts: list[str]
    metadata: list[dict]
    tokenizer: Any = None

    @property
    def log_probs(self) -> torch.Tensor:
        """[B, R] log-prob of each sampled token under the sampling distribution (0 on padding)."""
        return self.sequences["rollout_log_probs"]

    @property
    def mask(self) -> torch.Tensor:
        """[B, R] 1.0 on generated tokens."""
        return self.sequences["response_mask"].float()

    def masked_mean(self, x: torch.Tensor) -> torch.Tensor:
        """[B]: the mean of x [B, R] over each response's own tokens (padding excluded)."""
        mask = self.mask
        if x.shape != mask.shape:
            raise ValueError(f"masked_mean: x of shape {tuple(x.shape)} is not per response token {tuple(mask.shape)}")
        return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)

    @property
    def finish_reasons(self) -> list[str]:
        return list(self.sequences.non_tensors["finish_reasons"])

    def __len__(self) -> int:
        return len(self.sequences)


def _as_sequences(actions: Any) -> Batch:
    if isinstance(actions, Rollout):
        return actions.sequences
    if isinstance(actions, Batch):
        return actions
    raise TypeError(f"pass the sequences as the Rollout (or its .sequences Batch) from generate_sequences, "
                    f"got {type(actions).__name__}")


class _Role:
    """A WorkerGroup of one worker class on a pool, with Ray started on demand."""

    def __init__(self, worker_cls: type, role: str, resource_pool: ResourcePool | None, parallel: dict | None,
                 init_kwargs: dict, seed: int, call_timeout_s: float | None) -> None:
        self.pool = _start(resource_pool)
        self.layout = _layout_on(self.pool, parallel)
        self.group = WorkerGroup(self.pool, worker_cls, layout=self.layout, role=role, init_kwargs=init_kwargs,
                                 seed=seed, call_timeout_s=call_timeout_s)

    def close(self) -> None:
        self.group.close()


class Actor(_Role):
    """The policy: trains in `parallel` (tp, pp; dp fills the pool), generates in `rollout` (tp) through the
    3D-HybridEngine.

    rollout: engine (native | vllm), tp, reshard (hybrid | ds_chat | hybridflow_v), bucket_mb, max_model_len, routing
    (mixture-of-experts: off | measure | replay, models/routing_replay.py), and the default sampling (n, temperature, top_p, top_k, max_new_tokens). optim: lr, weight_decay, betas,
    clip_grad, warmup_steps, use_distributed_optimizer. loss: clip_ratio, entropy_coef, kl_loss_coef,
    kl_estimator (PolicyLossConfig). moe (models with experts): aux_loss_coef, z_loss_coef of the routers.
    """

    def __init__(self, model: str | None = None, parallel: dict | None = None, rollout: dict | None = None,
                 resource_pool: ResourcePool | None = None, optim: dict | None = None, loss: dict | None = None,
                 micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
                 dtype: str = "float32", tokenizer: Any = None, seed: int = 1,
                 role: str = "actor", call_timeout_s: float | None = 3600.0, moe: dict | None = None) -> None:
        from hybridrl.workers.actor import ActorWorker

        path = _model_path(model)
        self.tokenizer = _tokenizer_for(path, tokenizer)
        rollout = dict(rollout or {})
        unknown = set(rollout) - set(SAMPLING_KEYS) - set(ROLLOUT_ENGINE_KEYS)
        if unknown:
            raise ValueError(f"Actor(rollout=...): unknown keys {sorted(unknown)}; known: "
                             f"{sorted(SAMPLING_KEYS + ROLLOUT_ENGINE_KEYS)}")
        self.sampling = {k: rollout[k] for k in SAMPLING_KEYS if k in rollout}
        engine_spec = {k: rollout[k] for k in ROLLOUT_ENGINE_KEYS if k in rollout}
        engine_spec["pad_token_id"] = self.tokenizer.pad_token_id or 0
        engine_spec["stop_token_ids"] = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        self.loss = dict(loss or {})
        self.model_path, self.dtype, self.engine_spec = path, dtype, engine_spec
        model_spec = {"path": path, "dtype": dtype, "micro_batch_size": micro_batch_size,
                      "max_tokens_per_micro_batch": max_tokens_per_micro_batch, "optim": dict(optim or {}),
                      "moe": dict(moe or {})}
        super().__init__(ActorWorker, role, resource_pool, parallel,
                         {"model": model_spec, "rollout": engine_spec, "seed": seed}, seed, call_timeout_s)
        self._step_seed = seed * 1_000_003

    # ---- prompts ---------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: Any) -> tuple[Batch, list[str], list[dict]]:
        """Prompts as a left-padded Batch: strings (tokenised), token-id lists, a PromptBatch or a Batch."""
        return encode_prompts(self.tokenizer, prompts)

    def decode_responses(self, sequences: Batch) -> list[str]:
        responses, mask = sequences["responses"], sequences["response_mask"].bool()
        return self.tokenizer.batch_decode([r[m].tolist() for r, m in zip(responses, mask)], skip_special_tokens=True)

    # ---- the role's calls --------------------------------------------------------------------------------
    def generate_sequences(self, prompts: Any, greedy: bool = False, seed: int | None = None,
                           **sampling: Any) -> Rollout:
        """Sample responses (n per prompt, prompt-major). greedy=True: the argmax response (ReMax baseline)."""
        return self.generate_many(prompts, [{"greedy": greedy, "seed": seed, **sampling}])[0]

    def generate_many(self, prompts: Any, settings: list[dict]) -> list[Rollout]:
        """Several sampling settings for the same prompts inside ONE training -> generation transition
        (ReMax's sampled and greedy responses cost one reshard, not two). Each setting: greedy, seed and
        SamplingParams fields overriding the actor's rollout defaults."""
        batch, texts, metadata = self.encode_prompts(prompts)
        all_params = [self.sampling_params(setting) for setting in settings]
        results = self.group.generate_sequences(batch, all_params)
        rollouts = []
        for i, params in enumerate(all_params):
            per_replica = [None if r is None else (r[0], r[1][i]) for r in results]
            sequences = merge_replicas(per_replica, self.tokenizer.pad_token_id or 0)
            sequences.meta["timing"] = _max_timing(per_replica)
            n = int(params.get("n", 1))
            rollouts.append(Rollout(sequences, self.decode_responses(sequences), [t for t in texts for _ in range(n)],
                                    [m for m in metadata for _ in range(n)], self.tokenizer))
        return rollouts

    def sampling_params(self, setting: dict) -> dict:
        """The actor's rollout defaults overridden by a setting (greedy, seed, SamplingParams fields); a seed
        is drawn from the actor's counter when the setting has none."""
        params = {**self.sampling, **{k: v for k, v in setting.items() if k not in ("greedy", "seed")}}
        if setting.get("greedy"):
            params.update(greedy=True, n=1)
        seed = setting.get("seed")
        if seed is None:
            self._step_seed += 1
            seed = self._step_seed
        params["seed"] = seed
        return params

    @contextmanager
    def generation(self) -> Iterator[dict[str, float]]:
        """Hold the generation layout over several `generate_turn` calls (one transition there and one back,
        however many turns); yields a dict whose "transition" holds the seconds both took, once it exits."""
        timing = {"transition": max(self.group.begin_generation())}
        try:
            yield timing
        finally:
            timing["transition"] += max(self.group.end_generation())

    def generate_turn(self, prompt_ids: list[list[int]], params: dict) -> Batch:
        """One generate call inside `generation()`: token-id prompts, full sampling params
        (`sampling_params`); the Batch of rollout/base.py, rows in prompt order (n per prompt)."""
        batch = Batch(dict(zip(("input_ids", "attention_mask"), left_pad(prompt_ids, self.tokenizer.pad_token_id or 0))))
        return merge_replicas(self.group.generate_turn(batch, params), self.tokenizer.pad_token_id or 0)

    def compute_log_probs(self, sequences: Any) -> torch.Tensor:
        """[B, R] log-probs of the responses under the current policy (training layout)."""
        return self.group.compute_log_probs(_policy_inputs(sequences))["old_log_probs"]

    def update(self, states: Any = None, actions: Any = None, advantages: torch.Tensor | None = None, *,
               old_log_probs: torch.Tensor | None = None, ref_log_probs: torch.Tensor | None = None,
               mini_batches: int = 1, epochs: int = 1, **loss: Any) -> dict[str, float]:
        """One policy-gradient update on `actions` (the Rollout) with `advantages` ([B] per sequence, or
        [B, R] per token). Without old_log_probs the update is on-policy (ratio 1: plain REINFORCE).
        `states`: the prompts the actions were generated from; the sequences hold them already, so when given
        they are checked against them (a different prompt or order is an error, not silently ignored)."""
        if advantages is None:
            raise ValueError("actor.update needs advantages ([B] or [B, R])")
        if states is not None:
            check_prompts(self.tokenizer, states, _as_sequences(actions), "actor.update(states=...)")
        data = _policy_inputs(actions)
        mask = data["response_mask"].float()
        advantages = torch.as_tensor(advantages, dtype=torch.float32)
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1).expand_as(mask)
        if advantages.shape != mask.shape:
            raise ValueError(f"advantages of shape {tuple(advantages.shape)} do not match the responses "
                             f"{tuple(mask.shape)} (give [B] or [B, R])")
        data["advantages"] = advantages * mask
        cfg = {**self.loss, **loss}
        if old_log_probs is not None:
            data["old_log_probs"] = old_log_probs
        if ref_log_probs is not None:
            data["ref_log_probs"] = ref_log_probs
        sequences = _as_sequences(actions)
        if "rollout_log_probs" in sequences:  # the engine's: mismatch/* metrics, rollout_correction's weights
            data["rollout_log_probs"] = sequences["rollout_log_probs"]
        dp = self.layout.dp
        if len(data) < dp * mini_batches:
            raise ValueError(f"actor.update: {len(data)} sequences cannot fill dp={dp} x mini_batches={mini_batches}")
        results = self.group.update(data, cfg, mini_batches, epochs)
        return _average(results)


    def save_hf(self, out_dir: str) -> None:
        """Export the current policy to a Hugging Face folder (safetensors + config) that transformers loads."""
        self.group.export_hf(str(out_dir))
        self.tokenizer.save_pretrained(str(out_dir))

    def save_checkpoint(self, out_dir: str) -> None:
        """Megatron distributed checkpoint of the policy (out_dir/model, loadable at any TP/PP), its optimizer
        and LR scheduler (out_dir/optimizer) and the workers' RNG states (out_dir/rng)."""
        self.group.save_checkpoint(str(out_dir))

    def load_checkpoint(self, ckpt_dir: str, load_optimizer: bool = True) -> None:
        """Continue from save_checkpoint's folder, saved at this or another layout."""
        self.group.load_checkpoint(str(ckpt_dir), load_optimizer)

    @property
    def sampling_seed(self) -> int:
        """The per-call seed counter generate_sequences draws from when no seed is given (checkpointed)."""
        return self._step_seed

    @sampling_seed.setter
    def sampling_seed(self, value: int) -> None:
        self._step_seed = int(value)


class RolloutReplicas(_Role):
    """Generation replicas on a pool of their own (disaggregated), fed by `actor`'s training ranks shard to
    shard (hybrid_engine/bridge.py). `tp`: the generation TP (dividing the actor's); the pool's devices / tp
    replicas split the prompts. `ep` (mixture-of-experts actors): generation expert parallelism, each replica
    holding 1/ep of the experts and decoding in lockstep with the replicas of its expert-parallel group. Call
    `sync()` after each actor update; `generate_sequences` like the actor's.
    `partial=True`: a generation in progress takes each new sync at once, its rows resuming with the new weights
    (each token's policy version in "policy_versions"); else syncs wait for the generations queued before them."""

    def __init__(self, actor: Actor, resource_pool: ResourcePool, tp: int = 1, engine: str = "native",
                 max_batch_size: int = 64, seed: int = 1, call_timeout_s: float | None = 3600.0,
                 bridge_timeout_s: float = 600.0, partial: bool = False, ep: int = 1) -> None:
        from hybridrl.hybrid_engine.bridge import bridge_plan
        from hybridrl.workers.rollout import RolloutWorker

        if partial and engine != "native":
            raise ValueError(f"RolloutReplicas(partial=True) (rollout.partial=true) interrupts the native engine's "
                             f"decoding; engine={engine!r} cannot be: use engine='native' or partial=False")
        if ep > 1 and (partial or engine != "native"):
            raise ValueError(f"RolloutReplicas(ep={ep}) (rollout.ep): generation expert parallelism runs in the native "
                             f"engine without partial rollouts (engine={engine!r}, partial={partial})")
        self.actor = actor
        per_rank = actor.group.bridge_metas()
        self.metas = {rank: info["metas"] for rank, info in enumerate(per_rank)}
        spec = {"engine": engine, "tp": tp, "max_model_len": actor.engine_spec.get("max_model_len", 512),
                "max_batch_size": max_batch_size, "pad_token_id": actor.engine_spec["pad_token_id"],
                "stop_token_ids": actor.engine_spec["stop_token_ids"],
                "routing": actor.engine_spec.get("routing", "off")}
        model = {"path": actor.model_path, "dtype": actor.dtype}
        super().__init__(RolloutWorker, "rollout", resource_pool, {"tp": tp, "ep": ep},
                         {"model": model, "rollout": spec, "padded_vocab_size": per_rank[0]["padded_vocab_size"],
                          "partial": partial}, seed, call_timeout_s)
        self.plan = bridge_plan(actor.layout, tp, self.layout.world_size, gen_ep=ep)
        train_ranks = actor.layout.world_size
        size = train_ranks + self.layout.world_size
        host, port = actor.group.rendezvous_address()
        from hybridrl.controller import wait_all

        wait_all([actor.group.bridge_open.remote(host, port, size, bridge_timeout_s),
                  self.group.bridge_open.remote(host, port, size, train_ranks, bridge_timeout_s, self.plan, self.metas,
                                                actor.layout)])
        self.version = 0  # syncs sent; the replicas start from the model folder's weights (= the actor's)
        self._receiving: list = []  # bridge_receive calls queued on the replicas

    def sync(self, in_flight: int = 1) -> dict[str, float]:
        """Send the actor's current weights to every replica. The training ranks pack copies and return (training
        may go on at once; `in_flight` syncs may be on their way before the oldest is waited for); the replicas
        take the new weights before their next generation, after any generation already queued (with `partial`:
        at once, in the middle of a generation). Returns the bytes sent and the version the replicas will hold."""
        from hybridrl.controller import WorkerError

        while self._receiving and self._receiving[0].done():
            self._receiving.pop(0).result()  # earlier syncs' receives were posted (their errors surface here)
        try:
            sent = self.actor.group.bridge_send(self.plan, in_flight)
        except WorkerError:  # the bridge broke: when the replicas are gone that is the cause, say so
            self.group.alive()
            raise
        self.version += 1
        self._receiving.append(self.group.bridge_receive.remote(self.version))
        return {"sent_bytes": float(sum(sent)), "version": float(self.version)}

    def sync_stats(self) -> dict:
        """Per rank, the last sync applied: received_bytes, shard_bytes (its generation shard), seconds, version."""
        return {k: [r[k] for r in self.group.bridge_stats()] for k in ("received_bytes", "shard_bytes", "seconds",
                                                                       "version")}

    def submit(self, prompts: Any, settings: list[dict]) -> "PendingRollouts":
        """Start generating (one Rollout per sampling setting, like Actor.generate_many) without waiting: the
        replicas work while the driver trains; `.result()` collects. Calls run in submission order."""
        actor = self.actor
        batch, texts, metadata = actor.encode_prompts(prompts)
        params = [actor.sampling_params(setting) for setting in settings]
        future = self.group.generate_sequences.remote(batch, params)
        return PendingRollouts(future, params, texts, metadata, actor, self.version)

    def generate_many(self, prompts: Any, settings: list[dict]) -> list[Rollout]:
        return self.submit(prompts, settings).result()

    def generate_sequences(self, prompts: Any, greedy: bool = False, seed: int | None = None,
                           **sampling: Any) -> Rollout:
        return self.generate_many(prompts, [{"greedy": greedy, "seed": seed, **sampling}])[0]


class PendingRollouts:
    """Generation in flight on RolloutReplicas; `version`: the policy version it generates with."""

    def __init__(self, future: Any, params: list[dict], texts: list[str], metadata: list[dict], actor: Actor,
                 version: int) -> None:
        self.future, self.params, self.texts, self.metadata, self.actor = future, params, texts, metadata, actor
        self.version = version

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> list[Rollout]:
        results, actor = self.future.result(), self.actor
        rollouts = []
        for i, params in enumerate(self.params):
            per_replica = [None if r is None else (r[0], r[1][i]) for r in results]
            sequences = merge_replicas(per_replica, actor.tokenizer.pad_token_id or 0)
            sequences.meta.update(policy_version=self.version,
                                  generation_idle_s=max(r[1][i].meta["idle_s"] for r in results if r is not None))
            n = int(params.get("n", 1))
            rollouts.append(Rollout(sequences, actor.decode_responses(sequences),
                                    [t for t in self.texts for _ in range(n)],
                                    [m for m in self.metadata for _ in range(n)], actor.tokenizer))
        return rollouts


class ReferencePolicy(_Role):
    """The frozen initial policy; by default it takes the pool's layout (colocated with the actor)."""

    def __init__(self, model: str | None = None, resource_pool: ResourcePool | None = None,
                 parallel: dict | None = None, micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
                 dtype: str = "float32", seed: int = 1, role: str = "ref", tokenizer: Any = None,
                 call_timeout_s: float | None = 3600.0) -> None:
        from hybridrl.workers.actor import ReferenceWorker

        path = _model_path(model)
        self.tokenizer = _tokenizer_for(path, tokenizer)  # to check the prompts given to get_log_probs
        spec = {"path": path, "dtype": dtype, "micro_batch_size": micro_batch_size,
                "max_tokens_per_micro_batch": max_tokens_per_micro_batch}
        super().__init__(ReferenceWorker, role, resource_pool, parallel, {"model": spec, "seed": seed}, seed,
                         call_timeout_s)

    def get_log_probs(self, prompts: Any, sequences: Any = None) -> torch.Tensor:
        """[B, R] log-probs of the responses in `sequences` under the reference policy.

        get_log_probs(prompts, sequences): the prompts must be those the sequences were generated from (the
        sequences hold them; a mismatch is an error). get_log_probs(rollout): the rollout alone."""
        if sequences is None:
            sequences = prompts
        else:
            check_prompts(self.tokenizer, prompts, _as_sequences(sequences), "ref_policy.get_log_probs(prompts, ...)")
        data = _as_sequences(sequences).select(*_SEQUENCE_KEYS)
        return self.group.compute_ref_log_probs(data)["ref_log_probs"]


class Critic(_Role):
    """A value model (scalar head) trained on returns; starts from a causal-LM or a scalar-head checkpoint."""

    def __init__(self, model: str | None = None, resource_pool: ResourcePool | None = None,
                 parallel: dict | None = None, optim: dict | None = None, micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
                 dtype: str = "float32", seed: int = 1, role: str = "critic",
                 call_timeout_s: float | None = 3600.0) -> None:
        from hybridrl.workers.value import CriticWorker

        spec = {"path": _model_path(model), "dtype": dtype, "micro_batch_size": micro_batch_size,
                "max_tokens_per_micro_batch": max_tokens_per_micro_batch, "optim": dict(optim or {})}
        super().__init__(CriticWorker, role, resource_pool, parallel, {"model": spec, "seed": seed}, seed,
                         call_timeout_s)

    def compute_values(self, sequences: Any) -> torch.Tensor:
        return self.group.compute_values(_as_sequences(sequences).select(*_SEQUENCE_KEYS))["values"]

    def update(self, sequences: Any, returns: torch.Tensor, values: torch.Tensor, clip_range: float | None = 0.2,
               mini_batches: int = 1, epochs: int = 1) -> dict[str, float]:
        data = _as_sequences(sequences).select(*_SEQUENCE_KEYS)
        data["returns"], data["values"] = returns.float(), values.float()
        return _average(self.group.update(data, clip_range, mini_batches, epochs))

    def save_checkpoint(self, out_dir: str) -> None:
        """Value model, optimizer, LR scheduler and RNG states, as Actor.save_checkpoint."""
        self.group.save_checkpoint(str(out_dir))

    def load_checkpoint(self, ckpt_dir: str, load_optimizer: bool = True) -> None:
        self.group.load_checkpoint(str(ckpt_dir), load_optimizer)


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
                 resource_pool: ResourcePool | None = None, parallel: dict | None = None, micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
                 dtype: str = "float32", tokenizer: Any = None, chat_template: bool | None = None, seed: int = 1,
                 role: str = "reward", num_workers: int = 0, call_timeout_s: float | None = 3600.0) -> None:
        from hybridrl.workers.rule_reward import RuleReward

        if (model is None) == (fn is None):
            raise ValueError("RewardModel: give exactly one of model= (a reward-model folder) or fn= (a function)")
        if fn is not None and (tokenizer is not None or chat_template is not None):
            raise ValueError("RewardModel(fn=...): tokenizer= and chat_template= belong to a reward model (model=)")
        self.rule = RuleReward(fn, num_workers=num_workers) if fn is not None else None
        self.role = None
        if model is not None:
            from hybridrl.workers.value import RewardModelWorker

            self.text = TextScoring(str(model), tokenizer, chat_template)  # checked before any worker starts
            spec = {"path": str(model), "dtype": dtype, "micro_batch_size": micro_batch_size,
                    "max_tokens_per_micro_batch": max_tokens_per_micro_batch}
            self.role = _Role(RewardModelWorker, role, resource_pool, parallel, {"model": spec, "seed": seed}, seed,
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
        if isinstance(responses, Rollout):
            if prompts is not None:
                _check_prompt_texts(_texts_of(prompts), responses.prompt_texts)
            prompt_texts, texts = responses.prompt_texts, responses.texts
            metadata = metadata or responses.metadata
        else:
            if prompts is None:
                raise ValueError("reward_model.score(prompts, texts): texts need their prompts")
            texts = list(responses)
            given = _texts_of(prompts)
            prompt_texts = _repeat_per_response(given, len(texts))
            n = len(texts) // len(given)
            metadata = metadata if metadata is not None else getattr(prompts, "metadata", None)
            if metadata is not None and n > 1 and len(metadata) * n == len(texts):
                metadata = [m for m in metadata for _ in range(n)]
        if self.rule is not None:
            return self.rule.score(prompt_texts, texts, metadata)
        if isinstance(responses, Rollout) and self.text.reads_ids_of(responses.tokenizer):
            data = responses.sequences.select(*_SEQUENCE_KEYS)  # same tokens: no re-tokenisation
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
        return self.role.group.score(batch.select(*_SEQUENCE_KEYS))["scores"]

    def close(self) -> None:
        if self.role is not None:
            self.role.close()
        if self.rule is not None:
            self.rule.close()


class TextScoring:
    """How a reward model reads (prompt, response) text: its tokenizer and chat template."""

    def __init__(self, model_path: str, tokenizer: Any = None, chat_template: bool | None = None) -> None:
        from pathlib import Path

        folder = Path(model_path)
        if not (folder / "config.json").is_file():
            raise ValueError(f"RewardModel(model={model_path!r}): no Hugging Face model folder there "
                             f"(expected config.json)")
        # own: the tokenizer was chosen for this model (given, or in its folder); else the bundled one, and
        # the model is taken to read the actor's token ids (the tiny test models have no tokenizer files)
        self.own = tokenizer is not None or (folder / "tokenizer_config.json").is_file() \
            or (folder / "tokenizer.json").is_file()
        self.tokenizer = _tokenizer_for(model_path, tokenizer)
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


def _texts_of(prompts: Any) -> list[str]:
    from hybridrl.data.loader import PromptBatch

    if isinstance(prompts, PromptBatch):
        return list(prompts.texts)
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not all(isinstance(p, str) for p in prompts):
        raise TypeError("reward prompts must be a list of strings (or a PromptBatch)")
    return list(prompts)


def _repeat_per_response(prompts: list[str], responses: int) -> list[str]:
    """One prompt per response: prompts given once per n responses are repeated (prompt-major)."""
    if not prompts or responses % len(prompts):
        raise ValueError(f"{responses} responses for {len(prompts)} prompts (give one prompt per response or "
                         f"per n responses)")
    n = responses // len(prompts)
    return [p for p in prompts for _ in range(n)]


def _check_prompt_texts(given: list[str], held: list[str]) -> None:
    expanded = _repeat_per_response(given, len(held))
    for i, (a, b) in enumerate(zip(expanded, held)):
        if a != b:
            raise ValueError(f"reward_model.score: prompt {a!r} is not the prompt of response {i} ({b!r}); pass the "
                             f"prompts the rollout was generated from, in order")


def encode_prompts(tokenizer: Any, prompts: Any) -> tuple[Batch, list[str], list[dict]]:
    """Prompts as a left-padded Batch (+ texts, metadata): strings (tokenised), token-id lists, a PromptBatch
    or a Batch."""
    from hybridrl.data.loader import PromptBatch

    if isinstance(prompts, PromptBatch):
        return Batch({"input_ids": prompts.input_ids, "attention_mask": prompts.attention_mask}), \
            list(prompts.texts), list(prompts.metadata)
    if isinstance(prompts, Batch):
        texts = list(prompts.non_tensors.get("prompt_texts", [""] * len(prompts)))
        return prompts.select("input_ids", "attention_mask"), texts, [{} for _ in texts]
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
    if all(isinstance(p, str) for p in prompts):
        ids = tokenizer(list(prompts))["input_ids"]
        texts = list(prompts)
    else:
        ids = [list(map(int, p)) for p in prompts]
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    if any(len(row) == 0 for row in ids):
        raise ValueError("an empty prompt: every prompt needs at least one token")
    input_ids, mask = left_pad(ids, tokenizer.pad_token_id or 0)
    return Batch({"input_ids": input_ids, "attention_mask": mask}), texts, [{} for _ in texts]


def left_pad(ids: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> left-padded [B, P] ids and their attention mask (generation starts at column P)."""
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
        mask[i, width - len(row):] = 1
    return input_ids, mask


def _real_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def check_prompts(tokenizer: Any, prompts: Any, sequences: Batch, caller: str) -> None:
    """`prompts` must be the prompts `sequences` were generated from, in order (n sequences per prompt)."""
    batch, _, _ = encode_prompts(tokenizer, prompts)
    given = _real_rows(batch["input_ids"], batch["attention_mask"])
    width = sequences["prompts"].shape[1]
    held = _real_rows(sequences["prompts"], sequences["attention_mask"][:, :width])
    if len(held) % len(given):
        raise ValueError(f"{caller}: {len(given)} prompts for {len(held)} sequences (give the prompts the sequences "
                         f"were generated from)")
    n = len(held) // len(given)
    for i, row in enumerate(held):
        if row != given[i // n]:
            raise ValueError(f"{caller}: prompt {i // n} is not the prompt of sequence {i}; pass the prompts the "
                             f"sequences were generated from, in the same order (they are tokenised with this "
                             f"role's tokenizer: give it tokenizer= when its model folder has none)")


_SEQUENCE_KEYS = ("prompts", "responses", "attention_mask", "response_mask")


def _policy_inputs(sequences: Any) -> Batch:
    """What the actor's forwards read: the sequences, and the experts the rollout routed them to when it
    recorded them (mixture-of-experts models, rollout routing measure / replay)."""
    sequences = _as_sequences(sequences)
    recorded = ("routed_experts",) if "routed_experts" in sequences.tensors.keys() else ()
    return sequences.select(*_SEQUENCE_KEYS, *recorded)


def merge_replicas(results: list, pad_token_id: int = 0) -> Batch:
    """The actor's per-rank generate results -> one Batch in prompt order (replica 0's rows first)."""
    parts = sorted((r for r in results if r is not None), key=lambda item: item[0])
    if not parts:
        raise RuntimeError("no generation replica returned sequences")
    return concat_batches([batch for _, batch in parts], pad_token_id)


def _max_timing(results: list) -> dict[str, float]:
    """Stage seconds of a generate call: the slowest replica's (they run in parallel)."""
    timing: dict[str, float] = {}
    for item in results:
        if item is not None:
            for key, value in item[1].meta.get("timing", {}).items():
                timing[key] = max(timing.get(key, 0.0), value)
    return timing


def _average(results: list[dict]) -> dict[str, float]:
    """Per-DP-rank metric dicts -> one dict: per-token metrics weighted by each rank's token count, so they
    read the same at any DP size (rank-identical values such as grad_norm are unchanged)."""
    results = [dict(r) for r in results if r]
    if not results:
        return {}
    weights = [float(r.pop("tokens", 1.0)) for r in results]
    total = sum(weights) or 1.0
    return {k: sum(w * r[k] for w, r in zip(weights, results)) / total for k in results[0]}
