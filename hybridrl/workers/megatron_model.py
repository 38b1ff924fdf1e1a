"""One role's Megatron-Core model inside a worker: build, load, run micro-batches through Megatron's schedule.

Every Megatron-backed role (actor, reference, critic, reward / cost model) holds one `MegatronModel`:
- built from a Hugging Face folder for this rank's TP/PP shard (LM head or scalar head);
- trainable ones are wrapped in Megatron's DDP with its (distributed) optimizer and LR scheduler;
- `forward(...)` and `train_step(...)` cut a Batch of rollouts into micro-batches (by a token budget, rows
  of packed sequences; workers/sequences.py) and run them through
  `get_forward_backward_func()` (1F1B when PP > 1), so pipeline parallelism and gradient accumulation are
  Megatron's own. Results exist on the last pipeline stage (the ranks the driver collects from).

Sequences arrive as rollouts (left-padded prompts, right-padded responses) and are packed into rows of
prompt+response with no gap (workers/sequences.py), so a plain causal mask is exact.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from hybridrl.config import LoraConfig, MoeConfig, OffloadConfig, OptimConfig, RoleConfig
from hybridrl.controller.dispatch import Dispatch, register
from hybridrl.models import build_gpt_model, load_hf_weights
from hybridrl.models.builder import shares_rows, unwrap
from hybridrl.models.config import CheckpointError
from hybridrl.models.dist_ckpt import load_dist_checkpoint, save_dist_checkpoint
from hybridrl.models.families import ModelDims
from hybridrl.models.lora_io import ADAPTER_DIR, add_adapters, load_adapter_folder, save_adapter_folder
from hybridrl.models.peft import model_config, model_weights
from hybridrl.models.routing_replay import ExpertRouting
from hybridrl.parallel.distributed import device
from hybridrl.protocol import Batch
from hybridrl.workers import fsdp_checkpoint
from hybridrl.workers.moe_metrics import RoutingTracker
from hybridrl.workers.offload import TrainingStateOffload, grad_buffers
from hybridrl.workers.sequences import PackedSequences, micro_batches, pack, packed_fill, restore_order
from hybridrl.workers.sharding import fully_sharded, local_tensor, release_gathered, shards_model

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _router_losses(hf_config: Any, moe: MoeConfig) -> dict[str, Any]:
    """Megatron settings of the routers' auxiliary losses (models with experts; none by default)."""
    if ModelDims.from_hf(hf_config).moe is None:
        return {}
    aux, z = float(moe.aux_loss_coef), float(moe.z_loss_coef)
    return {"moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none", "moe_aux_loss_coeff": aux,
            "moe_z_loss_coeff": z if z > 0 else None}


def rollout_rows(data: Batch, multiple_of: int = 1, with_routing: bool = False) -> PackedSequences:
    """Pack a rollout Batch (prompts / responses / attention_mask) into causal rows whose width is a multiple
    of `multiple_of` (sequence parallelism splits the sequence over TP ranks). Every real response token is
    packed, observations of a multi-turn episode too; response_mask later picks the ones trained on.
    with_routing: the rollout's recorded experts ("routed_experts") are packed along."""
    prompt_width = data["prompts"].shape[1]
    routing = data["routed_experts"] if with_routing and "routed_experts" in data.tensors else None
    return pack(data["prompts"], data["attention_mask"][:, :prompt_width], data["responses"],
                data["attention_mask"][:, prompt_width:], multiple_of=multiple_of, routing=routing)


class MegatronModel:
    """A role's model shard on this rank (Megatron parallel state must already be initialised).

    path: a local Hugging Face folder; head: lm | scalar; optim: None for a frozen model (reference, reward
    model); micro-batches pack sequences up to max_tokens_per_micro_batch tokens (None: micro_batch_size rows)."""

    def __init__(self, path: str, *, head: str = "lm", dtype: str = "float32", micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = None, optim: OptimConfig | None = None,
                 moe: MoeConfig | None = None, sequence_parallel: bool = False, seed: int = 1234,
                 fsdp: str = "no_shard", lora: LoraConfig | None = None, offload: OffloadConfig | None = None
                 ) -> None:
        from megatron.core import parallel_state

        if dtype not in DTYPES:
            raise ValueError(f"model dtype={dtype!r}; choose one of {sorted(DTYPES)}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch={max_tokens_per_micro_batch} must be >= 1 (or None)")
        self.path, self.head, self.dtype = path, head, dtype
        self.micro_batch_size, self.max_tokens_per_micro_batch = micro_batch_size, max_tokens_per_micro_batch
        self.sequence_parallel = sequence_parallel
        self.fsdp = fsdp  # parallel.fsdp: fully sharded data parallel (workers/sharding.py)
        self.hf_config = model_config(path)  # a PEFT adapter folder: its base with the adapter merged (models/peft.py)
        torch.manual_seed(seed)
        self.lora = lora if lora is not None and lora.enabled and optim is not None else None
        model = build_gpt_model(self.hf_config, head=head, dtype=DTYPES[dtype], sequence_parallel=sequence_parallel,
                                **_router_losses(self.hf_config, moe or MoeConfig()), local_spec=self.lora is not None)
        model = model.to(device())
        load_hf_weights(model, model_weights(path), self.hf_config, init_missing_score=head == "scalar")
        if self.lora is not None:  # adapters only are trained: the optimizer below sees nothing else
            add_adapters(model, self.lora, seed=seed)
        self.inner = model
        self.vocab_size = int(self.hf_config.vocab_size)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.optimizer = None
        self.scheduler = None
        self.model = model
        self.routing = None  # a mixture-of-experts model's routers, watched during updates
        # what the forwards do with a rollout's recorded experts: None ignore, "measure" count the tokens routed
        # otherwise (moe/routing_mismatch), "replay" also route them as recorded (models/routing_replay.py)
        self.routing_mode: str | None = None
        self.forward_routing_mismatch: float | None = None  # of the last forward-only pass (the old log-probs)
        self.state_offload: TrainingStateOffload | None = None  # gradients / optimizer state between updates
        if optim is not None:
            self._make_trainable(optim)
            if model.config.num_moe_experts:
                self.routing = RoutingTracker(model)
            offload = offload or OffloadConfig()
            self.state_offload = TrainingStateOffload(self.model, self.optimizer, offload.grads, offload.optimizer)
            self.state_offload.offload()
        elif shards_model(fsdp, trainable=False):  # a frozen model's parameters, sharded over the DP group
            self.model = fully_sharded(model.config, model, fsdp)
        self.steps = 0

    # ---- training setup ------------------------------------------------------------------------------
    @classmethod
    def for_role(cls, role: RoleConfig, layout: Any, *, head: str = "lm", trainable: bool = True,
                 seed: int = 1234) -> "MegatronModel":
        """The model of a Megatron-backed role section (actor:, ref:, critic:) at the role's layout."""
        return cls(role.model.path, head=head, dtype=role.model.dtype, micro_batch_size=role.micro_batch_size,
                   max_tokens_per_micro_batch=role.max_tokens_per_micro_batch,
                   optim=role.optim if trainable else None, moe=role.moe,
                   sequence_parallel=layout.sequence_parallel, seed=seed, fsdp=layout.fsdp, lora=role.lora,
                   offload=role.offload)

    @contextlib.contextmanager
    def training_state(self):
        """Gradients and optimizer state on the device inside (an update, a checkpoint), back in host memory after
        when the role's offload settings say so."""
        offload = self.state_offload
        if offload is not None:
            offload.restore()
        try:
            yield
        finally:
            if offload is not None:
                offload.offload()

    def _make_trainable(self, optim: OptimConfig) -> None:
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config = self.inner.config
        model = self.inner
        if config.bf16 or config.fp16:  # Megatron's mixed precision: low-precision module, fp32 main params
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        distributed = optim.use_distributed_optimizer
        if shards_model(self.fsdp, trainable=True):  # sharded parameters: Megatron's plain optimizer over them
            self.model, distributed = fully_sharded(config, model, self.fsdp), False
        else:
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
            self.model = DistributedDataParallel(config, ddp_config, model)
        config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer=optim.optimizer, sgd_momentum=0.0, lr=optim.lr, min_lr=optim.lr, weight_decay=optim.weight_decay,
                            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], clip_grad=optim.clip_grad,
                            use_distributed_optimizer=distributed, bf16=config.bf16,
                            fp16=config.fp16, params_dtype=config.params_dtype), [self.model])
        _fuse_cpu_adam(self.optimizer)
        warmup = max(0, int(optim.warmup_steps))
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else optim.lr, max_lr=optim.lr, min_lr=optim.lr,
            lr_warmup_steps=warmup, lr_decay_steps=warmup + 1, lr_decay_style="constant",
            start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=1, wd_incr_style="constant")

    # ---- running micro-batches -----------------------------------------------------------------------
    def _micro_batches(self, packed: PackedSequences, extra: dict[str, torch.Tensor]) -> tuple[list[dict], list[int]]:
        """Micro-batches of this rank's sequences (workers/sequences.py): by token budget when one is set,
        else micro_batch_size rows. Pipeline stages need one activation shape: uniform row counts. With
        expert parallelism the data-parallel replicas whose MoE layers exchange tokens agree on the count."""
        from megatron.core import parallel_state

        options = dict(micro_batch_size=self.micro_batch_size, max_tokens=self.max_tokens_per_micro_batch,
                       share_rows=shares_rows(), uniform=parallel_state.get_pipeline_model_parallel_world_size() > 1,
                       device=device())
        batches, order = micro_batches(packed, extra, **options)
        group = parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False) \
            if self.inner.config.num_moe_experts else None
        if group is None or torch.distributed.get_world_size(group) == 1:
            return batches, order
        count = torch.tensor([len(batches)], dtype=torch.long, device=device())
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
        if int(count) == len(batches):
            return batches, order
        return micro_batches(packed, extra, count=int(count), **options)

    def _packed(self, data: Batch) -> PackedSequences:
        return rollout_rows(data, self.tp if self.sequence_parallel else 1,
                            with_routing=self.routing_mode is not None)

    def _run(self, micro_batches: list[dict], loss_fn: Callable, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        experts = ExpertRouting.of(self.inner) if "routed_experts" in micro_batches[0] else None

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if experts is not None:  # this micro-batch's recorded experts, just before its forward
                experts.load_targets(mb["routed_experts"])
            output = model(mb["input_ids"], mb["position_ids"], attention_mask=mb.get("attention_mask"))
            return output, functools.partial(loss_fn, mb)

        rows, width = micro_batches[0]["input_ids"].shape
        if experts is not None:
            experts.set_mode(self.routing_mode)
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self.model],
                num_microbatches=len(micro_batches), seq_length=width, micro_batch_size=rows,
                forward_only=forward_only)
        finally:
            if experts is not None:
                experts.set_mode(None)

    def forward(self, data: Batch, per_micro_batch: Callable[[dict, torch.Tensor], torch.Tensor],
                extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Forward only: `per_micro_batch(mb, output) -> [b, ...]` on the last stage; returns the rows'
        results concatenated (filler rows dropped) on the last stage, None on earlier stages."""
        micro_batches, order = self._micro_batches(self._packed(data), extra or {})

        def loss_fn(mb, output):
            return torch.zeros((), device=output.device), {"out": per_micro_batch(mb, output).detach()}

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                outputs = self._run(micro_batches, loss_fn, forward_only=True)
        finally:
            self.model.train(was_training)
            release_gathered(self.model)  # fsdp: no backward follows to free the gathered parameters
        if "routed_experts" in micro_batches[0]:
            self.forward_routing_mismatch = self.routing_mismatch()
        if not self.is_last_stage:
            return None
        return restore_order(torch.cat([o["out"].cpu() for o in outputs]), order)

    def train_epochs(self, data: Batch, loss_terms: Callable, keys: list[str], mini_batches: int = 1,
                     epochs: int = 1, role: str = "update", units: Callable[[dict], float] | None = None
                     ) -> dict[str, float]:
        """`epochs` passes over `data` (this DP rank's share), each cut into `mini_batches` train_steps; the
        per-step metrics averaged. Every DP rank must take the same number of optimizer steps."""
        if len(data) < mini_batches:
            raise ValueError(f"{role}: {len(data)} rows on this DP rank cannot make {mini_batches} mini-batches")
        with self.training_state():
            history = [self.train_step(part, loss_terms, {k: part[k] for k in keys}, units)
                       for _ in range(epochs) for part in data.chunk(mini_batches)]
        self.forward_routing_mismatch = None  # the old log-probs' pass belonged to this update
        return {k: sum(h[k] for h in history) / len(history) for k in history[0]}

    def train_step(self, data: Batch, loss_terms: Callable[[dict, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]],
                   extra: dict[str, torch.Tensor], units: Callable[[dict], float] | None = None) -> dict[str, float]:
        """One optimizer step over `data` (this DP rank's share of a mini-batch).

        `loss_terms(mb, output) -> (loss_sum, token_count, metrics)`: the weighted per-token loss summed over
        the micro-batch. The step minimises sum / units over the whole mini-batch across DP ranks: each
        micro-batch's sum is divided by the global units (`units(mb)` summed; default: response tokens, the
        token mean) and rescaled for Megatron's division by the number of micro-batches and DDP's average
        over DP ranks.
        """
        from megatron.core import parallel_state

        if self.optimizer is None:
            raise RuntimeError("train_step on a frozen model (built without optim)")
        micro_batches, _ = self._micro_batches(self._packed(data), extra)
        local_tokens = sum(float((mb["response_mask"] * mb["row_valid"].unsqueeze(1)).sum()) for mb in micro_batches)
        local_units = local_tokens if units is None else sum(units(mb) for mb in micro_batches)
        total = torch.tensor([local_units], dtype=torch.float64, device=micro_batches[0]["input_ids"].device)
        dp = parallel_state.get_data_parallel_world_size()
        if dp > 1:
            torch.distributed.all_reduce(total, group=self.dp_group)
        scale = len(micro_batches) * dp / max(float(total.item()), 1.0)

        def loss_fn(mb, output):
            loss_sum, count, metrics = loss_terms(mb, output)
            metrics = {k: torch.as_tensor(v, dtype=torch.float64).detach().cpu() for k, v in metrics.items()}
            metrics["_tokens"] = torch.as_tensor(float(count), dtype=torch.float64)
            return loss_sum * scale, metrics

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.routing is not None:
            self.routing.start()
        outputs = self._run(micro_batches, loss_fn, forward_only=False)
        routing = self.routing.finish(len(micro_batches)) if self.routing is not None else {}
        if "routed_experts" in micro_batches[0]:  # the rollout vs the trainer before this update, when known
            update_mismatch = self.routing_mismatch()
            routing["moe/routing_mismatch"] = update_mismatch if self.forward_routing_mismatch is None else \
                self.forward_routing_mismatch
        if self._grads_finite():
            ok, grad_norm, _ = self.optimizer.step()
        else:  # never let NaN/inf reach the weights (or a checkpoint): skip this step on every rank
            ok, grad_norm = False, float("nan")
            self.optimizer.zero_grad()
        if self.scheduler is not None and ok:
            self.scheduler.step(increment=1)
        self.steps += 1
        result: dict[str, float] = {"tokens": local_tokens,  # lets the driver weight DP ranks' metrics
                                    "token_fill": packed_fill(micro_batches),
                                    "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                                    "update_ok": float(bool(ok)), "lr": float(self.optimizer.param_groups[0]["lr"]),
                                    **routing}
        if self.is_last_stage and outputs:
            weights = torch.stack([o["_tokens"] for o in outputs])
            total = float(weights.sum()) or 1.0
            for key in outputs[0]:
                if key != "_tokens":  # token-weighted mean over micro-batches
                    result[key] = float(sum(o[key] * o["_tokens"] for o in outputs) / total)
        return result


    def routing_mismatch(self) -> float:
        """Share of recorded (token, MoE layer) pairs the forwards since the last call routed to other experts
        than the rollout (a collective over the role's ranks); the counts start again."""
        experts = ExpertRouting.of(self.inner)
        share = experts.mismatch()
        experts.reset_counts()
        return share

    def _grads_finite(self) -> bool:
        """All-rank agreement that every gradient is finite (a collective over the role's process group): the
        check stays on the device (a sum per gradient buffer: inf / nan propagate into it) and reads one number
        back, instead of one host sync per parameter."""
        grads = grad_buffers(self.model)
        if not grads:  # no contiguous buffers (not wrapped in Megatron DDP): the parameters' own gradients
            grads = [local_tensor(g) for g in (getattr(p, "main_grad", None) if getattr(p, "main_grad", None)
                                               is not None else p.grad for p in self.inner.parameters())
                     if g is not None]  # fsdp: this rank's piece
        device = next(self.inner.parameters()).device
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for grad in grads:
            total += grad.sum(dtype=torch.float32)
        bad = (~torch.isfinite(total)).float()
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return not bool(bad.item())

    # ---- checkpoints -------------------------------------------------------------------------------------
    def save_checkpoint(self, out_dir: str) -> None:
        """Collective over the role's ranks. Writes out_dir/model (a Megatron distributed checkpoint of the
        weights that loads at any TP/PP, see models/dist_ckpt.py; LoRA: out_dir/adapter instead, a PEFT adapter
        folder naming the frozen base, which is not copied), out_dir/optimizer (the optimizer's sharded
        state in model space, so it reshards too, plus the LR scheduler and step count) and out_dir/rng (this
        rank's RNG states, restored only at the same layout)."""
        with self.training_state():
            self._save_checkpoint(Path(out_dir))

    def _save_checkpoint(self, root: Path) -> None:
        from megatron.core import dist_checkpointing

        rank = torch.distributed.get_rank()
        if self.lora is not None:
            save_adapter_folder(self.model, root / ADAPTER_DIR, base=self.path, dropout=self.lora.dropout)
        elif self._sharded:  # fully sharded: the same format, from the gathered TP shards (fsdp_checkpoint.py)
            fsdp_checkpoint.save_model(self.model, self.hf_config, root / "model")
        else:
            save_dist_checkpoint(self.model, self.hf_config, root / "model")
        if self.optimizer is not None:
            if rank == 0:
                (root / "optimizer").mkdir(parents=True, exist_ok=True)
            torch.distributed.barrier()
            state = {"optimizer": self._optimizer_sharded_state(is_loading=False)[0],
                     "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                     "steps": self.steps}
            dist_checkpointing.save(state, str(root / "optimizer"))
        (root / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(_rng_states(), root / "rng" / f"rank_{rank:05d}.pt")
        torch.distributed.barrier()

    @property
    def _sharded(self) -> bool:
        """Whether this model is fully sharded over its DP group (parallel.fsdp)."""
        return shards_model(self.fsdp, trainable=self.optimizer is not None)

    def _optimizer_sharded_state(self, is_loading: bool) -> tuple[dict, list[str] | None]:
        """The optimizer's state as Megatron's distributed checkpoint saves / requests it: the distributed
        optimizer's model-space format, which a fully sharded model writes and reads too (fsdp_checkpoint.py)."""
        if self._sharded:
            return fsdp_checkpoint.optimizer_state(self.model, self.optimizer, is_loading)
        model_state = unwrap(self.model).sharded_state_dict()
        return self.optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=_OPTIM_FORMAT), None

    def load_checkpoint(self, ckpt_dir: str, load_optimizer: bool = True) -> None:
        """Collective: the inverse of save_checkpoint, at this model's (possibly different) layout."""
        with self.training_state():
            self._load_checkpoint(Path(ckpt_dir), load_optimizer)

    def _load_checkpoint(self, root: Path, load_optimizer: bool) -> None:
        from megatron.core import dist_checkpointing

        if self.lora is not None:
            if not (root / ADAPTER_DIR).is_dir():
                raise CheckpointError(f"{root}: no {ADAPTER_DIR}/ (a LoRA checkpoint's adapters); it was saved "
                                      f"without LoRA: resume with the same lora settings")
            load_adapter_folder(self.model, root / ADAPTER_DIR)
        elif self._sharded:
            fsdp_checkpoint.load_model(self.model, root / "model")
        else:
            load_dist_checkpoint(self.model, root / "model")
        if self.optimizer is not None and load_optimizer:
            if not (root / "optimizer").is_dir():
                raise CheckpointError(f"{root}: no optimizer state (optimizer/) to resume training from")
            sharded_state, names = self._optimizer_sharded_state(is_loading=True)
            try:
                state = dist_checkpointing.load({"optimizer": sharded_state}, str(root / "optimizer"))
            except Exception as exc:  # dist_checkpointing raises several types for missing/mismatched shards
                raise CheckpointError(f"{root / 'optimizer'}: loading the optimizer state failed: {exc}") from exc
            if self._sharded:
                fsdp_checkpoint.set_optimizer_state(self.model, self.optimizer, state["optimizer"], names)
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            self.steps = int(state.get("steps", self.steps))
        elif self.optimizer is not None:
            # new weights without the optimizer: a bf16 model's fp32 main weights (the distributed optimizer's own
            # copy, which each step updates and copies back) must follow them, or the next step brings the old back
            self.optimizer.reload_model_params()
        rng_file = root / "rng" / f"rank_{torch.distributed.get_rank():05d}.pt"
        saved = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
        if saved is not None and saved.get("world_size") == torch.distributed.get_world_size() \
                and saved.get("layout") == _layout_key():
            _set_rng_states(saved)
        else:  # another layout: a rank's RNG stream has no counterpart (sampling seeds come from the driver)
            logger.info("%s: RNG states saved at another layout; keeping this run's seeds", root)


# The distributed optimizer's checkpoint format that reshards over TP/PP/DP (its default in megatron-core 0.16,
# fully_sharded_model_space, builds flattened ShardedTensors that 0.16's dist_checkpointing rejects).
_OPTIM_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _fuse_cpu_adam(optimizer: Any) -> None:
    """Without Transformer Engine or Apex, Megatron falls back to torch's Adam, which on CPU loops over a
    parameter's update op by op; its fused kernel does the same update in one pass (25M fp32 main params: 97 ->
    25 ms a step on 2 cores, equal to fp32 rounding). GPUs keep Megatron's choice."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if params and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)


def _layout_key() -> tuple[int, int, int]:
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size())


def _rng_states() -> dict[str, Any]:
    """This rank's torch CPU (+ CUDA) generator and Megatron's model-parallel RNG tracker states."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states: dict[str, Any] = {"torch": torch.get_rng_state(), "world_size": torch.distributed.get_world_size(),
                              "layout": _layout_key()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    tracker = get_cuda_rng_tracker()
    states["tracker"] = {name: state.clone() for name, state in tracker.get_states().items()}
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if states.get("tracker"):
        get_cuda_rng_tracker().set_states(dict(states["tracker"]))


class CheckpointedRole:
    """Worker mixin of trained roles (actor, critics): their MegatronModel's checkpoint as group calls."""

    model: MegatronModel

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, out_dir: str) -> None:
        """Weights, optimizer, scheduler and RNG states under out_dir (collective, see MegatronModel)."""
        self.model.save_checkpoint(out_dir)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, ckpt_dir: str, load_optimizer: bool = True) -> None:
        """Resume from save_checkpoint's folder, at this worker group's layout (any TP/PP)."""
        self.model.load_checkpoint(ckpt_dir, load_optimizer)
