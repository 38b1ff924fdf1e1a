"""The rollout interface shared by every generation engine.

`RolloutEngine.generate(prompts, SamplingParams) -> Batch` returns, per sampled sequence (prompt-major:
the n samples of prompt 0 first, matching `Batch.repeat_interleave(n)`):
  "prompts"           [B, P]    left-padded prompt ids (pad_token_id)
  "responses"         [B, R]    right-padded response ids (the stop token, when hit, is included)
  "input_ids"         [B, P+R]  prompts ++ responses
  "attention_mask"    [B, P+R]  1 on real tokens
  "response_mask"     [B, R]    1 on generated tokens (the tokens trained on)
  "rollout_log_probs" [B, R]    log-prob of each sampled token under the distribution it was sampled
                                from (0 on padding); see `sampling.py` for the exact definition
  non-tensor "finish_reasons": "stop" | "length"; meta {"sampling": params as a dict}.
  "policy_versions"   [B, R]    only from partial rollouts (workers/rollout.py): the policy version that
                                generated each token (-1 on padding)
  "routed_experts"    [B, P+R, L, k]  only when the engine records routing (mixture-of-experts models): the
                                experts each input position was routed to in every MoE layer, int16, -1
                                where nothing was routed (padding, the last token); models/routing_replay.py

A multi-turn episode (rollout/multiturn.py) has the same layout: its "responses" hold every token after the
first prompt (model turns and the environment's observations, in order); "attention_mask" is 1 on all of
them, "response_mask" and "rollout_log_probs" only on the model's own tokens.

Generation stops only at `SamplingParams.stop_token_ids` (callers add the tokenizer's EOS there):
both engines ignore the model's own EOS so that they behave identically. `ignore_eos=True` disables the
stop tokens too, so every response has exactly max_new_tokens tokens (fixed-length benchmarks).
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from hybridrl.protocol import Batch

logger = logging.getLogger(__name__)

Prompts = Sequence[Sequence[int]]


class SamplingParamsError(ValueError):
    """Sampling parameters or prompts that no engine can honour."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses. `greedy=True` (or temperature 0) takes the argmax; top_k <= 0 and
    top_p == 1 disable those filters; `seed` makes sampling reproducible for the same prompts."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # generate exactly max_new_tokens: stop tokens are not honoured (benchmarks)

    def __post_init__(self) -> None:
        # Normalise lists (from YAML/OmegaConf) to a hashable tuple.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.n, int) or self.n < 1:
            raise SamplingParamsError(f"SamplingParams.n must be an integer >= 1 (samples per prompt), got {self.n!r}")
        if self.temperature < 0:
            raise SamplingParamsError(
                f"SamplingParams.temperature must be >= 0, got {self.temperature!r}; use 0 or greedy=True for argmax")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}; 1 disables it")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError(f"SamplingParams.top_k must be an integer >= -1, got {self.top_k!r}; "
                                      f"-1 or 0 disables it")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SamplingParamsError(f"SamplingParams.max_new_tokens must be an integer >= 1, "
                                      f"got {self.max_new_tokens!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(f"SamplingParams.stop_token_ids must be token ids >= 0, "
                                      f"got {list(self.stop_token_ids)}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    @property
    def effective_stop_token_ids(self) -> tuple[int, ...]:
        """The token ids that end a response (none with ignore_eos)."""
        return () if self.ignore_eos else self.stop_token_ids

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out


@dataclass(frozen=True)
class TokenIds:
    """The tokenizer's ids an engine needs: the padding id and the tokens that end a response."""

    pad: int = 0
    stops: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer: Any) -> "TokenIds":
        """The pad id (0 when the tokenizer has none) and its EOS as the stop token."""
        eos = tokenizer.eos_token_id
        return cls(tokenizer.pad_token_id or 0, () if eos is None else (int(eos),))


def validate_prompts(prompts: Prompts, max_model_len: int, max_new_tokens: int,
                     vocab_size: int | None = None) -> list[list[int]]:
    """Refuse prompts an engine cannot serve, before any work starts; return them as int lists."""
    if len(prompts) == 0:
        raise SamplingParamsError("generate() got no prompts; pass at least one list of token ids")
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise SamplingParamsError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(ids) + max_new_tokens > max_model_len:
            raise SamplingParamsError(
                f"prompt {i} has {len(ids)} tokens + max_new_tokens={max_new_tokens} > the context length "
                f"{max_model_len}; shorten the prompt, lower max_new_tokens or raise rollout.max_model_len")
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            raise SamplingParamsError(f"prompt {i} has token ids outside [0, {vocab_size}) (the model's vocabulary)")
        out.append(ids)
    return out


def prompts_from_batch(batch: Any) -> list[list[int]]:
    """Unpad the left-padded "input_ids" of a Batch (with its "attention_mask") into token-id lists."""
    input_ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(input_ids, mask)]


@dataclass
class GeneratedSequence:
    """One sampled response: its prompt, tokens, per-token log-probs and why it ended."""

    prompt: list[int]
    tokens: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" | "length"
    extra: dict[str, Any] = field(default_factory=dict)
    model_mask: list[int] | None = None  # per token: 1 generated, 0 context (an observation); None: all 1
    versions: list[int] | None = None  # per token: the policy version that generated it (partial rollouts)
    routing: torch.Tensor | None = None  # [len(prompt) + len(tokens), moe_layers, topk] experts (record_routing)


def finish_reason(tokens: Sequence[int], params: SamplingParams) -> str:
    return "stop" if tokens and tokens[-1] in params.effective_stop_token_ids else "length"


def assemble_batch(sequences: list[GeneratedSequence], params: SamplingParams, pad_token_id: int) -> Any:
    """Pack generated sequences into the Batch layout documented at the top of this module."""
    num = len(sequences)
    prompt_len = max(len(s.prompt) for s in sequences)
    response_len = max(max(len(s.tokens) for s in sequences), 1)
    prompts = torch.full((num, prompt_len), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((num, prompt_len), dtype=torch.long)
    responses = torch.full((num, response_len), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((num, response_len), dtype=torch.long)
    real = torch.zeros((num, response_len), dtype=torch.long)  # response tokens, generated or not
    log_probs = torch.zeros((num, response_len), dtype=torch.float32)
    for row, seq in enumerate(sequences):
        p, r = len(seq.prompt), len(seq.tokens)
        prompts[row, prompt_len - p:] = torch.tensor(seq.prompt, dtype=torch.long)
        prompt_mask[row, prompt_len - p:] = 1
        if r:
            responses[row, :r] = torch.tensor(seq.tokens, dtype=torch.long)
            real[row, :r] = 1
            response_mask[row, :r] = 1 if seq.model_mask is None else torch.tensor(seq.model_mask, dtype=torch.long)
            log_probs[row, :r] = torch.tensor(seq.log_probs, dtype=torch.float32)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, real], dim=1),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
    }
    if any(s.versions is not None for s in sequences):
        versions = torch.full((num, response_len), -1, dtype=torch.long)
        for row, seq in enumerate(sequences):
            if seq.tokens:
                versions[row, :len(seq.tokens)] = torch.tensor(seq.versions, dtype=torch.long)
        tensors["policy_versions"] = versions
    if any(s.routing is not None for s in sequences):
        shape = next(s.routing for s in sequences if s.routing is not None).shape[1:]
        routed = torch.full((num, prompt_len + response_len, *shape), -1, dtype=torch.int16)
        for row, seq in enumerate(sequences):
            if seq.routing is not None:
                p = len(seq.prompt)
                routed[row, prompt_len - p:prompt_len + len(seq.tokens)] = seq.routing
        tensors["routed_experts"] = routed
    return Batch(tensors, non_tensors={"finish_reasons": [s.finish_reason for s in sequences]},
                 meta={"sampling": params.to_dict()})


class EngineState(enum.Enum):
    """Where a rollout engine's memory is (see RolloutEngine)."""
    AWAKE = "awake"      # weights and KV cache resident: generate, take weights
    WEIGHTS = "weights"  # weights resident, KV cache released: take weights (the push between the two wakes)
    ASLEEP = "asleep"    # weights and KV cache released: nothing until woken


class EngineStateError(RuntimeError):
    """A call the engine's current state does not allow (generate while released, a push into a sleeping engine)."""


class RolloutEngine(abc.ABC):
    """A generation engine. Weights come from the hybrid engine through `load_weights`.

    Memory follows an explicit state machine, the same on CPU and GPU (on GPU a wrong order is an illegal
    memory access inside vLLM, on CPU sleep is a no-op: the states make the order an error everywhere):

        release()       any -> ASLEEP   KV cache freed; weights freed too where the engine can (vLLM's sleep)
        wake_weights()  ASLEEP -> WEIGHTS  weights' memory back (their values too, unless released_weights)
        load_weights()  WEIGHTS | AWAKE    new weights in place
        wake()          -> AWAKE        KV cache back (from ASLEEP it wakes the weights first)
        generate()      AWAKE, with current weights

    An engine whose release() discards the weights (`discards_weights`: vLLM sleep level 2) needs a push between
    wake_weights() and wake(); generating from discarded weights raises. Subclasses implement `_load_weights`,
    `_sleep`, `_wake_weights` and `_wake_cache`."""

    discards_weights = False  # release() drops the weights' values (a push must follow before generating)

    def __init__(self) -> None:
        self._state = EngineState.AWAKE
        self._weights_current = True

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def released(self) -> bool:
        return self._state is not EngineState.AWAKE

    def _check_awake(self) -> None:
        if self._state is not EngineState.AWAKE:
            raise EngineStateError(f"{type(self).__name__}.generate() called after release() (state "
                                   f"{self._state.value}); call wake() first")
        if not self._weights_current:
            raise EngineStateError(f"{type(self).__name__}.generate(): its weights were discarded by release(); "
                                   f"push weights (load_weights) between wake_weights() and wake()")

    @abc.abstractmethod
    def generate(self, prompts: Prompts | Any, params: SamplingParams) -> Any:
        """Sample `params.n` responses per prompt (token-id lists, or a Batch with left-padded
        "input_ids" + "attention_mask"); return a Batch (layout above)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Take new weights (in place); cached state computed with the old ones is dropped. Only while the
        weights are resident (WEIGHTS or AWAKE): a push into a sleeping engine raises."""
        self.check_weights_resident("load_weights()")
        self._load_weights(named_tensors)
        self._weights_current = True

    def check_weights_resident(self, what: str) -> None:
        """Raise unless the weights' memory is resident (WEIGHTS or AWAKE): anything written into the engine's
        weights (a push, a LoRA adapter swap) must wait for wake_weights()."""
        if self._state is EngineState.ASLEEP:
            raise EngineStateError(f"{type(self).__name__}.{what} into a sleeping engine (after release()): "
                                   f"call wake_weights() first, push, then wake()")

    @abc.abstractmethod
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        """The engine's own push (the state is checked by load_weights)."""

    def release(self) -> None:
        """Free the KV cache (and the weights' memory where the engine can) until wake_weights() / wake()."""
        if self._state is EngineState.ASLEEP:
            return
        self._sleep()
        self._state = EngineState.ASLEEP
        if self.discards_weights:
            self._weights_current = False

    def wake_weights(self) -> None:
        """The weights' memory back (ASLEEP -> WEIGHTS), ready for a push; the KV cache stays released."""
        if self._state is EngineState.ASLEEP:
            self._wake_weights()
            self._state = EngineState.WEIGHTS

    def wake(self) -> None:
        """Everything back (-> AWAKE): the weights first where they still sleep, then the KV cache."""
        self.wake_weights()
        if self._state is EngineState.WEIGHTS:
            self._wake_cache()
            self._state = EngineState.AWAKE

    def _sleep(self) -> None:
        """Free what release() frees (default: nothing to free)."""

    def _wake_weights(self) -> None:
        """Re-allocate the weights' memory (default: they never left)."""

    def _wake_cache(self) -> None:
        """Re-allocate the KV cache (default: allocated on the next generate)."""

    def close(self) -> None:
        """Free everything; the engine is unusable afterwards."""
        self.release()


def normalise_prompts(prompts: Prompts | Any) -> Prompts:
    if hasattr(prompts, "__getitem__") and not isinstance(prompts, (list, tuple)) and _is_batch(prompts):
        return prompts_from_batch(prompts)
    if isinstance(prompts, torch.Tensor):
        raise SamplingParamsError("pass prompts as lists of token ids (or a Batch with input_ids and "
                                  "attention_mask), not a bare tensor whose padding is ambiguous")
    return prompts


def _is_batch(obj: Any) -> bool:
    return isinstance(obj, Batch)


def concat_batches(batches: list[Any], pad_token_id: int) -> Any:
    """Rows of generated Batches (assemble_batch's layout) from separate generate calls or generation
    replicas, re-padded to the widest prompt (left) and response (right) among them. The first batch's meta
    is kept, less what is counted per call (timing, bytes, decode work)."""
    prompt_len = max(b["prompts"].shape[1] for b in batches)
    response_len = max(b["responses"].shape[1] for b in batches)
    meta = {k: v for k, v in batches[0].meta.items() if k not in ("timing", "reshard_recv_bytes", "decode_row_steps")}
    if len(batches) == 1:
        return Batch(dict(batches[0].tensors), dict(batches[0].non_tensors), meta)
    padded = []
    for b in batches:
        p, r = b["prompts"].shape[1], b["responses"].shape[1]
        left, right = prompt_len - p, response_len - r
        pad = torch.nn.functional.pad
        prompts = pad(b["prompts"], (left, 0), value=pad_token_id)
        responses = pad(b["responses"], (0, right), value=pad_token_id)
        tensors = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                   "attention_mask": torch.cat([pad(b["attention_mask"][:, :p], (left, 0), value=0),
                                                pad(b["attention_mask"][:, p:], (0, right), value=0)], 1),
                   "response_mask": pad(b["response_mask"], (0, right), value=0),
                   "rollout_log_probs": pad(b["rollout_log_probs"], (0, right), value=0.0)}
        if "policy_versions" in b.tensors:
            tensors["policy_versions"] = pad(b["policy_versions"], (0, right), value=-1)
        if "routed_experts" in b.tensors:  # [B, P+R, L, k]: pad dim 1 on both sides of the prompt/response cut
            routed = b["routed_experts"]
            tensors["routed_experts"] = torch.cat([pad(routed[:, :p], (0, 0, 0, 0, left, 0), value=-1),
                                                   pad(routed[:, p:], (0, 0, 0, 0, 0, right), value=-1)], 1)
        if set(b.tensors.keys()) != set(tensors):
            raise ValueError(f"concat_batches: unexpected fields {sorted(set(b.tensors.keys()) ^ set(tensors))}")
        padded.append(Batch(tensors, dict(b.non_tensors), meta))
    return Batch.concat(padded)
