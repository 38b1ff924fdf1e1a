"""Expert TP above TP (issue 15): expert_tp=2 at TP=1 with EP=2 on four devices, where an expert's two TP halves
sit on ranks of different DP replicas. The model-level checks (logits, grads, routing, the hybrid engine's
regroup) are in tests/test_moe.py on its 4-rank gloo pool; this module runs the actor end to end on a Ray
cluster of four devices (test_moe's trainer tests use two)."""
from __future__ import annotations

import pytest

from test_moe import check_expert_parallel_update


@pytest.mark.slow
def test_expert_tp_above_tp_actor_update_equals_pytorch_reference(ray_four_devices, tmp_path):
    """Generation regroups each expert from its two halves into the dense TP=1 layout (the rollout's log-probs
    equal the trainer's), and one SGD update moves every weight by exactly transformers' gradient: the experts'
    halves reduce over their own expert-data-parallel group, not the DP group."""
    check_expert_parallel_update({"tp": 1, "ep": 2, "expert_tp": 2}, 4, tmp_path)
