"""GPU presets: the few numbers the cost model needs (peak matmul rate, memory, links).

Peak rates are dense BF16 tensor-core figures from NVIDIA's data sheets; the achieved fraction
is `efficiency` (model-FLOPs utilisation), the one knob that turns FLOPs into milliseconds.
Bandwidths are per GPU and per direction, in GB/s (1e9 bytes per second).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_omnibal.models.presets import named_preset


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its interconnect."""

    name: str
    peak_tflops: float  # dense BF16
    memory_gib: float  # usable device memory as nvidia-smi reports it
    nvlink_gbs: float  # intra-node, per direction
    network_gbs: float  # inter-node, per GPU, per direction
    gpus_per_node: int = 8
    efficiency: float = 0.5  # achieved fraction of peak on transformer layers
    reserve_gib: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    p2p_latency_ms: float = 0.02  # per pipeline send/recv, on top of bytes / bandwidth
    op_overhead_ms: float = 0.01  # per layer and pass: kernel launches, small ops

    def to_dict(self) -> dict:
        return asdict(self)


HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 data sheet (SXM4): 312 TFLOPS dense BF16, 40 GB HBM2 (nvidia-smi: 40960 MiB),
    # NVLink 3 600 GB/s bidirectional; DGX A100: 8x HDR 200 Gb/s InfiniBand, one per GPU.
    "A100-40G": Hardware("A100-40G", 312.0, 40.0, 300.0, 25.0),
    # Same chip with 80 GB HBM2e (nvidia-smi: 81920 MiB).
    "A100-80G": Hardware("A100-80G", 312.0, 80.0, 300.0, 25.0),
    # NVIDIA H100 SXM5 data sheet: 989 TFLOPS dense BF16, 80 GB HBM3 (nvidia-smi: 81559 MiB),
    # NVLink 4 900 GB/s bidirectional; DGX H100: 8x NDR 400 Gb/s per node, one per GPU.
    "H100-80G": Hardware("H100-80G", 989.0, 79.6, 450.0, 50.0),
    # NVIDIA H200 SXM data sheet: same compute as H100, 141 GB HBM3e (nvidia-smi: 143771 MiB).
    "H200": Hardware("H200", 989.0, 140.4, 450.0, 50.0),
}


def get_hardware(name: str) -> Hardware:
    """The preset `name`, or a clear error listing the known ones."""
    return named_preset(HARDWARE, name, "hardware", "or give a JSON/YAML file describing the GPU")
