"""Token sampling for the native engine, written once in torch.

The reported log-prob of a sampled token is its log-prob under the distribution it was actually drawn
from (what RL's importance ratios need):
  * greedy:   log_softmax(logits)                        (the raw model distribution)
  * sampling: log_softmax(filter(logits / temperature))  where filter keeps the top_k logits, then the
              smallest set of tokens whose probability mass reaches top_p, and sets the rest to -inf,
              so top-k/top-p DO renormalise the distribution.
This is exactly vLLM's `logprobs_mode="processed_logprobs"` (the vLLM engine is built with it), so both
engines report the same quantity; at temperature 1 without top-k/top-p it is the training model's
log_softmax(logits).
"""
from __future__ import annotations

import torch

from hybridrl.rollout.base import SamplingParams


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k then top-p remove, in vLLM's order and with its tie rule."""
    vocab = logits.size(-1)
    if 0 < top_k < vocab:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs [..., V] of the distribution tokens are drawn from (see module docstring)."""
    logits = logits.float()
    if params.is_greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    return torch.log_softmax(logits, dim=-1)


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [B, V]; return (tokens [B], their log-probs [B])."""
    log_probs = sampling_log_probs(logits, params)
    if params.is_greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
