"""The profile of the CUDA device a model is on: measured once and cached, or nominal by name.

A model whose parameters are on ``cuda:i`` is planned with :func:`cuda_profile`:

1. the profile measured on that device before (the disk cache,
   :mod:`gradalg.devices.cache`, keyed by host, device name, torch version and the cost
   model's version);
2. else, when measuring is allowed (an executor about to run, and ``ga.options(measure_devices=True)``,
   the default), :func:`~gradalg.devices.measure.measure_profile` on the device (well
   under a second on a data-centre GPU), cached;
3. else, or when measuring fails, :func:`nominal_profile`: the spec-sheet preset
   (:data:`gradalg.devices.PRESETS`) whose name is in ``torch.cuda.get_device_name``
   (H200, H100, A100; an unknown GPU gets the A100's numbers, the slowest preset), with the
   device's own memory, named ``"NVIDIA H100 80GB HBM3 (cuda:0, nominal H100 spec
   sheet: ...)"`` so that ``explain()`` says it was not measured.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from . import measure as measuring
from .cache import cuda_key, read_cached, write_cached
from .nominal import _MEM_EFF, PRESETS, nominal_key
from .record import DeviceProfile

__all__ = ["cuda_profile", "nominal_profile"]

_FAILED: dict = {}    # {device name: why its measurement failed} in this process


def _index(index: int | None) -> int:
    return torch.cuda.current_device() if index is None else int(index)


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
    cached = read_cached(cuda_key(name))
    if cached is not None:
        return cached
    if not measure:
        return nominal_profile(index, "not measured: a display, or ga.options(measure_devices=False)")
    if name in _FAILED:
        return nominal_profile(index, _FAILED[name])
    try:
        prof = measuring.measure_profile(torch.device("cuda", index))
    except Exception as err:   # a busy, broken or out-of-memory device: price it by its name
        _FAILED[name] = f"measuring failed: {type(err).__name__}: {err}"[:200]   # not retried in this process
        return nominal_profile(index, _FAILED[name])
    write_cached(cuda_key(name), prof)
    return prof
