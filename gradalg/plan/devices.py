"""Device speeds for the cost model: measured once per machine, or taken from a table.

``DeviceProfile`` gives sustained matmul throughput (FLOP/s, by dtype), memory
bandwidth (bytes/s) and memory capacity. ``local_profile()`` measures this machine's
CPU the first time (a square float32 matmul and a 64 MiB copy; the fastest of a fraction
of a second of repetitions, so that other processes competing for the cores are not
cached as this machine's speed) and caches the numbers in
``~/.cache/gradalg/devices.json`` (override the folder with ``GRADALG_CACHE``); GPU
profiles for planning runs you have not started yet come from ``PRESETS`` (vendor peak
numbers times a sustained-efficiency factor, stated there).
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["DeviceProfile", "PRESETS", "UNMEASURED_CPU", "cached_local_profile", "local_profile", "profile"]


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops_fp32: float      # sustained matmul FLOP/s in float32
    flops_bf16: float      # sustained matmul FLOP/s in bfloat16 (tensor cores on GPUs)
    bandwidth: float       # bytes/s
    memory: float          # bytes available for tensors
    measured: bool = False
    call_seconds: float = 2e-5   # fixed cost of one module forward or backward (dispatch, launch)

    def flops(self, dtype: torch.dtype) -> float:
        if dtype in (torch.bfloat16, torch.float16):
            return self.flops_bf16
        if dtype == torch.float64:
            return self.flops_fp32 / 2
        return self.flops_fp32

    def seconds(self, flops: float, nbytes: float, dtype=torch.float32, calls: float = 0.0) -> float:
        """Roofline estimate: compute and memory traffic do not overlap (pessimistic),
        plus a fixed cost per module call."""
        return flops / self.flops(dtype) + nbytes / self.bandwidth + calls * self.call_seconds


_EFF = 0.6  # sustained fraction of peak assumed for GPU presets
PRESETS = {
    # peak dense numbers from vendor datasheets (SXM parts), times _EFF
    # (a module call: a few kernel launches of ~5 µs, asynchronous once the queue is full)
    "h200": DeviceProfile("H200", 67e12 * _EFF, 989e12 * _EFF, 4.8e12 * 0.8, 141e9 * 0.9, call_seconds=1e-5),
    "h100": DeviceProfile("H100", 67e12 * _EFF, 989e12 * _EFF, 3.35e12 * 0.8, 80e9 * 0.9, call_seconds=1e-5),
    "a100": DeviceProfile("A100", 19.5e12 * _EFF, 312e12 * _EFF, 2.0e12 * 0.8, 80e9 * 0.9, call_seconds=1e-5),
}


def _cache_file() -> Path:
    root = Path(os.environ.get("GRADALG_CACHE", Path.home() / ".cache" / "gradalg"))
    return root / "devices.json"


def _key() -> str:
    return f"{platform.node()}|{platform.machine()}|torch{torch.__version__}|threads{torch.get_num_threads()}"


def _fastest(fn, seconds: float) -> float:
    """The shortest time of one call of ``fn`` over ``seconds`` of repetitions."""
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _measure_cpu() -> DeviceProfile:
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    # the fastest repetition, not the mean: other processes competing for the cores while
    # this runs once would otherwise be cached as this machine's speed
    flops = 2 * n ** 3 / _fastest(lambda: a @ b, 0.15)
    x = torch.empty(64 * 2**20 // 4)       # larger than a CPU's last-level cache: memory, not cache
    y = torch.empty_like(x)
    y.copy_(x)
    bw = 2 * x.numel() * 4 / _fastest(lambda: y.copy_(x), 0.1)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8
    except (ValueError, OSError, AttributeError):
        memory = 8e9
    return DeviceProfile(f"cpu ({torch.get_num_threads()} threads)", flops, flops, bw, memory, measured=True,
                         call_seconds=_measure_call())


def _measure_call() -> float:
    """Seconds per module forward or backward when the arithmetic is negligible: a forward
    and backward through 8 tiny layers, divided by their 16 calls."""
    layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
    x = torch.randn(2, 4)

    def step():
        layers(x).sum().backward()

    step()
    return _fastest(step, 0.05) / 16


def local_profile(refresh: bool = False) -> DeviceProfile:
    """This machine's CPU profile, measured once and cached on disk."""
    path = _cache_file()
    key = _key()
    cached = {}
    if path.exists() and not refresh:
        try:
            cached = json.loads(path.read_text())
            if key in cached and "call_seconds" in cached[key]:   # older caches lack it: measure again
                return DeviceProfile(**cached[key])
        except (OSError, ValueError, TypeError):
            cached = {}
    prof = _measure_cpu()
    cached[key] = asdict(prof)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # read-only home: measure again next time
    return prof


# a modest laptop core, for displays before this machine was measured
UNMEASURED_CPU = DeviceProfile("cpu (not measured yet: ga.plan.devices.local_profile() measures it)",
                               2e10, 2e10, 1e10, 8e9, measured=False, call_seconds=2e-5)


def cached_local_profile() -> DeviceProfile:
    """This machine's profile if it was measured before (the disk cache), else
    :data:`UNMEASURED_CPU`. Never measures: displays (``repr``, ``explain()``) use it."""
    try:
        cached = json.loads(_cache_file().read_text())
        entry = cached.get(_key())
        if entry and "call_seconds" in entry:
            return DeviceProfile(**entry)
    except (OSError, ValueError, TypeError):
        pass
    return UNMEASURED_CPU


def profile(device: str | DeviceProfile | None = None, *, measure: bool = True) -> DeviceProfile:
    """A profile by name ("cpu" = this machine, "h100", "h200", "a100") or as given.

    ``measure=False`` never benchmarks this machine: the cached measurement or
    :data:`UNMEASURED_CPU`."""
    if isinstance(device, DeviceProfile):
        return device
    if device is None or device == "cpu":
        return local_profile() if measure else cached_local_profile()
    if device.lower() in PRESETS:
        return PRESETS[device.lower()]
    raise ValueError(f"unknown device {device!r}: use 'cpu', one of {sorted(PRESETS)}, or a DeviceProfile")
