"""Nominal profiles: devices gradalg has not measured (spec sheets, or a modest CPU).

:data:`PRESETS` are data-centre GPUs by name (``"h200"``, ``"h100"``, ``"a100"``): numbers
from NVIDIA's spec sheets (not measured by gradalg) times stated sustained fractions, for
planning runs on hardware you do not have (``explain(device="h200")``), and the nominal
profile of a CUDA device that is not measured (:func:`gradalg.devices.accelerators.nominal_profile`,
by :func:`nominal_key`). :data:`UNMEASURED_CPU` prices displays on a machine whose CPU was
never measured.
"""
from __future__ import annotations

from .record import DeviceProfile

__all__ = ["PRESETS", "UNMEASURED_CPU", "nominal_key"]

_EFF = 0.6        # sustained fraction of a spec-sheet peak FLOP rate (assumed, not measured)
_BW_EFF = 0.8     # sustained fraction of a spec-sheet memory or link bandwidth (assumed)
_MEM_EFF = 0.9    # fraction of the memory left for tensors (CUDA context, allocator slack; assumed)
# curvature products through torch.func on a GPU: their fixed costs are the host's dispatch
# (this machine's CPU fit) and their work the CPU's measured multiple, both nominal (assumed,
# not measured on a GPU): a measured GPU profile (accelerators) measures them there
_GPU_FIXED = dict(call_seconds=1e-5, op_seconds=1e-5, batch_seconds=5e-4, layer_seconds=5e-5,
                  product_seconds=(4e-3, 1e-4), product_work=2.0)
PRESETS = {
    # Spec-sheet numbers of the SXM parts (NVIDIA data sheets; dense, i.e. without the 2:4
    # sparsity that doubles the headline tensor-core numbers), none measured by gradalg:
    #   H200: FP32 67 TFLOP/s (no tensor cores: torch's default for float32 matmuls),
    #         BF16 tensor core 989 TFLOP/s, HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s
    #         (both directions: 450 GB/s received per GPU)
    #   H100: FP32 67, BF16 989 TFLOP/s, HBM3 80 GB at 3.35 TB/s, NVLink 900 GB/s
    #   A100: FP32 19.5, BF16 312 TFLOP/s, HBM2e 80 GB at 2.0 TB/s, NVLink 600 GB/s
    # times the sustained fractions above; a module call, an op: a few kernel launches of
    # ~5 µs, asynchronous once the queue is full (assumed)
    "h200": DeviceProfile("H200", 67e12 * _EFF, 989e12 * _EFF, 4.8e12 * _BW_EFF, 141e9 * _MEM_EFF,
                          link_bandwidth=450e9 * _BW_EFF, **_GPU_FIXED),
    "h100": DeviceProfile("H100", 67e12 * _EFF, 989e12 * _EFF, 3.35e12 * _BW_EFF, 80e9 * _MEM_EFF,
                          link_bandwidth=450e9 * _BW_EFF, **_GPU_FIXED),
    "a100": DeviceProfile("A100", 19.5e12 * _EFF, 312e12 * _EFF, 2.0e12 * _BW_EFF, 80e9 * _MEM_EFF,
                          link_bandwidth=300e9 * _BW_EFF, **_GPU_FIXED),
}
"""Data-centre GPUs by name: spec-sheet peaks × 0.6 sustained, bandwidths × 0.8, memory ×
0.9 (assumed, not measured), 10 µs per module call and per op."""


def nominal_key(name: str) -> str:
    """The preset (``"h200"``, ``"h100"``, ``"a100"``) whose name is in a GPU's name; ``"a100"``
    for any other GPU (the slowest preset: an unknown GPU is not priced as a fast one)."""
    upper = name.upper()
    for key in ("h200", "h100", "a100"):
        if key.upper() in upper:
            return key
    return "a100"


UNMEASURED_CPU = DeviceProfile("cpu (not measured yet: ga.devices.local_profile() measures it)",
                               2e10, 2e10, 1e10, 8e9, measured=False)
"""A modest laptop core (20 GFLOP/s, 10 GB/s, 8 GB): displays before this machine was measured."""
