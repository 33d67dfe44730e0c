"""The disk cache of measured profiles: ``devices.json`` in ``~/.cache/gradalg``
(override the folder with ``GRADALG_CACHE``), one entry per device and cost model.

A CPU's entry is keyed by host, architecture, torch version, thread count and
:data:`~gradalg.devices.record.PROFILE_VERSION` (:func:`cpu_key`); a GPU's by host, device
name, torch version and that version (:func:`cuda_key`). An entry of another cost model is
not read (it is measured again) and is left alone for the gradalg that wrote it.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from .nominal import UNMEASURED_CPU
from .record import PROFILE_VERSION, DeviceProfile

__all__ = ["cpu_key", "cuda_key", "read_cached", "write_cached", "cached_local_profile"]


def _cache_file() -> Path:
    root = Path(os.environ.get("GRADALG_CACHE", Path.home() / ".cache" / "gradalg"))
    return root / "devices.json"


def cpu_key() -> str:
    """This machine's CPU entry. The cost model's version is part of the key: processes
    running another version of gradalg on the same machine keep their own entry instead
    of overwriting this one."""
    return (f"{platform.node()}|{platform.machine()}|torch{torch.__version__}|threads{torch.get_num_threads()}"
            f"|cost-model{PROFILE_VERSION}")


def cuda_key(name: str) -> str:
    """The entry of the GPU named ``name`` (``torch.cuda.get_device_name``) on this host."""
    return f"{platform.node()}|cuda|{name}|torch{torch.__version__}|cost-model{PROFILE_VERSION}"


def read_cached(key: str) -> DeviceProfile | None:
    """The profile cached under ``key`` (:func:`cpu_key`, :func:`cuda_key`), or None: none,
    unreadable, another cost model's."""
    try:
        entry = json.loads(_cache_file().read_text()).get(key)
        return DeviceProfile.from_json(entry) if entry else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def write_cached(key: str, prof: DeviceProfile) -> None:
    """Cache ``prof`` under ``key`` beside the other entries (a read-only home: not cached)."""
    path = _cache_file()
    try:
        cached = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        cached = {}
    cached = cached if isinstance(cached, dict) else {}
    cached[key] = prof.to_json()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # read-only home: measure again next time


def cached_local_profile() -> DeviceProfile:
    """This machine's profile if it was measured before (the disk cache), else
    :data:`~gradalg.devices.nominal.UNMEASURED_CPU`. Never measures: displays (``repr``,
    ``explain()``) use it."""
    return read_cached(cpu_key()) or UNMEASURED_CPU
