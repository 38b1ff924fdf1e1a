"""The per-token policy-gradient losses, an open registry: an algorithm names one (AlgorithmSpec.policy_loss).

A loss is registered by name, `@register_policy_loss(name)`, on a function
    (log_prob, old_log_prob, advantages, mask, clip_ratio, clip_ratio_high, **options) -> (loss [B, T], stats)
taking log-probs under the current policy (with gradient), pi_old's (detached), advantages and the mask,
all [B, T]; algorithm.loss_agg then reduces the tokens. stats holds scalar tensors, at least "clipfrac" and
"approx_kl"; each reaches the metrics as actor/<key>. Options (dual_clip) reach only a loss that names them.
A user's loss lives in the module named by algorithm.module; the actor's workers import that module
(get_policy_loss) when the name is not registered in their process yet.
  ppo    clipped ratio per token: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) (losses.py)
  gspo   one ratio per sequence, s = exp(mean over its tokens of log r) (Zheng et al. 2025), clipped per
         sequence. Written per token as s_t = sg(s) * exp(logp_t - sg(logp_t)): its value is s and its
         gradient s * grad logp_t, so with seq_mean_token_mean the sum is exactly the sequence objective's.
  cispo  REINFORCE with a clipped, stop-gradient importance weight (MiniMax-M1, 2025):
         -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp_t: every token keeps a gradient, clipped or not.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import lru_cache

import torch

from hybridrl.algorithms.losses import masked_mean, ppo_policy_token_loss
from hybridrl.registry import Registry, import_user_module

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSS_REGISTRY = Registry("policy loss", "@register_policy_loss in the module named by algorithm.module")
REQUIRED_STATS = ("clipfrac", "approx_kl")
RESERVED_STATS = ("pg_loss", "entropy", "kl_loss")  # the actor's own metrics (workers/policy.py)


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register the decorated per-token loss as policy loss `name` (an algorithm's policy_loss).
    A name registered twice by different code is refused."""
    def decorate(loss: PolicyLoss) -> PolicyLoss:
        POLICY_LOSS_REGISTRY.add(name, loss, loss)
        return loss
    return decorate


def policy_loss_names() -> list[str]:
    """The registered policy losses, sorted."""
    return sorted(POLICY_LOSS_REGISTRY)


def get_policy_loss(name: str, module: str | None = None) -> PolicyLoss:
    """The loss registered as `name`; when it is not (yet), import `module` (algorithm.module: a Ray worker
    has not imported the user's module the driver did) and look again."""
    if name not in POLICY_LOSS_REGISTRY and module:
        import_user_module(module)
    where = f" (module {module!r} does not register it)" if module else " (no algorithm.module registers it)"
    return POLICY_LOSS_REGISTRY.lookup(name, where=where)


@lru_cache(maxsize=None)
def _accepted_options(loss: PolicyLoss) -> frozenset[str] | None:
    """Keyword options a loss takes beyond the common six (None: any, it has **options)."""
    params = list(inspect.signature(loss).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params[6:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_policy_loss(name: str, module: str | None = None, **options) -> PolicyLoss:
    """The registered loss, after refusing an option it does not take (options set to None are off)."""
    loss = get_policy_loss(name, module)
    accepted = _accepted_options(loss)
    for key, value in options.items():
        if value is not None and accepted is not None and key not in accepted:
            raise ValueError(f"{key} does not apply to the {name!r} policy loss (it takes "
                             f"{', '.join(sorted(accepted)) or 'no options'}); leave {key} unset")
    return loss


def _bounds(clip_ratio: float, clip_ratio_high: float | None) -> tuple[float, float]:
    return 1.0 - clip_ratio, 1.0 + (clip_ratio if clip_ratio_high is None else clip_ratio_high)


register_policy_loss("ppo")(ppo_policy_token_loss)  # defined with the other PPO losses (losses.py)


@register_policy_loss("gspo")
def gspo_token_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_high: float | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = mask.float()
    log_ratio = (log_prob - old_log_prob) * mask
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    token_ratio = torch.exp((seq_log_ratio.detach() + log_prob - log_prob.detach()).clamp(-20.0, 20.0))
    low, high = _bounds(clip_ratio, clip_ratio_high)
    unclipped = -advantages * token_ratio
    clipped = -advantages * torch.clamp(token_ratio, low, high)
    loss = torch.maximum(unclipped, clipped)
    has_tokens = (mask.sum(-1) > 0).float()
    clipped_seq = ((clipped > unclipped).float() * mask).amax(-1)  # a sequence is clipped as a whole
    return loss, {"clipfrac": masked_mean(clipped_seq, has_tokens).detach(),
                  "approx_kl": masked_mean(-(log_prob - old_log_prob).detach(), mask)}


@register_policy_loss("cispo")
def cispo_token_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_high: float | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_ratio = (log_prob - old_log_prob).detach().clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    low, high = _bounds(clip_ratio, clip_ratio_high)
    weight = ratio.clamp(low, high)
    loss = -weight * advantages * log_prob
    return loss, {"clipfrac": masked_mean((weight != ratio).float(), mask),
                  "approx_kl": masked_mean(-log_ratio, mask)}


def policy_token_loss(name: str, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
                      dual_clip: float | None = None, module: str | None = None, **options
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss per token [B, T], stats) of the policy loss registered as `name` (imported from `module` if need be)."""
    options = {k: v for k, v in {"dual_clip": dual_clip, **options}.items() if v is not None}
    loss = check_policy_loss(name, module, **options)
    tokens, stats = loss(log_prob, old_log_prob, advantages, mask, clip_ratio, clip_ratio_high, **options)
    _check_stats(name, tokens, log_prob, stats)
    return tokens, stats


def _check_stats(name: str, tokens: torch.Tensor, log_prob: torch.Tensor, stats: dict) -> None:
    # a user's loss fails here with its name, not deep in the metric reduction of the train step
    if tokens.shape != log_prob.shape:
        raise ValueError(f"policy loss {name!r} returned a loss of shape {tuple(tokens.shape)}; it must be per "
                         f"token, {tuple(log_prob.shape)}")
    missing = [k for k in REQUIRED_STATS if k not in stats]
    if missing:
        raise ValueError(f"policy loss {name!r} must report stats {missing} (scalar tensors)")
    bad = [k for k, v in stats.items() if k in RESERVED_STATS or torch.as_tensor(v).numel() != 1]
    if bad:
        raise ValueError(f"policy loss {name!r}: stats {bad} must be scalars, named other than "
                         f"{', '.join(RESERVED_STATS)} (the actor's own metrics)")
