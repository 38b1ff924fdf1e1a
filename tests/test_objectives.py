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
