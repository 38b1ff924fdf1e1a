"""Disaggregated rollout (issue 16, first part): generation replicas on a pool of their own, their weights sent
shard to shard from the actor's training ranks over a gloo group spanning both pools (hybrid_engine/bridge.py)."""
from __future__ import annotations

import pytest
import torch

import hybridrl
from hybridrl.hybrid_engine.bridge import Transfer, bridge_plan
from hybridrl.parallel.layout import ParallelLayout

PROMPTS = ["vowels: qzk", "digits: xy", "vowels: b", "digits: mnop"]


def test_bridge_plan_sends_each_generation_rank_its_training_shards_once():
    train = ParallelLayout(tp=4, pp=2, dp=2)
    plan = bridge_plan(train, gen_tp=2, rollout_ranks=4)  # 2 generation replicas of t_g=2
    assert len(plan) == 4 * 2 * 2  # receivers x stages x (t / t_g) shards each
    for receiver in range(4):
        g = receiver % 2  # generation TP index within its replica
        mine = [t for t in plan if t.receiver == receiver]
        coords = [train.coords(t.sender) for t in mine]
        assert all(c.dp == 0 for c in coords)  # one training replica sends
        assert sorted((c.pp, c.tp) for c in coords) == [(p, tp) for p in range(2) for tp in (2 * g, 2 * g + 1)]
        assert [t.replicated for t in mine] == [True, False, True, False]  # norms once per stage
    assert Transfer(train.rank(pp=1, tp=3), 3, False) in plan
    with pytest.raises(ValueError, match="rollout.tp=3 must divide actor.parallel.tp=4"):
        bridge_plan(train, 3, 3)


def test_bridge_plan_sends_experts_from_the_ranks_that_hold_them():
    """Training EP=2 at TP=2 (DP rank b holds expert block b): with every expert on each generation rank (e_g=1)
    a t_g=1 rank takes dp rank 0's dense shards and experts and dp rank 1's experts; with e_g=2 the generation
    ranks of expert block 1 take their dense shards from dp rank 0 and their experts from dp rank 1 only."""
    train = ParallelLayout(tp=2, dp=2, ep=2, sequence_parallel=True)
    whole = [t for t in bridge_plan(train, gen_tp=1, rollout_ranks=2) if t.receiver == 1]
    assert [(train.coords(t.sender).dp, train.coords(t.sender).tp, t.dense, t.experts, t.replicated)
            for t in whole] == [(0, 0, True, True, True), (1, 0, False, True, False),
                                (0, 1, True, True, False), (1, 1, False, True, False)]
    split = bridge_plan(train, gen_tp=1, rollout_ranks=2, gen_ep=2)
    assert [(train.coords(t.sender).dp, t.dense, t.experts) for t in split if t.receiver == 0] == \
        [(0, True, True)] * 2
    assert [(train.coords(t.sender).dp, t.dense, t.experts) for t in split if t.receiver == 1] == \
        [(0, True, False), (1, False, True)] * 2
    with pytest.raises(ValueError, match="rollout.ep=3 must divide actor.parallel.ep=2"):
        bridge_plan(train, 1, 3, gen_ep=3)
    with pytest.raises(ValueError, match="expert_tp=1 differs from tp=2"):
        bridge_plan(ParallelLayout(tp=2, dp=1, ep=2, etp=1), 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"tp": 1, "pp": 2}], ids=["tp2", "pp2"])
def test_rollout_pool_gets_the_actors_weights_shard_to_shard(ray_four_devices, parallel):
    actor_pool = hybridrl.ResourcePool(devices=2, name="train")
    rollout_pool = hybridrl.ResourcePool(devices=2, name="gen")
    try:
        actor = hybridrl.Actor(parallel=parallel, rollout={"tp": 1, "max_new_tokens": 8, "n": 2},
                               resource_pool=actor_pool, optim={"optimizer": "sgd", "lr": 0.5, "clip_grad": 1e9,
                                                                "use_distributed_optimizer": False})
        replicas = hybridrl.RolloutReplicas(actor, rollout_pool, {"tp": 1})  # 2 replicas of t_g=1
        # before any sync both hold the HF folder's weights: the same greedy answers
        assert replicas.generate_sequences(PROMPTS, greedy=True).texts == \
            actor.generate_sequences(PROMPTS, greedy=True).texts

        out = actor.generate_sequences(PROMPTS, seed=3)
        actor.update(actions=out, advantages=torch.randn(len(out), generator=torch.Generator().manual_seed(0)))
        stale = replicas.generate_sequences(PROMPTS, seed=7)  # still the old weights: far from the updated policy
        assert ((actor.compute_log_probs(stale) - stale.log_probs) * stale.mask).abs().max() > 1e-2
        sent = replicas.sync()
        sampled = replicas.generate_sequences(PROMPTS, seed=7)  # takes the new weights first
        assert sampled.sequences.meta["policy_version"] == 1
        stats = replicas.sync_stats()
        assert stats["version"] == [1, 1]
        # each generation rank received exactly its generation shard (t_g=1: the whole model), nothing twice
        assert stats["received_bytes"] == stats["shard_bytes"] and sent["sent_bytes"] == sum(stats["received_bytes"])
        trained = actor.compute_log_probs(sampled)
        assert ((trained - sampled.log_probs) * sampled.mask).abs().max() < 1e-4  # the updated policy's
        assert replicas.generate_sequences(PROMPTS, greedy=True).texts == \
            actor.generate_sequences(PROMPTS, greedy=True).texts
    finally:
        rollout_pool.shutdown()
        actor_pool.shutdown()


@pytest.mark.slow
def test_partial_rollout_resumes_with_the_weights_sent_mid_generation(ray_four_devices):
    """rollout.partial: a sync sent while a generation runs is taken at once; each row's first tokens come from
    the weights it started with (version 0), the rest from the new ones (version 1), and every token's rollout
    log-prob is the one of the policy that sampled it. One replica of t_g=2: its TP ranks switch together."""
    actor_pool = hybridrl.ResourcePool(devices=2, name="train")
    rollout_pool = hybridrl.ResourcePool(devices=2, name="gen")
    try:
        actor = hybridrl.Actor(parallel={"tp": 2}, rollout={"tp": 2, "max_new_tokens": 8, "n": 2, "max_model_len": 512},
                               resource_pool=actor_pool, optim={"optimizer": "sgd", "lr": 0.5, "clip_grad": 1e9,
                                                                "use_distributed_optimizer": False})
        initial = hybridrl.ReferencePolicy(resource_pool=actor_pool, parallel={"tp": 2})
        replicas = hybridrl.RolloutReplicas(actor, rollout_pool, {"tp": 2, "partial": True})
        out = actor.generate_sequences(PROMPTS, seed=3)
        actor.update(actions=out, advantages=torch.randn(len(out), generator=torch.Generator().manual_seed(0)))
        # long enough that the sync (sent right after) lands while it runs; it starts with version 0 weights
        pending = replicas.submit(PROMPTS, [{"seed": 7, "max_new_tokens": 400, "ignore_eos": True}])
        replicas.sync()
        rollout = pending.result()[0]
        versions, mask = rollout.sequences["policy_versions"], rollout.mask.bool()
        assert rollout.sequences.meta["policy_version"] == 0
        assert mask.sum(-1).eq(400).all()  # every row resumed to its full length
        for row, real in zip(versions, mask):
            tokens = row[real]
            assert tokens[0] == 0 and tokens[-1] == 1 and (tokens.diff() >= 0).all(), tokens.unique_consecutive()
        new, old = versions.eq(1) & mask, versions.eq(0) & mask
        sampled = rollout.log_probs
        assert (actor.compute_log_probs(rollout) - sampled)[new].abs().max() < 1e-4  # the updated policy's
        assert (initial.get_log_probs(rollout) - sampled)[old].abs().max() < 1e-4  # the initial policy's
        assert (initial.get_log_probs(rollout) - sampled)[new].abs().max() > 1e-2  # the switch is real
        assert replicas.sync_stats()["version"] == [1, 1]
    finally:
        rollout_pool.shutdown()
        actor_pool.shutdown()


@pytest.mark.slow
def test_vllm_rollout_pool_generates_with_the_synced_weights(ray_four_devices, head_dim_32_model):
    """rollout.engine=vllm on a pool of its own: the bridge's shards go into the replica's model, then into vLLM
    under HF names; after a sync vLLM samples from the updated policy (its log-probs are the actor's)."""
    actor_pool = hybridrl.ResourcePool(devices=2, name="train")
    rollout_pool = hybridrl.ResourcePool(devices=1, name="gen")
    try:
        actor = hybridrl.Actor(model=head_dim_32_model, parallel={"tp": 2}, resource_pool=actor_pool,
                               rollout={"tp": 1, "max_new_tokens": 8, "n": 2, "max_model_len": 128},
                               optim={"optimizer": "sgd", "lr": 0.5, "clip_grad": 1e9,
                                      "use_distributed_optimizer": False})
        replicas = hybridrl.RolloutReplicas(actor, rollout_pool, {"tp": 1, "engine": "vllm"})
        assert replicas.generate_sequences(PROMPTS, greedy=True).texts == \
            actor.generate_sequences(PROMPTS, greedy=True).texts
        out = actor.generate_sequences(PROMPTS, seed=3)
        actor.update(actions=out, advantages=torch.randn(len(out), generator=torch.Generator().manual_seed(0)))
        stale = replicas.generate_sequences(PROMPTS, seed=7)
        assert ((actor.compute_log_probs(stale) - stale.log_probs) * stale.mask).abs().max() > 1e-2
        replicas.sync()
        sampled = replicas.generate_sequences(PROMPTS, seed=7)
        assert sampled.sequences.meta["policy_version"] == 1
        assert ((actor.compute_log_probs(sampled) - sampled.log_probs) * sampled.mask).abs().max() < 1e-4
        with pytest.raises(ValueError, match="rollout.partial=true"):
            hybridrl.RolloutReplicas(actor, rollout_pool, {"tp": 1, "engine": "vllm", "partial": True})
    finally:
        rollout_pool.shutdown()
        actor_pool.shutdown()
