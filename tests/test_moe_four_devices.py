"""Mixture-of-experts jobs that need four devices (issue 15); tests/test_moe.py's trainer tests use two.

- Expert TP above TP: expert_tp=2 at TP=1 with EP=2, where an expert's two TP halves sit on ranks of different
  DP replicas (the model-level checks, logits, grads, routing and the hybrid engine's regroup, are in
  tests/test_moe.py on its 4-rank gloo pool; here the actor runs end to end).
- A rollout pool of its own for an expert-parallel actor: the bridge sends each generation rank the experts of
  the training DP ranks that hold them.
"""
from __future__ import annotations

import math

import pytest

from test_moe import check_expert_parallel_update


@pytest.mark.slow
def test_expert_tp_above_tp_actor_update_equals_pytorch_reference(ray_four_devices, tmp_path):
    """Generation regroups each expert from its two halves into the dense TP=1 layout (the rollout's log-probs
    equal the trainer's), and one SGD update moves every weight by exactly transformers' gradient: the experts'
    halves reduce over their own expert-data-parallel group, not the DP group."""
    check_expert_parallel_update({"tp": 1, "ep": 2, "expert_tp": 2}, 4, tmp_path)


@pytest.mark.slow
def test_expert_parallel_actor_on_a_rollout_pool_of_its_own(ray_four_devices):
    """grpo_moe_tiny (EP=2 on 2 devices) generating on a pool of 2 more, with every expert on each replica
    (e_g = 1: each generation rank takes expert block b from training DP rank b) and with rollout.ep=2 (each
    replica one block, the two decoding in lockstep): three steps, the second and third on synced weights,
    equal the colocated job's. Before the bridge knew experts the e_g = 1 job failed at its first sync (the
    replicas got only DP rank 0's experts)."""
    from test_trainer_e2e import run_steps

    pool = ["trainer.steps=3", "resources.pools.gen=2", "rollout.pool=gen"]
    _, colocated = run_steps(["trainer.steps=3"], "grpo_moe_tiny.yaml")
    for extra in ([], ["rollout.ep=2"]):
        _, history = run_steps(pool + extra, "grpo_moe_tiny.yaml")
        assert len(history) == 3
        for a, b in zip(history, colocated):
            assert a["mismatch/log_prob_diff"] < 1e-5, extra
            for key in ("reward_mean", "response_length_mean", "actor/pg_loss"):
                assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (extra, key)
