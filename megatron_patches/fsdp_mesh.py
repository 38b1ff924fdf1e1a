"""Megatron-Core's wrapper of PyTorch FSDP2 on a CPU device mesh.

Upstream: megatron/core/distributed/torch_fully_sharded_data_parallel.py, TorchFullyShardedDataParallel.__init__
builds its data-parallel mesh as `DeviceMesh.from_group(self.process_group, "cuda")`. Without CUDA, FSDP2 then
fails to place the shards ("Torch not compiled with CUDA enabled" / CUDA device errors) although the gloo group
itself works. Fix: the module's `DeviceMesh` name answers `from_group(group, "cuda")` with a "cpu" mesh over
the same group; FSDP2 itself (torch.distributed.fsdp.fully_shard) runs unchanged on it (all-gathers and
reduce-scatters through gloo). Nothing else in Megatron-Core is touched.
Checked on megatron-core 0.16.1 with torch 2.13.0+cpu.
"""
from __future__ import annotations

from packaging.specifiers import SpecifierSet

from hybridrl.versions import MEGATRON_CORE, MEGATRON_CORE_CHECKED
from megatron_patches._base import replace

VERSIONS = SpecifierSet(MEGATRON_CORE)
CHECKED_ON = MEGATRON_CORE_CHECKED
UPSTREAM = "megatron/core/distributed/torch_fully_sharded_data_parallel.py: DeviceMesh.from_group(group, 'cuda')"


class CpuDeviceMesh:
    """Stands in for torch.distributed.DeviceMesh inside the wrapper's module: a CUDA mesh becomes a CPU one."""

    @staticmethod
    def from_group(group, device_type: str, *args, **kwargs):
        from torch.distributed import DeviceMesh

        return DeviceMesh.from_group(group, "cpu" if device_type.startswith("cuda") else device_type, *args,
                                     **kwargs)


def apply() -> None:
    from megatron.core.distributed import torch_fully_sharded_data_parallel as wrapper

    replace(wrapper, "DeviceMesh", CpuDeviceMesh)
