"""Rollout / training mismatch: the metrics and the TIS / MIS weights against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms.rollout_correction import check_correction, correction_weights, mismatch_metrics

T = torch.tensor
# two responses: 3 tokens, and 1 token then padding
MASK = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ROLLOUT = T([[-1.0, -2.0, -0.5], [-0.1, 0.0, 0.0]])
TRAINER = T([[-1.5, -1.0, -0.5], [-0.1 + math.log(3.0), 0.0, 0.0]])  # log w = -0.5, 1, 0 | log 3


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(ROLLOUT, TRAINER, MASK)
    assert m["mismatch/log_prob_diff"].item() == pytest.approx((0.5 + 1.0 + 0.0 + math.log(3.0)) / 4)
    # k3 of KL(rollout || trainer) per token: exp(t - r) - 1 - (t - r)
    k3 = [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1.0, 0.0, 3.0 - 1 - math.log(3.0)]
    assert m["mismatch/kl"].item() == pytest.approx(sum(k3) / 4, rel=1e-6)
    same = mismatch_metrics(ROLLOUT, ROLLOUT, MASK)
    assert same["mismatch/log_prob_diff"].item() == 0.0 and same["mismatch/kl"].item() == 0.0


def test_token_level_tis_truncates_and_mis_masks_above_the_cap():
    w, frac = correction_weights(ROLLOUT, TRAINER, MASK, "tis", cap=2.0)
    expected = T([[math.exp(-0.5), 2.0, 1.0], [2.0, 0.0, 0.0]])  # e and 3 truncated at 2; padding 0
    assert torch.allclose(w, expected) and frac.item() == pytest.approx(2 / 4)
    w, frac = correction_weights(ROLLOUT, TRAINER, MASK, "mis", cap=2.0)
    assert torch.allclose(w, T([[math.exp(-0.5), 0.0, 1.0], [0.0, 0.0, 0.0]])) and frac.item() == pytest.approx(0.5)


def test_sequence_level_weights_use_the_product_over_the_response():
    # sequence 1: log w = -0.5 + 1 + 0 = 0.5 -> e^0.5 = 1.65 (under the cap); sequence 2: 3 (over it)
    w, frac = correction_weights(ROLLOUT, TRAINER, MASK, "tis", cap=2.0, level="sequence")
    assert torch.allclose(w, T([[math.exp(0.5)] * 3, [2.0, 0.0, 0.0]])) and frac.item() == pytest.approx(0.5)
    w, _ = correction_weights(ROLLOUT, TRAINER, MASK, "mis", cap=2.0, level="sequence")
    assert torch.allclose(w, T([[math.exp(0.5)] * 3, [0.0, 0.0, 0.0]]))
    # a length-1 response is its own sequence: token and sequence level agree
    one = T([[1.0, 0.0, 0.0]])
    a, _ = correction_weights(ROLLOUT[1:], TRAINER[1:], one, "tis", cap=5.0)
    b, _ = correction_weights(ROLLOUT[1:], TRAINER[1:], one, "tis", cap=5.0, level="sequence")
    assert torch.allclose(a, b) and a[0, 0].item() == pytest.approx(3.0)


def test_every_weight_over_the_cap_and_bad_settings():
    far = TRAINER + 10.0  # every ratio e^10 and more
    w, frac = correction_weights(ROLLOUT, far, MASK, "mis", cap=2.0)
    assert w.abs().sum().item() == 0.0 and frac.item() == 1.0
    w, frac = correction_weights(ROLLOUT, far, MASK, "tis", cap=2.0)
    assert torch.equal(w, 2.0 * MASK) and frac.item() == 1.0
    with pytest.raises(ValueError, match="rollout_correction='is' is unknown"):
        check_correction("is", 2.0, "token")
    with pytest.raises(ValueError, match="rollout_correction_level='batch'"):
        check_correction("tis", 2.0, "batch")
    with pytest.raises(ValueError, match="must be > 1"):
        check_correction("tis", 1.0, "token")


def test_actor_loss_with_tis_equals_the_loss_on_weighted_advantages():
    """In the worker's loss the weights scale the advantages: the same loss and gradient as feeding w * A."""
    from hybridrl.algorithms.losses import ppo_policy_loss

    torch.manual_seed(0)
    logp = torch.randn(2, 3, requires_grad=True)
    adv = torch.randn(2, 3) * MASK
    w, _ = correction_weights(ROLLOUT, TRAINER, MASK, "tis", cap=2.0)
    loss, _ = ppo_policy_loss(logp, logp.detach(), adv * w, MASK)
    (grad,) = torch.autograd.grad(loss, logp)
    # on-policy ratio 1: d/dlogp of -(w A ratio) averaged over the 4 real tokens
    assert torch.allclose(grad, -(w * adv) * MASK / 4, atol=1e-6)


# ---------------------------------------------------------------- GSPO and CISPO policy losses

def test_gspo_ratio_is_per_sequence_and_equals_the_sequence_objective():
    from hybridrl.algorithms.loss_agg import aggregate
    from hybridrl.algorithms.policy_losses import gspo_token_loss

    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    old = torch.zeros(2, 3)
    logp = T([[0.1, -0.2, 0.4], [0.5, 0.0, 0.0]], requires_grad=True)  # mean log r: 0.1 | 0.5
    adv = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    tokens, stats = gspo_token_loss(logp, old, adv, mask, clip_ratio=0.2)
    s1, s2 = math.exp(0.1), math.exp(0.5)  # s2 = 1.65 > 1.2 with A > 0: the whole sequence is clipped
    assert torch.allclose(tokens * mask, T([[-s1, -s1, -s1], [-1.2, 0.0, 0.0]]), atol=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    loss = aggregate(tokens, mask, "seq_mean_token_mean")
    (grad,) = torch.autograd.grad(loss, logp)
    # the sequence objective: mean over sequences of max(-A s, -A clip(s)), s = exp(mean log r)
    ref = logp.detach().clone().requires_grad_(True)
    s = torch.exp((ref * mask).sum(-1) / mask.sum(-1))
    a = T([1.0, 1.0])
    seq_loss = torch.maximum(-a * s, -a * s.clamp(0.8, 1.2)).mean()
    (ref_grad,) = torch.autograd.grad(seq_loss, ref)
    assert loss.item() == pytest.approx(seq_loss.item(), rel=1e-6)
    assert torch.allclose(grad * mask, ref_grad * mask, atol=1e-7)
    assert torch.allclose(grad[0], T([-s1 / 6] * 3), atol=1e-6) and grad[1].abs().sum() == 0  # clipped: no push


def test_gspo_on_a_length_one_response_is_ppo():
    from hybridrl.algorithms.losses import ppo_policy_token_loss
    from hybridrl.algorithms.policy_losses import gspo_token_loss

    mask, old, logp, adv = T([[1.0]]), T([[-1.0]]), T([[-0.9]]), T([[-2.0]])
    g, _ = gspo_token_loss(logp, old, adv, mask)
    p, _ = ppo_policy_token_loss(logp, old, adv, mask)
    assert torch.allclose(g, p)


def test_cispo_keeps_the_gradient_of_clipped_tokens_with_a_clipped_weight():
    from hybridrl.algorithms.losses import ppo_policy_token_loss
    from hybridrl.algorithms.policy_losses import cispo_token_loss

    mask = torch.ones(1, 3)
    old = torch.zeros(1, 3)
    logp = T([[0.0, 0.5, -0.5]], requires_grad=True)  # r = 1, 1.65, 0.61
    adv = torch.ones(1, 3)
    tokens, stats = cispo_token_loss(logp, old, adv, mask, clip_ratio=0.2, clip_ratio_high=0.28)
    w = T([[1.0, 1.28, 0.8]])
    assert torch.allclose(tokens, -w * logp.detach()) and stats["clipfrac"].item() == pytest.approx(2 / 3)
    (grad,) = torch.autograd.grad(tokens.mean(), logp)
    assert torch.allclose(grad, -w / 3)  # every token pushed, the clipped ones with the capped weight
    ppo, _ = ppo_policy_token_loss(logp, old, adv, mask, clip_ratio=0.2, clip_ratio_high=0.28)
    (ppo_grad,) = torch.autograd.grad(ppo.mean(), logp)
    assert ppo_grad[0, 1] == 0.0  # PPO drops the token whose ratio left the range
    # fully clipped ratios: every weight at a bound, the gradient still flows
    far, _ = cispo_token_loss(logp.detach() + 5.0, old, adv, mask, clip_ratio=0.2, clip_ratio_high=0.28)
    assert torch.allclose(far, -1.28 * (logp.detach() + 5.0))


# ---------------------------------------------------------------- Dr.GRPO's estimator

def test_dr_grpo_subtracts_the_group_mean_without_std_and_all_equal_groups_get_zero():
    from hybridrl.algorithms import compute_advantages

    mask = T([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    scores = T([1.0, 0.0, 0.7, 0.7])  # group 0: 1 and 0; group 1: all equal
    out = compute_advantages("dr_grpo", scores, mask, index=torch.tensor([0, 0, 1, 1]))
    assert torch.allclose(out.advantages, T([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    grpo = compute_advantages("grpo", scores, mask, index=torch.tensor([0, 0, 1, 1]))
    assert grpo.advantages[0, 0] > 0.5  # GRPO divides by the group's std (0.71): larger


# ---------------------------------------------------------------- DAPO: overlong shaping, dynamic sampling

def test_overlong_penalty_is_linear_over_the_buffer():
    from hybridrl.algorithms.shaping import overlong_penalty

    lengths = torch.tensor([10, 12, 13, 16])
    got = overlong_penalty(lengths, max_new_tokens=16, buffer=4, penalty=1.0)
    assert torch.allclose(got, T([0.0, 0.0, -0.25, -1.0]))
    assert torch.equal(overlong_penalty(lengths, 16, 0, 1.0), torch.zeros(4))


def _rollout(prompt_tokens: list[list[int]], responses: list[list[int]]):
    from hybridrl.api import Rollout
    from hybridrl.rollout.base import GeneratedSequence, assemble_batch
    from hybridrl.rollout.sampling import SamplingParams

    seqs = [GeneratedSequence(p, r, [-0.5] * len(r), "length") for p, r in zip(prompt_tokens, responses)]
    batch = assemble_batch(seqs, SamplingParams(max_new_tokens=4), 0)
    texts = [" ".join(map(str, r)) for r in responses]
    return Rollout(batch, texts, [str(p) for p in prompt_tokens], [{"i": str(p)} for p in prompt_tokens])


def test_dynamic_sampling_drops_all_equal_groups_and_refills():
    from hybridrl.trainer.dynamic_sampling import refill

    n = 2
    first = _rollout([[1], [1], [2, 2], [2, 2]], [[5], [6], [7, 7], [7, 7]])
    first_scores = T([1.0, 0.0, 0.5, 0.5])  # group 0 informative, group 1 all equal
    second = _rollout([[3, 3, 3], [3, 3, 3]], [[8, 8, 8, 8], [9]])  # wider prompt and response
    calls = []

    def more(round_):
        calls.append(round_)
        return second, T([0.2, 0.9])

    out, scores, metrics = refill(first, first_scores, n, max_rounds=3, more=more, pad_token_id=0)
    assert calls == [1]  # one round found the missing group
    assert torch.equal(scores, T([1.0, 0.0, 0.2, 0.9]))
    assert out.texts == ["5", "6", "8 8 8 8", "9"] and out.prompt_texts == ["[1]", "[1]", "[3, 3, 3]", "[3, 3, 3]"]
    seq = out.sequences
    assert seq["prompts"].shape == (4, 3) and seq["responses"].shape == (4, 4)
    assert seq["prompts"][0].tolist() == [0, 0, 1] and seq["responses"][0].tolist() == [5, 0, 0, 0]
    assert seq["response_mask"].sum(-1).tolist() == [1, 1, 4, 1]
    assert metrics == {"dynamic_sampling/informative_fraction": 0.5, "dynamic_sampling/refill_rounds": 1.0,
                       "dynamic_sampling/filled_uninformative": 0.0}


def test_dynamic_sampling_fills_with_dropped_groups_when_rounds_run_out():
    from hybridrl.trainer.dynamic_sampling import refill

    same = _rollout([[1], [1], [2], [2]], [[5], [5], [6], [6]])
    out, scores, metrics = refill(same, T([0.0, 0.0, 1.0, 1.0]), 2, max_rounds=2,
                                  more=lambda r: (same, T([0.3, 0.3, 0.3, 0.3])), pad_token_id=0)
    assert len(out.texts) == 4 and torch.equal(scores, T([0.0, 0.0, 1.0, 1.0]))  # the first batch's groups
    assert metrics["dynamic_sampling/refill_rounds"] == 2.0 and metrics["dynamic_sampling/filled_uninformative"] == 2.0
    kept, kept_scores, m = refill(same, T([1.0, 0.0, 1.0, 0.0]), 2, max_rounds=2, more=None, pad_token_id=0)
    assert kept is same and m["dynamic_sampling/refill_rounds"] == 0.0  # nothing to drop: no refill
