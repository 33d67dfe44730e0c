"""Which profile prices a plan: this machine's (cached, else measured), a CUDA device's,
a preset by name, or one given."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import OptionError
from . import measure as measuring
from .accelerators import cuda_profile
from .cache import cached_local_profile, cpu_key, read_cached, write_cached
from .nominal import PRESETS
from .record import DeviceProfile

__all__ = ["profile", "local_profile", "positive_integer"]


def local_profile(refresh: bool = False) -> DeviceProfile:
    """This machine's CPU profile, measured once (:func:`gradalg.devices.measure.measure_cpu`)
    and cached on disk (:mod:`gradalg.devices.cache`)."""
    key = cpu_key()
    found = None if refresh else read_cached(key)
    if found is not None:
        return found
    prof = measuring.measure_cpu()
    write_cached(key, prof)
    return prof


def profile(device: str | DeviceProfile | torch.device | None = None, *, measure: bool = True,
            count: int | None = None) -> DeviceProfile:
    """A profile by name ("cpu" = this machine, "h100", "h200", "a100"), for a CUDA device
    (``"cuda"``, ``"cuda:1"``, a ``torch.device``: :func:`gradalg.devices.accelerators.cuda_profile`,
    measured, or nominal by its name), or as given.

    count : devices of this kind (default: the profile's own, 1). ``explain(device=
        profile("h200", count=4))`` estimates, or refuses with the arithmetic, a run on
        four H200s (:mod:`gradalg.plan.scale`).
    ``measure=False`` never benchmarks a device: the cached measurement, else
    :data:`UNMEASURED_CPU` (the CPU) or the GPU's nominal profile."""
    if count is not None and not positive_integer(count):
        raise OptionError(f"count must be a positive integer (devices of this kind), got {count!r}")
    if isinstance(device, DeviceProfile):
        found = device
    elif device is None or device == "cpu" or (isinstance(device, torch.device) and device.type == "cpu"):
        found = local_profile() if measure else cached_local_profile()
    elif isinstance(device, torch.device) or (isinstance(device, str) and device.lower().startswith("cuda")):
        try:
            dev = torch.device(device)
        except RuntimeError as err:
            raise OptionError(f"unknown device {device!r}: {err}; use 'cpu', 'cuda', 'cuda:0', one of "
                              f"{sorted(PRESETS)}, or a DeviceProfile") from err
        if dev.type != "cuda":
            raise OptionError(f"no profile for a model on {dev}: use 'cpu', 'cuda', one of {sorted(PRESETS)}, "
                              "or a DeviceProfile")
        found = cuda_profile(dev.index, measure=measure)
    elif isinstance(device, str) and device.lower() in PRESETS:
        found = PRESETS[device.lower()]
    else:
        raise OptionError(f"unknown device {device!r}: use 'cpu', 'cuda', one of {sorted(PRESETS)}, "
                          "or a DeviceProfile")
    return found if count is None or count == found.count else replace(found, count=int(count))


def positive_integer(x) -> bool:
    """Whether ``x`` is a whole number ≥ 1 (an int, a numpy integer, or a float like 4.0)."""
    try:
        return not isinstance(x, (bool, str)) and int(x) == x and x >= 1
    except (TypeError, ValueError, OverflowError):
        return False
