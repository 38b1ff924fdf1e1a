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


def row_uniforms(seed: int, rows: int, steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows, steps] uniforms in [0, 1); row r comes from its own generator seeded `seed + r`, so a sample
    depends only on its seed and row, not on how rows are batched (and matches across TP ranks)."""
    out = torch.empty((rows, steps), dtype=torch.float64)
    for row in range(rows):
        out[row] = torch.rand(steps, generator=torch.Generator().manual_seed(seed + row), dtype=torch.float64)
    return out.to(device)


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [B, V] by inverting the CDF at `uniforms` [B] (ignored when
    greedy); return (tokens [B], their log-probs [B])."""
    log_probs = sampling_log_probs(logits, params)
    if params.is_greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        cdf = log_probs.double().exp().cumsum(dim=-1)
        target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
        # right=True: the first index whose CDF exceeds the target, never a zero-probability token
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=logits.size(-1) - 1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
