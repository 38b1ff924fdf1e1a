"""The machines the device-mapping search plans for: GPU presets and a CPU model calibrated on the spot.

GPU numbers are datasheet values (dense bf16 FLOP/s without sparsity, HBM capacity and bandwidth, NVLink
per GPU) plus stated efficiencies; none of them was measured by this project. The inter-node default is
HybridFlow's testbed for the A100 (200 Gb/s per node) and one 400 Gb/s InfiniBand NIC per GPU for the
H100 / H200 (3200 Gb/s per node). `cpu_calibrated()` times a matmul (FLOP/s of one core), a memcpy (memory
bandwidth) and a chain of tiny ops (the per-op overhead that dominates tiny models on CPU).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

GiB = 1 << 30


@dataclass(frozen=True)
class Accelerator:
    """One device kind and the links between devices. Bandwidths in bytes/s, times in seconds."""
    name: str
    peak_flops: float            # dense FLOP/s of one device at the training dtype
    memory_bytes: float          # device memory
    memory_bw: float             # device memory bandwidth
    intra_node_bw: float         # per device, inside a node (NVLink; gloo over loopback on CPU)
    inter_node_bw: float         # per NODE, shared by its devices (InfiniBand)
    gpus_per_node: int = 8
    mfu: float = 0.5             # achieved fraction of peak_flops by large GEMMs (training, prefill)
    bw_efficiency: float = 0.8   # achieved fraction of memory_bw by decode (weights + KV cache reads)
    half_rows: int = 128         # a GEMM with this many rows (tokens) reaches half of mfu ("batch effect")
    collective_latency: float = 15e-6  # per collective inside a node (NCCL small-message all-reduce)
    inter_node_latency: float = 30e-6  # per collective crossing nodes
    layer_overhead: float = 5e-6  # launch / framework time per layer per forward of one micro-batch
    memory_reserve_bytes: float = 4 * GiB  # CUDA context, NCCL buffers, allocator fragmentation
    shared_cores: int | None = None  # CPU: devices are processes sharing this many cores; None on GPUs
    param_bytes: int = 2         # parameter / activation dtype (bf16 on GPUs, fp32 on CPU)
    mixed_precision: bool = True  # fp32 master weights + Adam (12 B/param) vs plain fp32 Adam (8 B/param)

    def with_network(self, gpus_per_node: int | None = None, inter_node_gbps: float | None = None) -> "Accelerator":
        """The same device with another node size or inter-node link (Gb/s per node)."""
        out = self
        if gpus_per_node is not None:
            out = replace(out, gpus_per_node=gpus_per_node)
        if inter_node_gbps is not None:
            out = replace(out, inter_node_bw=inter_node_gbps * 1e9 / 8)
        return out

    def describe(self) -> str:
        return (f"{self.name}: {self.peak_flops / 1e12:.3g} TFLOP/s, {self.memory_bytes / GiB:.0f} GiB at "
                f"{self.memory_bw / 1e12:.3g} TB/s, {self.gpus_per_node}/node, intra-node "
                f"{self.intra_node_bw / 1e9:.3g} GB/s per device, inter-node {self.inter_node_bw * 8 / 1e9:.4g} Gb/s "
                f"per node")


GPUS: dict[str, Accelerator] = {
    # A100-SXM4-80GB: 312 TFLOP/s bf16, 2.039 TB/s HBM2e, NVLink3 600 GB/s; HybridFlow's 200 Gb/s per node
    "a100-80g": Accelerator("a100-80g", peak_flops=312e12, memory_bytes=80 * GiB, memory_bw=2.039e12,
                            intra_node_bw=600e9, inter_node_bw=200e9 / 8),
    # H100-SXM5-80GB: 989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink4 900 GB/s; 8 x 400 Gb/s NDR per node
    "h100": Accelerator("h100", peak_flops=989e12, memory_bytes=80 * GiB, memory_bw=3.35e12,
                        intra_node_bw=900e9, inter_node_bw=3200e9 / 8),
    # H200-SXM-141GB: H100 compute, 141 GB (nvidia-smi: 143771 MiB) HBM3e at 4.8 TB/s
    "h200": Accelerator("h200", peak_flops=989e12, memory_bytes=143771 * (1 << 20), memory_bw=4.8e12,
                        intra_node_bw=900e9, inter_node_bw=3200e9 / 8),
}


def gpu(name: str) -> Accelerator:
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r} is unknown; choose one of {', '.join(GPUS)}")
    return GPUS[key]


def detect_gpu(devices_per_node: int) -> Accelerator:
    """The preset of the CUDA device this process sees (by its name), with this node's device count."""
    import torch

    name = torch.cuda.get_device_name(0).lower()
    for key, marker in (("h200", "h200"), ("h100", "h100"), ("a100-80g", "a100")):
        if marker in name:
            if key == "a100-80g" and torch.cuda.get_device_properties(0).total_memory < 60 * GiB:
                break  # A100-40GB: not a preset
            return GPUS[key].with_network(gpus_per_node=devices_per_node)
    raise ValueError(f"resources.auto_map: no cost model for GPU {torch.cuda.get_device_name(0)!r} (presets: "
                     f"{', '.join(GPUS)}); set resources.auto_map=false and choose the layouts by hand")


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _tiny_layer_forward():
    """A forward of one real decoder layer (transformers' Llama, hidden 64, 16 tokens): its time is almost all
    per-op framework overhead, which is what a tiny model's step is made of on CPU."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=64)
    config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(config, 0)
    x = torch.randn(1, 16, 64)
    position = LlamaRotaryEmbedding(config)(x, torch.arange(16)[None])

    def forward() -> None:
        with torch.no_grad():
            layer(x, position_embeddings=position)

    forward()  # warm-up
    return forward


def cpu_calibrated(devices: int, cores: int | None = None, repeats: int = 5) -> Accelerator:
    """A CPU "device" model from a short calibration (well under a second once torch and transformers are
    imported) on this machine: one-core matmul FLOP/s, memcpy bandwidth, the time of one tiny decoder layer.

    Devices are Ray worker processes sharing `cores` cores; each runs with cores // devices intra-op
    threads (hybridrl.controller.worker), so the calibration runs on one thread. Memory per device is an
    even share of half of the machine's RAM. Collectives are gloo over loopback TCP: latency and bandwidth
    are assumed, not timed: 200 us and 0.5 GB/s (a 64 MB gloo all-reduce over 4 Ray workers on one machine
    was measured at 0.2 s).
    """
    import torch

    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        flops = 2 * n ** 3 / _best_time(lambda: torch.mm(a, b), repeats)
        src = torch.empty(16 << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        bandwidth = 2 * src.numel() / _best_time(lambda: dst.copy_(src), repeats)  # read + write
        layer_overhead = _best_time(_tiny_layer_forward(), repeats)
    finally:
        torch.set_num_threads(threads)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 16 * GiB
    return Accelerator(
        name=f"cpu ({cores} cores, {devices} devices)", peak_flops=flops, memory_bytes=ram / 2 / max(devices, 1),
        memory_bw=bandwidth, intra_node_bw=0.5e9, inter_node_bw=0.5e9, gpus_per_node=max(devices, 1), mfu=1.0,
        bw_efficiency=1.0, half_rows=64, collective_latency=200e-6, inter_node_latency=200e-6,
        layer_overhead=layer_overhead, memory_reserve_bytes=0.5 * GiB, shared_cores=cores, param_bytes=4,
        mixed_precision=False)
