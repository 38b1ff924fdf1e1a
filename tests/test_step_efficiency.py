"""Step efficiency without giving up exactness.

- An update that is exactly on-policy takes its ratio against the detached log-probs of its own forward:
  loss and gradients equal the two-pass computation (a separate old-log-prob pass first).
- Token-budget micro-batches (sequences packed into shared rows, block-diagonal causal masks) give the same
  log-probs and values as one padded sequence per row, at TP=2 x PP=2.
- rollout ignore_eos generates exactly max_new_tokens.
"""
from __future__ import annotations

import pytest
import torch

from hybridrl.workers.policy import PolicyLossConfig, actor_loss_terms, response_log_probs

VOCAB = 11


def _micro_batch() -> tuple[dict, torch.Tensor]:
    """Two packed sequences sharing one row of width 8 (prompt 2 + response 2, prompt 1 + response 3)."""
    gen = torch.Generator().manual_seed(0)
    mb = {"input_ids": torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]]), "row_of": torch.tensor([0, 0]),
          "seq_start": torch.tensor([0, 4]), "prompt_lengths": torch.tensor([2, 1]),
          "response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]), "row_valid": torch.ones(2),
          "advantages": torch.randn(2, 3, generator=gen)}
    logits = torch.randn(1, 8, VOCAB, generator=gen)
    return mb, logits


def test_on_policy_update_equals_two_pass_loss_and_gradients():
    mb, logits = _micro_batch()
    cfg = PolicyLossConfig(clip_ratio=0.2, entropy_coef=0.01)
    one = logits.clone().requires_grad_(True)
    loss_one, count_one, _ = actor_loss_terms(dict(mb), one, VOCAB, None, cfg)
    loss_one.backward()
    with torch.no_grad():  # the separate pass: same weights, no grad
        old, _ = response_log_probs(mb, logits, VOCAB, None)
    two = logits.clone().requires_grad_(True)
    loss_two, count_two, _ = actor_loss_terms({**mb, "old_log_probs": old}, two, VOCAB, None, cfg)
    loss_two.backward()
    assert count_one == count_two == 5
    assert torch.equal(loss_one, loss_two)
    assert torch.allclose(one.grad, two.grad, atol=0.0, rtol=0.0)
    assert one.grad.abs().sum() > 0


def test_response_log_probs_read_each_sequence_of_a_shared_row():
    mb, logits = _micro_batch()
    got, _ = response_log_probs(mb, logits, VOCAB, None)
    log_softmax = logits[0].log_softmax(-1)
    # sequence 0: tokens 5, 6 predicted at columns 1, 2; sequence 1 (starts at 4): tokens 8, 9, 10 at 4, 5, 6
    expected = torch.stack([torch.stack([log_softmax[1, 5], log_softmax[2, 6], log_softmax[3, 7]]),
                            torch.stack([log_softmax[4, 8], log_softmax[5, 9], log_softmax[6, 10]])])
    mask = mb["response_mask"].bool()
    assert torch.allclose(got[mask], expected[mask], atol=1e-6)


PROMPTS = ["a", "vowels: qzktbcdfgh", "b", "vowels: rk", "c", "vowels: lfkpmnrst", "d", "e"]


@pytest.mark.slow
def test_packed_micro_batches_equal_padded_rows_at_tp2_pp2(ray_four_devices):
    import hybridrl

    pool = hybridrl.ResourcePool(devices=4)
    try:
        parallel = {"tp": 2, "pp": 2}
        padded = dict(max_tokens_per_micro_batch=None, micro_batch_size=3)
        packed = dict(max_tokens_per_micro_batch=64)  # rows of the longest sequence; short ones share a row
        actor = hybridrl.Actor(parallel=parallel, rollout={"tp": 1, "max_new_tokens": 6}, resource_pool=pool,
                               **padded)
        ref = hybridrl.ReferencePolicy(resource_pool=pool, **packed)
        critic_rows = hybridrl.Critic(resource_pool=pool, **padded)
        critic_packed = hybridrl.Critic(resource_pool=pool, role="critic_packed", **packed)
        out = actor.generate_sequences(PROMPTS, seed=5, n=2)
        fixed = actor.generate_sequences(PROMPTS, seed=5, ignore_eos=True)
        rows_log_probs = actor.compute_log_probs(out)
        packed_log_probs = ref.get_log_probs(out)
        rows_values = critic_rows.compute_values(out)
        packed_values = critic_packed.compute_values(out)
    finally:
        pool.shutdown()
    lengths = out.sequences["attention_mask"].sum(-1)
    assert 2 * lengths.min() <= lengths.max()  # the short sequences share rows of the longest one's width
    assert (rows_log_probs - packed_log_probs).abs().max() <= 1e-5
    assert (rows_values - packed_values).abs().max() <= 1e-5
    assert rows_values.abs().sum() > 0 and rows_log_probs.abs().sum() > 0
    # ignore_eos: exactly max_new_tokens on every row, none ends with a stop
    assert fixed.mask.sum(-1).tolist() == [6.0] * len(PROMPTS)
    assert set(fixed.finish_reasons) == {"length"}


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                  "seq_mean_token_sum_norm"])
def test_loss_aggregation_is_exact_across_micro_batches(mode):
    """Every algorithm.loss_agg mode: the step's sum(weighted loss) / units over two one-sequence micro-batches
    equals the same over the shared row, and both equal the pure aggregate of the per-token loss (loss and
    gradient)."""
    from hybridrl.algorithms import loss_agg
    from hybridrl.algorithms.losses import aggregate_loss, ppo_policy_token_loss
    from hybridrl.workers.policy import response_mask

    mb, logits = _micro_batch()
    cfg = PolicyLossConfig(loss_agg=mode, loss_agg_length=5)

    def step_loss(mbs, views):  # what MegatronModel.train_step minimises
        terms = [actor_loss_terms(m, v, VOCAB, None, cfg)[0] for m, v in zip(mbs, views)]
        units = sum(loss_agg.units(response_mask(m), mode, 5, rows=m["row_valid"]) for m in mbs)
        return sum(terms) / units

    whole = logits.clone().requires_grad_(True)
    loss_whole = step_loss([mb], [whole])
    loss_whole.backward()
    split = logits.clone().requires_grad_(True)
    halves = [{"input_ids": mb["input_ids"][:, :4], "row_of": torch.tensor([0]), "seq_start": torch.tensor([0]),
               "prompt_lengths": mb["prompt_lengths"][:1], "response_mask": mb["response_mask"][:1],
               "row_valid": torch.ones(1), "advantages": mb["advantages"][:1]},
              {"input_ids": mb["input_ids"][:, 4:], "row_of": torch.tensor([0]), "seq_start": torch.tensor([0]),
               "prompt_lengths": mb["prompt_lengths"][1:], "response_mask": mb["response_mask"][1:],
               "row_valid": torch.ones(1), "advantages": mb["advantages"][1:]}]
    loss_split = step_loss(halves, [split[:, :4], split[:, 4:]])
    loss_split.backward()
    with torch.no_grad():
        log_probs, _ = response_log_probs(mb, logits, VOCAB, None)
        tokens, _ = ppo_policy_token_loss(log_probs, log_probs, mb["advantages"], mb["response_mask"])
        expected = aggregate_loss(tokens, mb["response_mask"], mode, norm_length=5)
    assert torch.allclose(loss_whole, expected, atol=1e-6) and torch.allclose(loss_split, expected, atol=1e-6)
    assert torch.allclose(whole.grad, split.grad, atol=1e-7) and whole.grad.abs().sum() > 0
