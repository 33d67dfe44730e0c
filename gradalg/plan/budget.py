"""The memory budget a plan is made under: given, or a fraction of the machine's free memory.

``ga.options(memory_budget=...)`` wins when it is set. Otherwise (``None``, the default)
the budget is measured when the plan is made::

    budget = memory_fraction × available          (default memory_fraction = 0.5)
    available = free memory of the model's CUDA device   torch.cuda.mem_get_info
              | MemAvailable                              /proc/meminfo (Linux)
              | psutil.virtual_memory().available         where psutil is installed
              | 2 GiB, "free memory unknown"               elsewhere

What the budget bounds: the bytes the planner counts for a pass (held and stored rows,
curvature statistics, projection matrices and index tables, and a batch's captured
factors, activations and the loss's copies of the model's output), i.e. what the run adds
to the process. The model's weights, the data and the framework are already resident
when the plan is made, so ``MemAvailable`` was measured without them: they are neither
counted nor double-counted. A run's resident growth measured 0.94–1.31× its budget
(``tests/test_budgets.py``) and 0.08–1.29× on GPT-2-shaped models with a 50,257-token
vocabulary (``benchmarks/machine_budget.py``, ``docs/planner.md``); half of what is free
leaves a quarter of it to the rest of the machine even at 1.5×.

A :class:`Budget` records the bytes and their source; the plan keeps it (``plan.budget``),
``explain()`` shows ``memory budget 11.2 GB = 0.5 × 22.4 GB available (MemAvailable;
memory_fraction)``, and every refusal for memory says where the budget came from and how to change it
(:func:`refusal_note`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..options import Options
from .cost import _si

__all__ = ["Budget", "resolve_budget", "device_budget", "is_here", "available_memory", "budget_bytes",
           "refusal_note", "with_note", "suggest_budget", "FALLBACK_BYTES", "MEMINFO"]

#: the file ``MemAvailable`` is read from (tests point it at a fake one)
MEMINFO = "/proc/meminfo"
#: the budget's ``available`` where the machine's free memory cannot be read
FALLBACK_BYTES = 2 * 2**30


@dataclass(frozen=True)
class Budget:
    """A plan's memory budget and where it came from.

    ``bytes``: the budget; ``source``: ``"ga.options(memory_budget=...)"``,
    ``"explain(memory_budget=...)"``, ``"MemAvailable"``, ``"psutil"``,
    ``"free memory of cuda:0 (torch.cuda.mem_get_info)"``, ... ; ``fraction`` and
    ``available`` (bytes) when it is a fraction of a measured amount, else ``None``;
    ``option``: the ``ga.options`` field of that fraction."""

    bytes: int
    source: str
    fraction: float | None = None
    available: float | None = None
    option: str = "memory_fraction"

    def describe(self) -> str:
        """``11.2 GB = 0.5 × 22.4 GB available (MemAvailable; memory_fraction)`` or
        ``2.15 GB (ga.options(memory_budget=...))``."""
        if self.fraction is None:
            return f"{_si(self.bytes)}B ({self.source})"
        if self.option == "device_memory_fraction":
            return f"{_si(self.bytes)}B = {self.fraction:g} × {_si(self.available)}B {self.source} ({self.option})"
        return (f"{_si(self.bytes)}B = {self.fraction:g} × {_si(self.available)}B available "
                f"({self.source}; {self.option})")

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "source": self.source, "fraction": self.fraction,
                "available": self.available, "option": self.option, "text": self.describe()}


def _meminfo_available(path: str) -> float | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, *unit = line.split(":", 1)[1].split()
                    return float(value) * (1024 if unit and unit[0].lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(device=None) -> tuple[float, str]:
    """(bytes available now, where the number comes from) on ``device``: the free memory
    of a CUDA device, else this machine's available RAM (module docstring)."""
    import torch
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        return float(free), f"free memory of cuda:{index} (torch.cuda.mem_get_info)"
    found = _meminfo_available(MEMINFO)
    if found is not None:
        return found, "MemAvailable"
    try:
        import psutil
        return float(psutil.virtual_memory().available), "psutil"
    except Exception:    # not installed, or no reading on this platform
        return float(FALLBACK_BYTES), "free memory unknown on this platform: a fixed 2 GiB"


def is_here(device) -> bool:
    """Whether ``device`` is one this process runs on ("cpu", "cuda:0", a torch.device),
    not a profile of hardware one plans for (a preset name, a DeviceProfile)."""
    import torch
    if device is None or isinstance(device, torch.device):
        return True
    return isinstance(device, str) and (device == "cpu" or device.lower().startswith("cuda"))


def resolve_budget(options: Options, device=None, prof=None) -> Budget:
    """The budget of a plan made now under ``options`` for a model on ``device`` (None: the
    CPU; a torch device). For hardware one plans for without running on it (``device`` a
    preset name or a DeviceProfile, ``prof`` its profile) the default budget is
    ``device_memory_fraction`` of one device's memory (its model is not loaded anywhere)."""
    if options.memory_budget is not None:
        return Budget(int(options.memory_budget), "ga.options(memory_budget=...)")
    if not is_here(device):
        return device_budget(options, prof)
    available, source = available_memory(device)
    return Budget(max(1, int(options.memory_fraction * available)), source, options.memory_fraction, available)


def device_budget(options: Options, prof) -> Budget:
    """``device_memory_fraction`` of one device's memory (``prof.memory``): the budget of a
    plan for hardware one does not run on (``explain(device="h200")``)."""
    fraction = options.device_memory_fraction
    return Budget(max(1, int(fraction * prof.memory)), f"of one {prof.name}'s memory", fraction, prof.memory,
                  option="device_memory_fraction")


def budget_bytes(options: Options, device=None) -> int:
    """``resolve_budget(options, device).bytes``: for checks made outside a plan."""
    return resolve_budget(options, device).bytes


def suggest_budget(need: float) -> str:
    """A ``memory_budget`` string at least 1.25 × ``need`` (binary units, as parsed)."""
    need = 1.25 * max(float(need), 1.0)
    if need < 2**30:
        return f"{math.ceil(need / 2**20)}MB"
    return f"{math.ceil(need / 2**30 * 10) / 10:g}GB"


def with_note(message: str, budget: Budget, need: float | None = None) -> str:
    """``message`` followed by :func:`refusal_note` (a full stop between them)."""
    message = str(message).rstrip()
    return f"{message}{'' if message.endswith('.') else '.'} {refusal_note(budget, need)}"


def refusal_note(budget: Budget, need: float | None = None) -> str:
    """The sentence every refusal for memory ends with: the budget, its source and how to
    change it (with ``need``, the bytes the refused step needs: values that fit it)."""
    text = f"The memory budget is {budget.describe()}"
    # a budget given to explain() is changed there: ga.options would not override it
    setting = "explain" if budget.source.startswith("explain(") else "ga.options"
    if need is None:
        return text + (f"; change it with {setting}(memory_budget='8GB') (bytes, or a string like '8GB')"
                       + (f" or ga.options({budget.option}=...)" if budget.fraction is not None else "") + ".")
    text += f"; {_si(need)}B would fit under {setting}(memory_budget={suggest_budget(need)!r})"
    if budget.fraction is not None and budget.available:
        fraction = math.ceil(1.25 * need / budget.available * 100) / 100
        if fraction <= 0.9:
            text += f" or ga.options({budget.option}={fraction:g})"
        else:
            text += f" (more than the {_si(budget.available)}B available: better make the run smaller)"
    return text + "."
