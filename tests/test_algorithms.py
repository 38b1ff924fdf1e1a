"""RL algorithms against hand-computed values (worked examples in the comments)."""
import math

import pytest
import torch

from hybridrl import algorithms as alg

T = torch.tensor


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=0)


# ---------------------------------------------------------------- masked helpers and aggregation


def test_masked_mean_var_whiten():
    x = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    m = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(alg.masked_mean(x, m), 7 / 3)  # (1 + 2 + 4) / 3
    close(alg.masked_mean(x, m, dim=-1), [1.5, 4.0, 0.0])  # all-padding row -> 0, not NaN
    # deviations -4/3, -1/3, 5/3 -> squares 42/9 -> / (3 - 1) = 7/3
    close(alg.masked_var(x, m), 7 / 3)
    close(alg.masked_var(x, m, unbiased=False), 14 / 9)
    whitened = alg.masked_whiten(x, m)
    std = math.sqrt(7 / 3)
    close(whitened, [[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0], [(4 - 7 / 3) / std, 0, 0], [0, 0, 0]])
    zeros = torch.zeros(2, 3)
    assert alg.masked_mean(x[:2], zeros) == 0 and not torch.isnan(alg.masked_whiten(x[:2], zeros)).any()


def test_aggregate_loss_modes():
    loss = T([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [99.0, 99.0, 99.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(alg.aggregate_loss(loss, mask, "token_mean"), 2.5)  # (1+2+3+4) / 4
    close(alg.aggregate_loss(loss, mask, "seq_mean_token_mean"), 3.0)  # (2 + 4) / 2; empty row ignored
    close(alg.aggregate_loss(loss, mask, "seq_mean_token_sum"), 5.0)  # (6 + 4) / 2
    close(alg.aggregate_loss(loss, mask, "seq_mean_token_sum_norm", norm_length=4), 10 / 12)  # / (3 rows x 4)
    with pytest.raises(ValueError, match="token_mean"):
        alg.aggregate_loss(loss, mask, "sum")
    with pytest.raises(ValueError, match="constant length"):
        alg.aggregate_loss(loss, mask, "seq_mean_token_sum_norm")


# ---------------------------------------------------------------- per-token quantities


def test_log_probs_entropy_and_kl_estimators():
    logits = torch.log(T([[0.5, 0.25, 0.25], [0.25, 0.25, 0.5]]))
    close(alg.log_probs_from_logits(logits, T([1, 2])), [math.log(0.25), math.log(0.5)])
    # uniform over 4: ln 4; (0.5, 0.25, 0.25): 1.5 ln 2; a near one-hot: ~0 (and finite)
    close(alg.entropy_from_logits(torch.zeros(4)), math.log(4))
    close(alg.entropy_from_logits(logits[0]), 1.5 * math.log(2))
    close(alg.entropy_from_logits(T([1000.0, 0.0])), 0.0)
    lp, ref = torch.log(T([0.5, 0.25])), torch.log(T([0.25, 0.5]))
    ln2 = math.log(2)  # log ratio = [+ln2, -ln2]
    close(alg.kl_penalty(lp, ref, "k1"), [ln2, -ln2])
    close(alg.kl_penalty(lp, ref, "k2"), [0.5 * ln2**2, 0.5 * ln2**2])
    close(alg.kl_penalty(lp, ref, "k3"), [0.5 - 1 + ln2, 2 - 1 - ln2])  # exp(-lr) - 1 + lr
    close(alg.kl_penalty(lp, ref, "low_var_kl"), [0.5 - 1 + ln2, 2 - 1 - ln2])
    close(alg.kl_penalty(lp, ref, "abs"), [ln2, ln2])
    with pytest.raises(ValueError, match="algorithm.kl.estimator"):
        alg.kl_penalty(lp, ref, "k4")
    close(alg.kl_loss(lp[None], ref[None], T([[1.0, 0.0]]), "k3"), 0.5 - 1 + ln2)


# ---------------------------------------------------------------- losses


def test_ppo_policy_loss_clip_and_dual_clip():
    # ratios 1.5, 0.5, 1.1, 3.0 (+ a padding token with ratio 100), advantages +1, +1, -1, -1
    log_prob = torch.log(T([[1.5, 0.5, 1.1, 3.0, 100.0]])).requires_grad_()
    old = torch.zeros(1, 5)
    adv = T([[1.0, 1.0, -1.0, -1.0, 5.0]])
    mask = T([[1.0, 1.0, 1.0, 1.0, 0.0]])
    # per token max(-A r, -A clip(r, .8, 1.2)): -1.2 (clipped), -0.5, 1.1, 3.0 -> mean 0.6
    loss, stats = alg.ppo_policy_loss(log_prob, old, adv, mask, clip_ratio=0.2)
    close(loss, 0.6)
    close(stats["clipfrac"], 0.25)
    close(stats["approx_kl"], -(math.log(1.5) + math.log(0.5) + math.log(1.1) + math.log(3.0)) / 4)
    loss.backward()
    # d/dlogp of -A r is -A r; zero where the clipped branch is active, / 4 tokens
    close(log_prob.grad, [[0.0, -0.5 / 4, 1.1 / 4, 3.0 / 4, 0.0]])
    # dual clip c = 2 bounds token 3 (A < 0) at -A c = 2: (-1.2 - 0.5 + 1.1 + 2.0) / 4
    log_prob.grad = None
    loss, stats = alg.ppo_policy_loss(log_prob, old, adv, mask, clip_ratio=0.2, dual_clip=2.0)
    close(loss, 0.35)
    close(stats["dual_clipfrac"], 0.25)
    loss.backward()
    close(log_prob.grad, [[0.0, -0.5 / 4, 1.1 / 4, 0.0, 0.0]])
    # asymmetric clip (clip-higher): upper bound 1.6 leaves token 0 unclipped: (-1.5 - 0.5 + 1.1 + 3) / 4
    loss, _ = alg.ppo_policy_loss(log_prob, old, adv, mask, clip_ratio=0.2, clip_ratio_high=0.6)
    close(loss, 0.525)
    with pytest.raises(ValueError, match="dual_clip"):
        alg.ppo_policy_loss(log_prob, old, adv, mask, dual_clip=0.5)
    empty, _ = alg.ppo_policy_loss(log_prob, old, adv, torch.zeros(1, 5))
    close(empty, 0.0)


def test_value_loss_clip():
    values = T([[1.0, 2.0, 0.0, 50.0]])
    old = T([[0.5, 2.1, 0.0, 0.0]])
    returns = T([[2.0, 1.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    # token 0: (1-2)^2 = 1 vs clipped V = 0.5 + 0.2 = 0.7 -> 1.69; token 1: 1 vs V = 2.0 -> 1; token 2: 1
    loss, stats = alg.value_loss(values, old, returns, mask, clip_range=0.2)
    close(loss, 0.5 * (1.69 + 1 + 1) / 3)
    close(stats["vf_clipfrac"], 1 / 3)
    loss, _ = alg.value_loss(values, old, returns, mask, clip_range=None)
    close(loss, 0.5)


def test_entropy_loss_masks_padding():
    logits = torch.stack([torch.zeros(4), torch.log(T([0.7, 0.1, 0.1, 0.1]))])[None]  # [1, 2, 4]
    close(alg.entropy_loss(logits, T([[1.0, 0.0]])), math.log(4))


# ---------------------------------------------------------------- advantages


def test_place_sequence_rewards_and_kl_penalty():
    mask = T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert alg.last_token_index(mask).tolist() == [1, -1, 2]
    rewards = alg.place_sequence_rewards(T([0.5, 1.0, 2.0]), mask)
    close(rewards, [[0, 0.5, 0], [0, 0, 0], [0, 0, 2.0]])
    kl = T([[0.1, 0.2, 7.0], [1.0, 1.0, 1.0], [0.0, 0.4, 0.2]])
    close(alg.apply_kl_penalty(rewards, kl, 0.5, mask), [[-0.05, 0.4, 0], [0, 0, 0], [0, -0.2, 1.9]])


def test_gae_hand_computed():
    gamma, lam = 0.9, 0.5
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [3.0, 3.0, 3.0]])
    values = T([[0.5, 0.6, 0.7], [1.0, 1.0, 9.0], [1.0, 1.0, 1.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # row 0: d2 = 1 - .7 = .3, A2 = .3; d1 = .9*.7 - .6 = .03, A1 = .03 + .45*.3 = .165;
    #        d0 = .9*.6 - .5 = .04, A0 = .04 + .45*.165 = .11425
    # row 1 (last token t=1, the padding value 9 is never used): A1 = 2 - 1 = 1; A0 = .9 - 1 + .45 = .35
    adv, ret = alg.gae(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    close(adv, [[0.11425, 0.165, 0.3], [0.35, 1.0, 0.0], [0, 0, 0]])
    close(ret, [[0.61425, 0.765, 1.0], [1.35, 2.0, 0.0], [0, 0, 0]])
    white, _ = alg.gae(rewards, values, mask, gamma=gamma, lam=lam, whiten=True)
    close(alg.masked_mean(white, mask), 0.0)
    close(alg.masked_var(white, mask), 1.0, tol=1e-4)
    # a hole in the mask (e.g. an observation span) is skipped: A0 = (0 + .7 - .5) + A2 = .2 + .3
    adv, _ = alg.gae(T([[0.0, 5.0, 1.0]]), T([[0.5, 9.0, 0.7]]), T([[1.0, 0.0, 1.0]]), 1.0, 1.0, whiten=False)
    close(adv, [[0.5, 0.0, 0.3]])


def test_grpo_and_rloo_groups_by_index():
    # interleaved groups: index 7 -> rows 0, 2, 4 (scores 1, 0, 1); 3 -> rows 1, 3 (0.5, 2); 11 -> row 5 alone
    scores = T([1.0, 0.5, 0.0, 2.0, 1.0, 7.0])
    index = T([7, 3, 7, 3, 7, 11])
    mask = torch.ones(6, 2)
    mask[4, 1] = 0
    # group 7: mean 2/3, unbiased std sqrt(1/3); group 3: mean 1.25, std sqrt(1.125) = 1.06066
    s7, s3 = math.sqrt(1 / 3), math.sqrt(1.125)
    expected = T([(1 / 3) / s7, -0.75 / s3, (-2 / 3) / s7, 0.75 / s3, (1 / 3) / s7, 0.0])
    adv, ret = alg.grpo_outcome(scores, mask, index)
    close(adv, expected[:, None] * mask)
    close(ret, adv)
    adv, _ = alg.grpo_outcome(scores, mask, index, norm_by_std=False)  # Dr. GRPO: mean-centred only
    close(adv[:, 0], [1 / 3, -0.75, -2 / 3, 0.75, 1 / 3, 0.0])
    # RLOO: r_i - mean of the others: 1 - .5, .5 - 2, 0 - 1, 2 - .5, 1 - .5, alone -> 0
    adv, _ = alg.rloo(scores, mask, index)
    close(adv, T([0.5, -1.5, -1.0, 1.5, 0.5, 0.0])[:, None] * mask)
    # identical scores in a group: zero advantage, no NaN
    adv, _ = alg.grpo_outcome(T([1.0, 1.0]), torch.ones(2, 3), T([0, 0]))
    close(adv, torch.zeros(2, 3))


def test_remax_with_and_without_kl_penalty():
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    scores, greedy = T([1.0, 0.2, 0.5]), T([0.4, 0.7, 0.9])
    rewards = alg.place_sequence_rewards(scores, mask)
    adv, ret = alg.remax(rewards, greedy, mask)
    close(adv, [[0.6, 0.6, 0.6], [-0.5, 0, 0], [0, 0, 0]])
    close(ret, [[1.0, 1.0, 1.0], [0.2, 0, 0], [0, 0, 0]])
    # KL penalty 0.5 * kl: row 0 token rewards -.05, -.1, .85 -> returns .7, .75, .85 -> minus .4
    kl = T([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0], [1.0, 1.0, 1.0]])
    penalised = alg.apply_kl_penalty(rewards, kl, 0.5, mask)
    adv, ret = alg.remax(penalised, greedy, mask)
    close(ret, [[0.7, 0.75, 0.85], [-0.05, 0, 0], [0, 0, 0]])
    close(adv, [[0.3, 0.35, 0.45], [-0.75, 0, 0], [0, 0, 0]])


def test_reinforce_plus_plus_returns_and_global_whitening():
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    token_rewards = T([[-0.05, -0.1, 0.85], [-0.05, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # returns .7, .75, .85 and -.05; mean 2.25 / 4 = .5625; unbiased var .511875 / 3 = .170625
    adv, ret = alg.reinforce_plus_plus(token_rewards, mask, gamma=1.0)
    close(ret, [[0.7, 0.75, 0.85], [-0.05, 0, 0], [0, 0, 0]])
    std = math.sqrt(0.170625)
    close(adv, [[0.1375 / std, 0.1875 / std, 0.2875 / std], [-0.6125 / std, 0, 0], [0, 0, 0]], tol=1e-4)
    # gamma .5: .85; -.1 + .5 * .85 = .325; -.05 + .5 * .325 = .1125
    _, ret = alg.reinforce_plus_plus(token_rewards, mask, gamma=0.5)
    close(ret[0], [0.1125, 0.325, 0.85])


def test_safe_rlhf_combination():
    mask = T([[1.0, 1.0, 0.0]])
    combined = alg.safe_rlhf_combine(T([[1.0, 2.0, 5.0]]), T([[0.5, -1.0, 5.0]]), 3.0, mask)
    close(combined, [[(1 - 1.5) / 4, (2 + 3) / 4, 0.0]])
    with pytest.raises(ValueError):
        alg.safe_rlhf_combine(T([[1.0]]), T([[1.0]]), -1.0, T([[1.0]]))


# ---------------------------------------------------------------- KL control and the Lagrange multiplier


def test_kl_controllers_and_state_dicts():
    fixed = alg.FixedKL(0.05)
    assert fixed.update(100.0) == 0.05
    adaptive = alg.AdaptiveKL(0.1, target=6.0, horizon=10)
    close(adaptive.update(9.0, n_steps=2), 0.1 * 1.04)  # error clipped to +0.2: 1 + .2 * 2 / 10
    close(adaptive.update(5.4), 0.104 * 0.99)  # error -0.1: 1 - .1 / 10
    restored = alg.build_kl_controller("adaptive", coef=1.0, target=1.0, horizon=1)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value and restored.target == 6.0 and restored.horizon == 10
    linear = alg.LinearDecayKL(0.1, 0.0, total_steps=4)
    values = [linear.value] + [linear.update(0.0) for _ in range(5)]
    close(values, [0.1, 0.075, 0.05, 0.025, 0.0, 0.0])
    cosine = alg.build_kl_controller("cosine", coef=1.0, final_coef=0.0, total_steps=4)
    close([cosine.update(0.0), cosine.update(0.0)], [0.5 + 0.5 * math.cos(math.pi / 4), 0.5])
    resumed = alg.build_kl_controller("linear", coef=0.1, final_coef=0.0, total_steps=4)
    half = alg.LinearDecayKL(0.1, 0.0, total_steps=4)
    half.update(0.0)
    resumed.load_state_dict(half.state_dict())
    close(resumed.update(0.0), 0.05)  # continues from step 1, not from 0
    with pytest.raises(ValueError, match="checkpoint"):
        fixed.load_state_dict(adaptive.state_dict())
    with pytest.raises(ValueError, match="algorithm.kl.type"):
        alg.build_kl_controller("exponential")
    with pytest.raises(ValueError, match="algorithm.kl.target"):
        alg.AdaptiveKL(0.1, target=0.0, horizon=10)


def test_lagrange_multiplier_updates():
    clamp = alg.LagrangeMultiplier(init=1.0, lr=0.5, cost_limit=0.2, parametrization="clamp")
    close(clamp.update(0.6), 1.2)  # 1 + .5 * (.6 - .2)
    close(clamp.update(0.0), 1.1)  # 1.2 + .5 * (0 - .2)
    close(clamp.update(-5.0), 0.0)  # 1.1 - 2.6 < 0 -> clamped at 0
    log = alg.LagrangeMultiplier(init=1.0, lr=0.5, cost_limit=0.2, parametrization="log")
    close(log.update(0.6), math.exp(0.2))  # log l = 0 + .5 * 1 * .4
    close(log.update(0.0), math.exp(0.2 - 0.5 * math.exp(0.2) * 0.2))
    copy = alg.LagrangeMultiplier(init=5.0, lr=0.1, parametrization="log")
    copy.load_state_dict(log.state_dict())
    assert copy.value == log.value and copy.cost_limit == 0.2
    capped = alg.LagrangeMultiplier(init=1.0, lr=10.0, cost_limit=0.0, parametrization="clamp", max_value=2.0)
    assert capped.update(1.0) == 2.0
    with pytest.raises(ValueError, match="lagrangian_init"):
        alg.LagrangeMultiplier(init=0.0, parametrization="log")


# ---------------------------------------------------------------- registry


def test_algorithm_registry_and_validation():
    assert {"remax", "ppo", "grpo", "rloo", "reinforce_pp", "safe_rlhf"} <= set(alg.ALGORITHMS)
    assert alg.ALGORITHMS["remax"].needs_greedy_baseline and not alg.ALGORITHMS["remax"].needs_critic
    assert alg.ALGORITHMS["ppo"].needs_critic and alg.ALGORITHMS["safe_rlhf"].needs_cost_model
    grpo = alg.ALGORITHMS["grpo"]
    assert (grpo.min_samples_per_prompt, grpo.default_kl_mode, grpo.default_kl_estimator) == (2, "loss", "k3")
    for name, spec in alg.ALGORITHMS.items():  # each estimator lives in its own catalog module
        assert spec.estimator.__module__.startswith("hybridrl.algorithms.catalog.") or name not in (
            "remax", "ppo", "grpo", "rloo", "reinforce_pp", "safe_rlhf"), name
    assert alg.validate_algorithm("grpo", samples_per_prompt=4).name == "grpo"
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        alg.validate_algorithm("rloo", samples_per_prompt=1)
    with pytest.raises(ValueError, match="cost_model.model or reward.cost_fn"):
        alg.validate_algorithm("safe_rlhf")
    with pytest.raises(ValueError, match="algorithm.name='dpo' is unknown; registered: .*grpo"):
        alg.get_algorithm("dpo")


def test_register_algorithm_adds_a_name_and_refuses_a_clash():
    from hybridrl.algorithms.registry import ALGORITHMS, register_algorithm

    @register_algorithm("test_mean_baseline", min_samples_per_prompt=2)
    def mean_baseline(x):
        a, r = alg.grpo_outcome(x.sequence_scores, x.mask, x.need("index", "groups"), norm_by_std=False)
        return alg.AdvantageResult(a, r, x.token_rewards)

    try:
        mask = torch.ones(4, 2)
        out = alg.compute_advantages("test_mean_baseline", T([1.0, 0.0, 3.0, 1.0]), mask, index=torch.tensor([0, 0, 1, 1]))
        # group means 0.5 and 2.0, no std: every token of a response carries its score minus its group's mean
        assert torch.allclose(out.advantages, T([[0.5, 0.5], [-0.5, -0.5], [1.0, 1.0], [-1.0, -1.0]]))
        with pytest.raises(ValueError, match="needs index: groups"):
            alg.compute_advantages("test_mean_baseline", T([1.0, 0.0, 3.0, 1.0]), mask)

        with pytest.raises(ValueError, match="already registered"):
            @register_algorithm("test_mean_baseline")
            def other(x):
                return mean_baseline(x)
        with pytest.raises(ValueError, match="default_kl_mode"):
            register_algorithm("test_bad_kl", default_kl_mode="penalty")(mean_baseline)
    finally:
        ALGORITHMS.pop("test_mean_baseline", None)


# ---------------------------------------------------------------- the trainer's entry point


def test_compute_advantages_dispatch():
    from hybridrl.algorithms.compute import compute_advantages

    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    kl = T([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0], [1.0, 1.0, 1.0]])
    # the same worked example as test_remax_with_and_without_kl_penalty
    out = compute_advantages("remax", T([1.0, 0.2, 0.5]), mask, kl=kl, kl_coef=0.5, baseline_scores=T([0.4, 0.7, 0.9]))
    close(out.advantages, [[0.3, 0.35, 0.45], [-0.75, 0, 0], [0, 0, 0]])
    close(out.token_rewards, [[-0.05, -0.1, 0.85], [-0.05, 0, 0], [0, 0, 0]])
    out = compute_advantages("reinforce_pp", T([1.0, 0.2, 0.5]), mask, kl=kl, kl_coef=0.5)
    close(out.returns, [[0.7, 0.75, 0.85], [-0.05, 0, 0], [0, 0, 0]])
    # group estimators score a response by its penalised sum: 1 - .5 * (.2 + .2) = .8 and 0;
    # mean .4, unbiased std sqrt(2 * .4^2 / 1) = sqrt(.32)
    pair_mask, pair_kl = torch.ones(2, 2), T([[0.2, 0.2], [0.0, 0.0]])
    out = compute_advantages("grpo", T([1.0, 0.0]), pair_mask, kl=pair_kl, kl_coef=0.5, index=T([0, 0]))
    close(out.advantages, [[0.4 / math.sqrt(0.32)] * 2, [-0.4 / math.sqrt(0.32)] * 2])
    out = compute_advantages("rloo", T([1.0, 0.0]), pair_mask, kl=pair_kl, kl_coef=0.5, index=T([0, 0]))
    close(out.advantages, [[0.8, 0.8], [-0.8, -0.8]])
    # PPO: the GAE worked example (rewards on the last tokens: 1 and 2), whitened
    gae_mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    values = T([[0.5, 0.6, 0.7], [1.0, 1.0, 9.0]])
    out = compute_advantages("ppo", T([1.0, 2.0]), gae_mask, values=values, gamma=0.9, lam=0.5)
    close(out.returns, [[0.61425, 0.765, 1.0], [1.35, 2.0, 0.0]])
    close(alg.masked_mean(out.advantages, gae_mask), 0.0)
    # Safe-RLHF, T = 1, gamma = lam = 1: reward A = [.5, -.5], cost A = [-.2, .8], lambda 1 ->
    # [.35, -.65] -> whitened (mean -.15, std sqrt(.5)) -> [1/sqrt2, -1/sqrt2]
    out = compute_advantages("safe_rlhf", T([1.0, 0.0]), torch.ones(2, 1), values=T([[0.5], [0.5]]),
                             cost_scores=T([0.0, 1.0]), cost_values=T([[0.2], [0.2]]), lagrange_multiplier=1.0,
                             gamma=1.0, lam=1.0)
    close(out.advantages, [[1 / math.sqrt(2)], [-1 / math.sqrt(2)]], tol=1e-4)
    close(out.returns, [[1.0], [0.0]])
    close(out.cost_returns, [[0.0], [1.0]])
    with pytest.raises(ValueError, match="'remax' needs baseline_scores"):
        compute_advantages("remax", T([1.0]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="'grpo' needs index"):
        compute_advantages("grpo", T([1.0]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="'safe_rlhf' needs cost_scores"):
        compute_advantages("safe_rlhf", T([1.0]), torch.ones(1, 2), values=torch.zeros(1, 2))
