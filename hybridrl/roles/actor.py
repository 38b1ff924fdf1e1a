"""The actor role: the policy, trained in its layout and generating through the 3D-HybridEngine
(workers/actor.py on every device of its pool)."""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from hybridrl.config import (LoraConfig, ModelConfig, MoeConfig, OffloadConfig, OptimConfig, ParallelConfig, RoleConfig,
                             RolloutConfig, as_section)
from hybridrl.controller import ResourcePool
from hybridrl.data.tokenizer import tokenizer_for
from hybridrl.models.hub import resolve_model
from hybridrl.models.peft import tokenizer_folder
from hybridrl.models.precision import model_dtype
from hybridrl.parallel.generation import GenerationLayout, check_generation_layout
from hybridrl.parallel.layout import LayoutError, ParallelLayout, divisors
from hybridrl.protocol import Batch
from hybridrl.roles.base import (DEFAULT_MAX_TOKENS_PER_MICRO_BATCH, Role, average_metrics, checked_lora, layout_on,
                                 parallel_argument, start_pool)
from hybridrl.rollout import SamplingParams, TokenIds, sampling_params_from_config
from hybridrl.rollout.prompts import check_prompts, encode_prompts, left_pad
from hybridrl.rollout.types import Rollout, as_sequences, merge_replicas, policy_inputs, rollouts_from_replicas
from hybridrl.workers.actor import ActorWorker
from hybridrl.workers.offload import check_offload
from hybridrl.workers.policy import PolicyLossConfig
from hybridrl.workers.sharding import check_sharding


class Actor(Role):
    """The policy: trains in `parallel` (tp, pp; dp fills the pool; `parallel_config=` is the same argument),
    generates through the 3D-HybridEngine with the `rollout` settings (config.RolloutConfig: engine, tp, reshard,
    bucket_mb, max_model_len, and the default sampling n, temperature, top_p, top_k, max_new_tokens; the short API
    generates with the native engine unless rollout={"engine": "vllm"}).

    model: a Hugging Face folder, a hub id org/name[@revision] (fetched into the HF cache on this driver) or a
    tiny:<name>; None: the embedded tiny Llama. Without resource_pool every role shares ResourcePool.default().

    optim: config.OptimConfig (lr, weight_decay, betas, clip_grad, warmup_steps, use_distributed_optimizer).
    loss: workers.policy.PolicyLossConfig (clip_ratio, entropy_coef, kl_estimator, policy_loss, loss_agg, ...).
    moe (models with experts): config.MoeConfig, the routers' aux_loss_coef and z_loss_coef.
    lora: config.LoraConfig (rank, alpha, dropout, target_modules, init): train adapters only, the base frozen;
    `reference_log_probs` then gives the base model's log-probs (the reference policy, no second model).
    offload: config.OffloadConfig (grads, optimizer: in host memory between updates; params: while vLLM generates).
    Each may be a dict (checked: unknown keys are refused) or the dataclass itself.
    """

    def __init__(self, model: str | None = None, parallel: dict | ParallelConfig | ParallelLayout | None = None,
                 rollout: dict | RolloutConfig | None = None, resource_pool: ResourcePool | None = None,
                 optim: dict | OptimConfig | None = None, loss: dict | PolicyLossConfig | None = None,
                 micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
                 dtype: str = "auto", tokenizer: Any = None, seed: int = 1, role: str = "actor",
                 call_timeout_s: float | None = 3600.0, moe: dict | MoeConfig | None = None,
                 parallel_config: dict | ParallelConfig | ParallelLayout | None = None,
                 lora: dict | LoraConfig | None = None, offload: dict | OffloadConfig | None = None) -> None:
        parallel = parallel_argument(parallel, parallel_config, "Actor")
        path = resolve_model(model, "Actor(model=...)")  # a hub id is fetched here, before any worker starts
        settings = RoleConfig(model=ModelConfig(path, model_dtype(dtype, path)),
                              moe=as_section(MoeConfig, moe, "Actor(moe=...)"),
                              lora=checked_lora(lora, "Actor(lora=...)"),
                              optim=as_section(OptimConfig, optim, "Actor(optim=...)"),
                              micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                              offload=as_section(OffloadConfig, offload, "Actor(offload=...)"))
        check_sharding(role, getattr(parallel, "fsdp", "no_shard"), settings.lora, settings.offload)  # before Ray
        if rollout is None or isinstance(rollout, dict):  # the short API's engine unless named: native (the
            rollout = {"engine": "native", **(rollout or {})}  # trainer resolves auto)
        self._start(settings, as_section(RolloutConfig, rollout, "Actor(rollout=...)"),
                    as_section(PolicyLossConfig, loss, "Actor(loss=...)"), parallel, resource_pool,
                    tokenizer_for(tokenizer_folder(path), tokenizer), seed, role, call_timeout_s)

    @classmethod
    def from_settings(cls, settings: RoleConfig, rollout: RolloutConfig, loss: PolicyLossConfig,
                      layout: ParallelLayout, pool: ResourcePool, tokenizer: Any, seed: int = 1, role: str = "actor",
                      call_timeout_s: float | None = 3600.0) -> "Actor":
        """The trainer's way in: settings already typed and checked by its plan (model path local, rollout
        engine and max_model_len resolved)."""
        actor = cls.__new__(cls)
        actor._start(settings, rollout, loss, layout, pool, tokenizer, seed, role, call_timeout_s)
        return actor

    def _start(self, settings: RoleConfig, rollout: RolloutConfig, loss: PolicyLossConfig, parallel: Any,
               pool: ResourcePool | None, tokenizer: Any, seed: int, role: str, call_timeout_s: float | None) -> None:
        self.settings, self.rollout, self.loss, self.tokenizer = settings, rollout, loss, tokenizer
        self.tokens = TokenIds.of(tokenizer)
        self.pool = start_pool(pool)
        self.layout = layout_on(self.pool, parallel, role)
        check_generation(rollout, self.layout)  # before any worker starts
        check_offload(settings.offload, "actor", rollout.engine)
        super().__init__(ActorWorker, role, self.pool, self.layout,
                         {"role": settings, "rollout": rollout, "tokens": self.tokens, "seed": seed}, seed,
                         call_timeout_s)
        self._step_seed = seed * 1_000_003

    @property
    def model_path(self) -> str:
        return self.settings.model.path

    # ---- prompts ---------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: Any) -> tuple[Batch, list[str], list[dict]]:
        """Prompts as a left-padded Batch: strings (tokenised), token-id lists, a PromptBatch or a Batch."""
        return encode_prompts(self.tokenizer, prompts)

    def sampling_params(self, setting: dict) -> SamplingParams:
        """The actor's rollout defaults overridden by a setting (greedy, seed, SamplingParams fields); a seed is
        drawn from the actor's counter when the setting has none; the tokenizer's EOS stops unless given."""
        overrides = {k: v for k, v in setting.items() if k not in ("greedy", "seed")}
        if setting.get("greedy"):
            overrides.update(greedy=True, n=1)
        seed = setting.get("seed")
        if seed is None:
            self._step_seed += 1
            seed = self._step_seed
        params = sampling_params_from_config(self.rollout, **overrides, seed=seed)
        return params if params.stop_token_ids else dataclasses.replace(params, stop_token_ids=self.tokens.stops)

    # ---- generation ----------------------------------------------------------------------------------
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
        return rollouts_from_replicas(results, all_params, texts, metadata, self.tokenizer)

    @contextmanager
    def generation(self) -> Iterator[dict[str, float]]:
        """Hold the generation layout over several `generate_turn` calls (one transition there and one back,
        however many turns); yields a dict whose "transition" holds the seconds both took, once it exits."""
        timing = {"transition": max(self.group.begin_generation())}
        try:
            yield timing
        finally:
            timing["transition"] += max(self.group.end_generation())

    def generate_turn(self, prompt_ids: list[list[int]], params: SamplingParams) -> Batch:
        """One generate call inside `generation()`: token-id prompts, full sampling params (`sampling_params`);
        the Batch of rollout/base.py, rows in prompt order (n per prompt)."""
        batch = Batch(dict(zip(("input_ids", "attention_mask"), left_pad(prompt_ids, self.tokens.pad))))
        return merge_replicas(self.group.generate_turn(batch, params), self.tokens.pad)

    # ---- training layout -------------------------------------------------------------------------------
    def compute_log_probs(self, sequences: Any) -> torch.Tensor:
        """[B, R] log-probs of the responses under the current policy (training layout)."""
        return self.group.compute_log_probs(policy_inputs(sequences))["old_log_probs"]

    def update(self, states: Any = None, actions: Any = None, advantages: torch.Tensor | None = None, *,
               old_log_probs: torch.Tensor | None = None, ref_log_probs: torch.Tensor | None = None,
               mini_batches: int = 1, epochs: int = 1, **loss: Any) -> dict[str, float]:
        """One policy-gradient update on `actions` (the Rollout) with `advantages` ([B] per sequence, or
        [B, R] per token). Without old_log_probs the update is on-policy (ratio 1: plain REINFORCE).
        `states`: the prompts the actions were generated from; the sequences hold them already, so when given
        they are checked against them (a different prompt or order is an error, not silently ignored).
        `loss`: PolicyLossConfig fields for this update only (e.g. kl_loss_coef)."""
        if advantages is None:
            raise ValueError("actor.update needs advantages ([B] or [B, R])")
        if states is not None:
            check_prompts(self.tokenizer, states, as_sequences(actions), "actor.update(states=...)")
        data = policy_inputs(actions)
        data["advantages"] = _per_token(advantages, data["response_mask"].float())
        for key, value in (("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs)):
            if value is not None:
                data[key] = value
        sequences = as_sequences(actions)
        if "rollout_log_probs" in sequences:  # the engine's: mismatch/* metrics, rollout_correction's weights
            data["rollout_log_probs"] = sequences["rollout_log_probs"]
        dp = self.layout.dp
        if len(data) < dp * mini_batches:
            raise ValueError(f"actor.update: {len(data)} sequences cannot fill dp={dp} x mini_batches={mini_batches}")
        settings = dataclasses.replace(self.loss, **loss) if loss else self.loss
        return average_metrics(self.group.update(data, settings, mini_batches, epochs))

    def reference_log_probs(self, sequences: Any) -> torch.Tensor:
        """[B, R] log-probs of the responses under a LoRA actor's base model (its adapters off): the reference
        policy without a reference model."""
        return self.group.compute_ref_log_probs(policy_inputs(sequences))["ref_log_probs"]

    # ---- weights -----------------------------------------------------------------------------------------
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


def check_generation(rollout: RolloutConfig, layout: ParallelLayout) -> None:
    """The actor's generation layout (rollout.tp, rollout.ep) against its training layout: a generation shard is
    regrouped from whole training shards (and expert blocks). ValueError names the options; the trainer's plan
    runs the same check."""
    if rollout.ep > 1:
        try:
            check_generation_layout(layout, GenerationLayout(tp=rollout.tp, ep=rollout.ep))
        except LayoutError as exc:
            raise ValueError(f"rollout.ep={rollout.ep}: {exc}".replace("--gen-ep", "rollout.ep")
                             .replace("--train-ep", "actor.parallel.ep")) from None
    if layout.tp % rollout.tp or rollout.tp > layout.tp:
        raise ValueError(f"rollout.tp={rollout.tp} must divide actor.parallel.tp={layout.tp} (a generation shard is "
                         f"regrouped from whole training shards); choose rollout.tp in {divisors(layout.tp)}")
    if layout.fsdp != "no_shard" and rollout.reshard != "hybrid":
        raise ValueError(f"rollout.reshard={rollout.reshard} with actor.parallel.fsdp={layout.fsdp}: the baselines read "
                         f"whole training shards; fully sharded ones move with rollout.reshard=hybrid")


def _per_token(advantages: Any, mask: torch.Tensor) -> torch.Tensor:
    """Advantages [B] (one per sequence) or [B, R] as [B, R], zero on padding."""
    advantages = torch.as_tensor(advantages, dtype=torch.float32)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(mask)
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages of shape {tuple(advantages.shape)} do not match the responses "
                         f"{tuple(mask.shape)} (give [B] or [B, R])")
    return advantages * mask
