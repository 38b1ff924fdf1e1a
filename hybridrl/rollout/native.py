"""Native rollout engine: the generation-layout Megatron-Core GPTModel with a KV cache.

KV caching is Megatron-Core's own: a `StaticInferenceContext` passed to `GPTModel.forward` as
`inference_context` makes every attention layer keep its keys/values ([max_len, max_batch, groups,
head_dim] per layer) and attend over them; only the last position's logits are computed.

Batched decoding of variable-length prompts: prompts are left-padded to a common length and an explicit
boolean attention mask (causal AND key-is-real) hides the padding, in the prefill and every decode step.
Left padding shifts a row's RoPE positions by a constant, which leaves q.k (relative positions) unchanged,
so a row's tokens and log-probs equal those of the unpadded sequence, and those of a full forward of the
training model on the finished sequence (checked by the tests). Learned absolute position embeddings get
per-row positions (cumsum of the mask) through `position_ids`. Transformer Engine's attention ignores that mask
(its causal / no_mask kernels): on Megatron's path with TE layers the rows are batched by prompt length instead,
so no row is padded (`one_length_per_batch`).

Any generation TP: every rank of the generation TP group runs this same loop; logits are gathered over
the TP group (`runtime_gather_output`), and all ranks sample with one seed, so they draw the same tokens
with no extra communication. Pipeline parallelism at generation (p_g > 1) is not supported: p_g = 1.

record_routing (mixture-of-experts models): the experts every forward routed each token to are kept per
sequence (prompt and response positions; models/routing_replay.py), for the trainer to replay or compare.

Rows per chunk: rollout.max_batch_size; on a GPU fewer where its free memory holds fewer rows (each its KV cache
and its decode step's logits and sampling; `decode_rows`: KV_SHARE_OF_FREE of what is free at generate time,
agreed over the TP group), so a cap sized for a small model is not an out-of-memory for a large one. The memory
ledger counts the same rule.

Generation expert parallelism (e_g > 1, the model's expert-parallel group): each MoE layer sends tokens to the
replicas holding their experts, so the e_g replicas, each with its own prompts, must run the same forwards:
they agree on the number of batches (a replica out of rows decodes a one-token placeholder row, discarded),
on when every row has stopped, and on interrupts. One small all-reduce per check; nothing without experts.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch

from hybridrl.decode_memory import decode_row_bytes, decode_rows
from hybridrl.models.routing_replay import ExpertRouting
from hybridrl.rollout.base import (GeneratedSequence, Prompts, RolloutEngine, SamplingParams, assemble_batch,
                                   finish_reason, normalise_prompts, validate_prompts)
from hybridrl.rollout.fast_decode import FastForward, unsupported
from hybridrl.rollout.sampling import row_uniforms, sample_tokens

logger = logging.getLogger(__name__)

# Decode steps between checks that every row has stopped. The check is a host sync, which stalls a GPU's
# queue; on CPU it costs nothing while a late check costs whole decode steps.
_STOP_CHECK_EVERY = {"cuda": 4, "cpu": 1}
# Decode steps between asking whether a partial rollout is interrupted (new weights arrived); never before the
# first few tokens, so a generation always makes progress with the weights it started with.
_INTERRUPT_CHECK_EVERY = 4


def honours_attention_mask(gpt: Any) -> bool:
    """Whether every attention layer applies the engine's padding mask: Megatron's local DotProductAttention does;
    Transformer Engine's with the causal / no_mask types of its layer spec ignores a user mask (issue 36 item 7)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return all(isinstance(getattr(layer.self_attention, "core_attention", None), DotProductAttention)
               for layer in gpt.decoder.layers)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (they expose `.module`)."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


class _ChunkState:
    """One chunk's rows while they decode: tokens / is_real / positions [batch, prompt_len + max_new_tokens] (prompts
    left-padded), what was sampled so far, and the experts recorded per position (record_routing)."""

    def __init__(self, tokens: torch.Tensor, is_real: torch.Tensor, positions: torch.Tensor, prompt_len: int,
                 max_new_tokens: int, placeholder: bool) -> None:
        batch, dev = tokens.shape[0], tokens.device
        self.tokens, self.is_real, self.positions, self.prompt_len = tokens, is_real, positions, prompt_len
        self.finished = torch.full((batch,), placeholder, dtype=torch.bool, device=dev)
        self.log_probs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=dev)
        self.num_generated = torch.zeros(batch, dtype=torch.long, device=dev)
        self.routed: torch.Tensor | None = None


def _distinct_rows(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the first row of each distinct prompt, each row's index among them), or (None, None) when every row's
    prompt is distinct (nothing to share)."""
    seen: dict[tuple[int, ...], int] = {}
    first, index = [], []
    for row, ids in enumerate(rows):
        key = tuple(ids)
        if key not in seen:
            seen[key] = len(first)
            first.append(row)
        index.append(seen[key])
    if len(first) == len(rows):
        return None, None
    return torch.tensor(first, dtype=torch.long, device=device), torch.tensor(index, dtype=torch.long, device=device)


class NativeRolloutEngine(RolloutEngine):
    """Generate with a Megatron GPTModel already in generation layout (p_g = 1, any t_g).

    Args:
        model: the generation-layout model (possibly wrapped); its parameters are the live weights,
            so the hybrid engine can write into them in place.
        max_model_len: context length (prompt + response) the engine accepts.
        vocab_size: the real vocabulary (Megatron may pad the output layer; padded logits are dropped).
        max_batch_size: rows decoded together (fewer on a GPU whose free memory holds fewer: `decode_rows`);
            the KV cache holds that many x max_model_len.
        pad_token_id: filler for padding in the returned Batch (never attended to).
        record_routing: keep each token's experts (a mixture-of-experts model) in the Batch's
            "routed_experts".
        fast_forward: prefill and decode with rollout/fast_decode.py where it covers the model (else
            Megatron's own forward with its inference context).
    """

    def __init__(self, model: torch.nn.Module, *, max_model_len: int, vocab_size: int | None = None,
                 max_batch_size: int = 32, pad_token_id: int = 0, record_routing: bool = False,
                 fast_forward: bool = True) -> None:
        super().__init__()
        self.model = model
        gpt = _unwrap(model)
        if not (getattr(gpt, "pre_process", True) and getattr(gpt, "post_process", True)):
            raise ValueError("the native rollout engine needs the whole model on each rank (generation "
                             "pipeline size p_g = 1); set rollout.pp=1")
        self.vocab_size = int(vocab_size if vocab_size is not None else gpt.vocab_size)
        if max_model_len < 2:
            raise ValueError(f"rollout max_model_len must be >= 2, got {max_model_len}")
        if max_batch_size < 1:
            raise ValueError(f"rollout max_batch_size must be >= 1, got {max_batch_size}")
        self.max_model_len = int(max_model_len)
        self.max_batch_size = int(max_batch_size)
        self.pad_token_id = int(pad_token_id)
        pg_collection = getattr(gpt, "pg_collection", None)
        self.tp_group = getattr(pg_collection, "tp", None)
        ep_group = getattr(pg_collection, "ep", None) if getattr(gpt.config, "num_moe_experts", None) else None
        # the replicas whose MoE layers exchange tokens: they decode in lockstep (None: no one to wait for)
        self.ep_group = ep_group if ep_group is not None and torch.distributed.get_world_size(ep_group) > 1 else None
        self.device = next(gpt.parameters()).device
        self._context = None  # StaticInferenceContext, built lazily, dropped by release()
        self._fast = None
        if fast_forward:
            reason = unsupported(gpt)
            if reason is None:
                self._fast = FastForward(gpt, self.tp_group, self.max_model_len)
            else:
                logger.info("native engine: Megatron's forward (the lean one does not cover %s)", reason)
        # Transformer Engine's attention (causal / no_mask) ignores the padding mask: left-padded rows would attend
        # to their padding, so on Megatron's path with it every batch holds prompts of one length (no padding)
        self.one_length_per_batch = self._fast is None and not honours_attention_mask(gpt)
        if self.one_length_per_batch:
            logger.info("native engine: the attention ignores padding masks (Transformer Engine): prompts are batched "
                        "by length")
        self._row_steps = 0
        self.last_row_steps = 0  # rows x sampling steps the last generate_rows computed (finished rows leave)
        self.routing = None
        if record_routing:
            self.routing = ExpertRouting.of(gpt)
            if self.routing is None:
                raise ValueError("record_routing (rollout.record_routing / rollout.routing_replay) needs a "
                                 "mixture-of-experts model; this one has no experts")

    # ---- KV cache ----------------------------------------------------------------------------------
    def _inference_context(self, rows: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        if self._context is None or self._context.max_batch_size < rows:
            self._context = StaticInferenceContext(rows, self.max_model_len)
        self._context.reset()
        return self._context

    def kv_bytes_per_row(self) -> int:
        """One row's KV cache on this rank: keys and values of every layer over max_model_len positions."""
        gpt = _unwrap(self.model)
        config = gpt.config
        tp = torch.distributed.get_world_size(self.tp_group) if self.tp_group is not None else 1
        groups = (config.num_query_groups or config.num_attention_heads) // tp
        element = next(gpt.parameters()).element_size()
        return len(gpt.decoder.layers) * 2 * groups * config.kv_channels * self.max_model_len * element

    def chunk_rows(self) -> int:
        """Rows decoded together now: max_batch_size, on a GPU as many as its free memory holds (our own KV cache,
        about to be reused, counted as free); the same on every rank of the TP group."""
        if self.device.type != "cuda":
            return self.max_batch_size
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        row = decode_row_bytes(self.kv_bytes_per_row(), self.vocab_size)
        rows = decode_rows(self.max_batch_size, free + self.kv_cache_bytes(), row)
        if self.tp_group is not None and torch.distributed.get_world_size(self.tp_group) > 1:
            agreed = torch.tensor([rows], dtype=torch.long, device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
            rows = int(agreed.item())
        if rows < self.max_batch_size:
            logger.info("native engine: %d rows per chunk (rollout.max_batch_size %d): the KV cache and logits of more "
                        "do not fit in this GPU's free memory", rows, self.max_batch_size)
        return rows

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds right now (0 before the first generate and after release())."""
        caches = [] if self._context is None else list(self._context.key_value_memory_dict.values())
        caches += self._fast.cache if self._fast is not None else []
        return sum(t.numel() * t.element_size() for kv in caches for t in kv)

    def _sleep(self) -> None:
        """Free the KV cache (the attention layers re-allocate it on the next generate after wake()); the
        weights are the generation model's own (the hybrid engine fills them)."""
        self._context = None
        if self._fast is not None:
            self._fast.release()

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Copy (Megatron name, generation-shard tensor) pairs into the model in place.

        Called with no tensors when the hybrid engine has already written the generation parameters in
        place: then it only drops state computed with the old weights (the KV cache contents)."""
        if named_tensors is not None:
            params = dict(_unwrap(self.model).named_parameters())
            copied = 0
            with torch.no_grad():
                for name, tensor in named_tensors:
                    if name not in params:
                        raise KeyError(f"load_weights: no parameter {name!r} in the generation model")
                    if params[name].shape != tensor.shape:
                        raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, the generation "
                                         f"shard is {tuple(params[name].shape)}")
                    params[name].copy_(tensor)
                    copied += 1
            logger.debug("native engine: copied %d tensors", copied)
        if self._context is not None:
            self._context.reset()

    # ---- generation --------------------------------------------------------------------------------
    def _agree(self, value: int, op=None) -> int:
        """The generation expert-parallel replicas' common value (max by default); value itself without them."""
        if self.ep_group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(tensor, op=op or torch.distributed.ReduceOp.MAX, group=self.ep_group)
        return int(tensor.item())

    def _shared_seed(self, seed: int | None) -> int:
        """The seed every rank of the generation TP group samples with (drawn once when not given)."""
        if seed is not None:
            return int(seed)
        drawn = torch.randint(0, 2**31, (1,), dtype=torch.long, device=self.device)
        if self.tp_group is not None and torch.distributed.get_world_size(self.tp_group) > 1:
            torch.distributed.broadcast(drawn, src=torch.distributed.get_global_rank(self.tp_group, 0),
                                        group=self.tp_group)
        return int(drawn.item())

    @torch.no_grad()
    def generate(self, prompts: Prompts | Any, params: SamplingParams) -> Any:
        self._check_awake()
        prompt_ids = validate_prompts(normalise_prompts(prompts), self.max_model_len, params.max_new_tokens,
                                      self.vocab_size)
        rows = [ids for ids in prompt_ids for _ in range(params.n)]  # prompt-major, like repeat_interleave
        out = assemble_batch(self.generate_rows(rows, params), params, self.pad_token_id)
        out.meta["decode_row_steps"] = self.last_row_steps
        return out

    @torch.no_grad()
    def generate_rows(self, rows: list[list[int]], params: SamplingParams,
                      interrupt: Callable[[], bool] | None = None) -> list[GeneratedSequence]:
        """One sequence per row (already validated and expanded to params.n rows per prompt).

        `interrupt` (partial rollouts): asked every few decode steps, and on every rank of the generation TP
        group at the same steps; when it says True, the rows still running end with finish_reason
        "interrupted" (the rows not started yet too, with no tokens), to be resumed by the caller."""
        self._check_awake()
        self._row_steps = 0
        # One uniform per (row, step), fixed up front: rows are reproducible whatever the chunking.
        uniforms = None if params.is_greedy else row_uniforms(self._shared_seed(params.seed), len(rows),
                                                                params.max_new_tokens, self.device)
        was_training = self.model.training
        self.model.eval()
        if self.routing is not None:
            self.routing.set_mode("record")
        try:
            sequences: list[GeneratedSequence | None] = [None] * len(rows)
            interrupted = False
            batches = self._batches(rows, self.chunk_rows())
            for i in range(self._agree(len(batches))):
                if i >= len(batches):  # the other expert-parallel replicas still have rows: run with them
                    if not interrupted:
                        _, interrupted = self._generate_chunk([[self.pad_token_id]], params, None, interrupt,
                                                              placeholder=True)
                    continue
                picked = batches[i]
                if interrupted:
                    done = [GeneratedSequence(list(rows[r]), [], [], "interrupted") for r in picked]
                else:
                    done, interrupted = self._generate_chunk([rows[r] for r in picked], params,
                                                             None if uniforms is None else uniforms[picked], interrupt)
                for r, seq in zip(picked, done):
                    sequences[r] = seq
        finally:
            self.model.train(was_training)
            if self.routing is not None:
                self.routing.set_mode(None)
            self.last_row_steps = self._row_steps
        return sequences

    def _batches(self, rows: list[list[int]], size: int) -> list[list[int]]:
        """Row indices decoded together, at most `size` each: consecutive rows, or with `one_length_per_batch` rows
        of one prompt length (so no row is padded)."""
        if not self.one_length_per_batch:
            return [list(range(start, min(start + size, len(rows)))) for start in range(0, len(rows), size)]
        by_length: dict[int, list[int]] = {}
        for r, ids in enumerate(rows):
            by_length.setdefault(len(ids), []).append(r)
        return [group[start:start + size] for group in by_length.values() for start in range(0, len(group), size)]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, offset: int,
                 context) -> torch.Tensor:
        """Logits of the last position; allowed [B, 1, S, offset + S]: True where a query may see a key."""
        if self._fast is not None:
            logits = self._fast(tokens, positions, allowed, offset)
        else:  # Megatron masks where the mask is True
            logits = self.model(tokens, positions, ~allowed, inference_context=context, runtime_gather_output=True)
            context.sequence_len_offset += tokens.shape[1]
            logits = logits[:, -1]
        return logits[:, :self.vocab_size].float()

    def _drop_finished(self, live: slice | torch.Tensor, finished: torch.Tensor, batch: int) -> slice | torch.Tensor:
        """The decode batch without its finished rows (their KV-cache rows compacted away); unchanged when none
        finished. A host sync: called at the stop checks only."""
        running = ~finished[live]
        if bool(running.all()):
            return live
        self._fast.keep_rows(running.nonzero().squeeze(1))
        rows = torch.arange(batch, device=finished.device) if isinstance(live, slice) else live
        return rows[running]

    def _prompt_block(self, rows: list[list[int]], max_new_tokens: int) -> tuple[torch.Tensor, ...]:
        """tokens / is_real / positions [batch, prompt_len + max_new_tokens], prompts left-padded; prompt_len."""
        batch, dev = len(rows), self.device
        prompt_len = max(len(r) for r in rows)
        total_len = prompt_len + max_new_tokens
        tokens = torch.full((batch, total_len), self.pad_token_id, dtype=torch.long, device=dev)
        is_real = torch.zeros((batch, total_len), dtype=torch.bool, device=dev)
        for i, ids in enumerate(rows):
            tokens[i, prompt_len - len(ids):prompt_len] = torch.tensor(ids, dtype=torch.long)
            is_real[i, prompt_len - len(ids):prompt_len] = True
        positions = (is_real.long().cumsum(dim=1) - 1).clamp(min=0)
        return tokens, is_real, positions, prompt_len

    def _generate_chunk(self, rows: list[list[int]], params: SamplingParams, uniforms: torch.Tensor | None,
                        interrupt: Callable[[], bool] | None = None,
                        placeholder: bool = False) -> tuple[list[GeneratedSequence], bool]:
        """placeholder: a row that only keeps this replica's forwards in step with its expert-parallel peers
        (stopped from the start; its output is dropped)."""
        batch, dev = len(rows), self.device
        if placeholder and uniforms is None and not params.is_greedy:
            uniforms = torch.zeros((batch, params.max_new_tokens), dtype=torch.float64, device=dev)
        state = _ChunkState(*self._prompt_block(rows, params.max_new_tokens), params.max_new_tokens, placeholder)
        if self._fast is not None:
            context = None
            self._fast.reset(batch, next(_unwrap(self.model).parameters()).dtype, dev)
        else:
            context = self._inference_context(batch)
        if self.routing is not None:  # [batch, total_len, moe_layers, topk]: experts per input position
            state.routed = torch.full((batch, state.tokens.shape[1], self.routing.num_moe_layers, self.routing.topk),
                                      -1, dtype=torch.int16)
        logits = self._prefill(rows, state, context)
        interrupted = self._decode(logits, state, params, uniforms, interrupt, context)
        out = []
        for i, ids in enumerate(rows):
            count, start = int(state.num_generated[i]), state.prompt_len
            generated = state.tokens[i, start:start + count].tolist()
            reason = finish_reason(generated, params)
            out.append(GeneratedSequence(prompt=list(ids), tokens=generated,
                                         log_probs=state.log_probs[i, :count].tolist(),
                                         finish_reason="interrupted" if interrupted and reason == "length" else reason,
                                         routing=None if state.routed is None else
                                         state.routed[i, start - len(ids):start + count].clone()))
        return out, interrupted

    def _prefill(self, rows: list[list[int]], state: "_ChunkState", context) -> torch.Tensor:
        """All prompt positions at once; with the lean forward each distinct prompt once (its n samples share the
        prompt's keys / values, as a prefix cache would). Returns the last position's logits per row."""
        length, dev = state.prompt_len, self.device
        causal = torch.ones((length, length), dtype=torch.bool, device=dev).tril()
        allowed = causal.unsqueeze(0) & state.is_real[:, None, :length]
        first, index = _distinct_rows(rows, dev) if self._fast is not None and state.routed is None else (None, None)
        if first is not None:
            logits = self._forward(state.tokens[first, :length], state.positions[first, :length],
                                   allowed[first].unsqueeze(1), 0, context)[index]
            self._fast.share_prefix(index, length)
            return logits
        logits = self._forward(state.tokens[:, :length], state.positions[:, :length], allowed.unsqueeze(1), 0, context)
        if state.routed is not None:  # routers see tokens sequence-major: [prompt_len * batch, ...]
            state.routed[:, :length] = self.routing.take_recorded().view(length, len(rows), *state.routed.shape[2:]) \
                .transpose(0, 1).cpu()
        return logits

    def _decode(self, logits: torch.Tensor, state: "_ChunkState", params: SamplingParams,
                uniforms: torch.Tensor | None, interrupt: Callable[[], bool] | None, context) -> bool:
        """Sample max_new_tokens (or until every row stopped / an interrupt); returns whether interrupted. Rows that
        stop leave the decode batch (their cache rows compacted away) at the stop checks, so no forward computes on
        finished rows (lean forward without expert parallelism: the replicas' lockstep keeps their batches)."""
        dev, s = self.device, state
        stops = list(params.effective_stop_token_ids)
        stop_ids = torch.tensor(stops or [-1], dtype=torch.long, device=dev)
        live: slice | torch.Tensor = slice(None)  # the rows in the decode batch: all, or the indices still running
        compact = self._fast is not None and self.ep_group is None and bool(stops)
        check_every = _STOP_CHECK_EVERY.get(dev.type, 1)
        for step in range(params.max_new_tokens):
            pos = s.prompt_len + step
            drawn = None if uniforms is None else uniforms[live, step]
            new_tokens, new_log_probs = sample_tokens(logits, params, drawn)
            self._row_steps += len(new_tokens)
            active = ~s.finished[live]
            s.tokens[live, pos] = torch.where(active, new_tokens, self.pad_token_id)
            s.is_real[live, pos] = active
            s.log_probs[live, step] = torch.where(active, new_log_probs, 0.0)
            s.num_generated[live] += active.long()
            if stops:
                s.finished[live] |= active & torch.isin(new_tokens, stop_ids)
            if step == params.max_new_tokens - 1:
                return False
            # asking whether every row stopped is a host sync (a GPU stall): only every few steps, and never
            # without stop tokens; rows that stopped meanwhile are masked, so the result is the same
            if stops and step % check_every == 0 and \
                    self._agree(int(s.finished.all()), torch.distributed.ReduceOp.MIN):
                return False
            if interrupt is not None and step % _INTERRUPT_CHECK_EVERY == _INTERRUPT_CHECK_EVERY - 1 and \
                    self._agree(int(interrupt())):
                return True
            s.positions[live, pos] = s.positions[live, pos - 1] + 1
            if compact and step % check_every == 0:
                live = self._drop_finished(live, s.finished, len(s.finished))
            seen = s.is_real[live][:, None, None, :pos + 1]  # the new query sees every real key so far
            logits = self._forward(s.tokens[live, pos:pos + 1], s.positions[live, pos:pos + 1], seen, pos, context)
            if s.routed is not None:
                s.routed[live if isinstance(live, slice) else live.cpu(), pos] = self.routing.take_recorded().cpu()
        return False
