"""Profiles of the CUDA device a model is on: measured once and cached, or nominal by name.

A model whose parameters are on ``cuda:i`` is planned with :func:`cuda_profile`:

1. the profile measured on that device before (the disk cache of
   :mod:`gradalg.plan.devices`, keyed by host, device name, torch version and the cost
   model's version);
2. else, when measuring is allowed (an executor about to run, and ``ga.options(measure_devices=True)``,
   the default),
   :func:`measure_profile` on the device (well under a second on a data-centre GPU),
   cached;
3. else, or when measuring fails, :func:`nominal_profile`: the spec-sheet preset
   (:data:`gradalg.plan.devices.PRESETS`) whose name is in ``torch.cuda.get_device_name``
   (H200, H100, A100; an unknown GPU gets the A100's numbers, the slowest preset), with the
   device's own memory, named ``"NVIDIA H100 80GB HBM3 (cuda:0, nominal H100 spec
   sheet: ...)"`` so that ``explain()`` says it was not measured.

:func:`measure_profile` times, on the device and synchronized, float32 GEMMs of a few
square sizes (``GPU_GEMM_SIZES``), a bfloat16 GEMM of the largest, batched float32
products (``GPU_BMM_SIZES``), float64 ``eigh`` (``GPU_EIGH_SIZES``; Kronecker factors are
decomposed on their device), a copy (bandwidth), a GELU forward and backward
(elementwise bandwidth), and the fixed costs of a module call, a small op and a captured
batch (kernel launches and Python: the CPU's measurements of :mod:`gradalg.plan.devices`
with this module's synchronized timer). Random numbers are drawn
by torch's CPU generator on every device: that rate is the CPU profile's.
"""
from __future__ import annotations

import platform
from dataclasses import replace

import torch

from .devices import (_MEM_EFF, PRESETS, PROFILE_VERSION, DeviceProfile, _fastest, _measure_bmm_call, _measure_bmms, _measure_call,
                      _measure_capture, _measure_copy, _measure_eighs, _measure_elementwise, _measure_gemms, _measure_op,
                      _measure_sjlt, _measure_tensorsketch, _measure_tensorsketch_flat, _with_products,
                      cached_local_profile, host_memory, read_cached, write_cached)

__all__ = ["cuda_profile", "nominal_profile", "measure_profile", "nominal_key", "GPU_GEMM_SIZES",
           "GPU_BMM_SIZES", "GPU_EIGH_SIZES"]

GPU_GEMM_SIZES = (256, 1024, 4096)
GPU_BMM_SIZES = (16, 64, 256)
GPU_EIGH_SIZES = (64, 256, 1024)
_FAILED: dict = {}    # {device name: why its measurement failed} in this process


def _index(index: int | None) -> int:
    return torch.cuda.current_device() if index is None else int(index)


def _cuda_key(name: str) -> str:
    return f"{platform.node()}|cuda|{name}|torch{torch.__version__}|cost-model{PROFILE_VERSION}"


def nominal_key(name: str) -> str:
    """The preset (``"h200"``, ``"h100"``, ``"a100"``) whose name is in a GPU's name; ``"a100"``
    for any other GPU (the slowest preset: an unknown GPU is not priced as a fast one)."""
    upper = name.upper()
    for key in ("h200", "h100", "a100"):
        if key.upper() in upper:
            return key
    return "a100"


def nominal_profile(index: int | None = None, reason: str = "not measured") -> DeviceProfile:
    """The spec-sheet profile of ``cuda:index`` by its name, with its own memory, labelled nominal."""
    index = _index(index)
    name = torch.cuda.get_device_name(index)
    key = nominal_key(name)
    preset = PRESETS[key]
    memory = preset.memory
    try:
        memory = torch.cuda.get_device_properties(index).total_memory * _MEM_EFF
    except Exception:   # a device that cannot be queried keeps the spec sheet's memory
        pass
    known = "" if key.upper() in name.upper() else f", not a preset: priced as an {preset.name}"
    return replace(preset, name=f"{name} (cuda:{index}, nominal {preset.name} spec sheet{known}; {reason})",
                   memory=memory, measured=False)


def cuda_profile(index: int | None = None, *, measure: bool = True) -> DeviceProfile:
    """The profile of ``cuda:index`` (module docstring: cached, measured, or nominal)."""
    index = _index(index)
    name = torch.cuda.get_device_name(index)
    cached = read_cached(_cuda_key(name))
    if cached is not None:
        return cached
    if not measure:
        return nominal_profile(index, "not measured: a display, or ga.options(measure_devices=False)")
    if name in _FAILED:
        return nominal_profile(index, _FAILED[name])
    try:
        prof = measure_profile(torch.device("cuda", index))
    except Exception as err:   # a busy, broken or out-of-memory device: price it by its name
        _FAILED[name] = f"measuring failed: {type(err).__name__}: {err}"[:200]   # not retried in this process
        return nominal_profile(index, _FAILED[name])
    write_cached(_cuda_key(name), prof)
    return prof


def _timer(device: torch.device):
    """``median_seconds(fn, seconds)``: the median wall time of ``fn`` on ``device``,
    synchronized after each call, over ``seconds`` of repetitions (at least 3), after one
    warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def median_seconds(fn, seconds: float, least: int = 3) -> float:
        fn()
        sync()
        return _fastest(fn, seconds, least, sync)

    return median_seconds


def measure_profile(device: torch.device, *, gemm_sizes=GPU_GEMM_SIZES, bmm_sizes=GPU_BMM_SIZES,
                    eigh_sizes=GPU_EIGH_SIZES, copy_bytes: int = 256 * 2**20, batch_elements: int = 2**24,
                    seconds: float = 0.05) -> DeviceProfile:
    """Measure ``device``'s speeds (module docstring). Any device torch runs on; the sizes
    are small enough for a GPU's fraction of a second, and smaller ones test it on a CPU."""
    device = torch.device(device)
    timed = _timer(device)
    gemm_rates = _measure_gemms(gemm_sizes, timed, device, seconds)
    bf16 = _measure_gemms(gemm_sizes[-1:], timed, device, seconds, torch.bfloat16)[0][1]
    bmm_rates = _measure_bmms(bmm_sizes, timed, device, seconds, batch_elements)
    bmm_call = _measure_bmm_call(timed, device, seconds)
    eigh_times = _measure_eighs(eigh_sizes, timed, device, seconds, least=2)
    bandwidth = _measure_copy(timed, device, copy_bytes, seconds)
    elementwise = _measure_elementwise(timed, device, max(copy_bytes // 64, 2**10), seconds)
    call = _measure_call(timed, device, seconds)
    op = _measure_op(timed, device, seconds)
    batch, layer = _measure_capture(call, timed, device, seconds)
    sjlt = _measure_sjlt(elementwise, timed, device, seconds)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else str(device)
    memory = torch.cuda.get_device_properties(device).total_memory * _MEM_EFF if cuda else host_memory()
    prof = DeviceProfile(f"{name} ({device}, measured)", gemm_rates[-1][1], max(bf16, gemm_rates[-1][1]),
                         bandwidth, memory, measured=True, call_seconds=call, op_seconds=op,
                         batch_seconds=batch, layer_seconds=layer, elementwise_bandwidth=elementwise,
                         fault_bandwidth=0.0, gemm_rates=gemm_rates, bmm_rates=bmm_rates,
                         bmm_call_seconds=bmm_call, eigh_times=eigh_times,
                         random_seconds=cached_local_profile().random_seconds, sjlt_bytes=sjlt,
                         sjlt_build_randoms=cached_local_profile().sjlt_build_randoms,   # tables are drawn on the CPU
                         ts_bytes_per_bin=_measure_tensorsketch(elementwise, timed, device, seconds),
                         ts_flat_bytes=_measure_tensorsketch_flat(elementwise, timed, device, seconds),
                         link_bandwidth=PRESETS[nominal_key(name)].link_bandwidth if cuda else 0.0)
    return _with_products(prof, timed, device)
