import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="module")
def dist_pool():
    """Factory for long-lived gloo pools, one per world size, shared by the tests of a module."""
    from dist_harness import DistPool

    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in pools:
            pools[world_size] = DistPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


def _local_ray(num_devices: int):
    """A private local Ray cluster with `num_devices` fake GPUs for one test module (none left running)."""
    from hybridrl.controller import init_local_ray, shutdown_ray

    shutdown_ray()
    init_local_ray(num_devices)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def ray_two_devices():
    yield from _local_ray(2)


@pytest.fixture(scope="module")
def ray_four_devices():
    yield from _local_ray(4)


@pytest.fixture(scope="module")
def llama_8_heads(tmp_path_factory):
    """A tiny HF Llama (4 layers, 8 heads, 4 KV heads) whose heads and layers split over TP/PP up to 4 and 8."""
    from hybridrl.models.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("llama8") / "llama", "llama", layers=4, heads=8, kv_heads=4)


@pytest.fixture(scope="module")
def llama_8_heads_logits(llama_8_heads):
    """(input_ids [2, 12], transformers' logits of llama_8_heads on them)."""
    import torch

    from hybridrl.models.reference import hf_reference

    input_ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    return input_ids, hf_reference(llama_8_heads, input_ids).logits
