"""The memory budget a plan is made under: given, or a fraction of the machine's free memory.

``ga.options(memory_budget=...)`` wins when it is set. Otherwise (``None``, the default)
the budget is measured when the plan is made::

    budget = memory_fraction × available          (default memory_fraction = 0.5)
    available = free memory of the model's CUDA device   torch.cuda.mem_get_info
              | min(MemAvailable, cgroup room)            /proc/meminfo, /sys/fs/cgroup (Linux)
              | psutil.virtual_memory().available         where psutil is installed
              | 2 GB, "free memory unknown"                elsewhere

What the budget bounds: the bytes the planner counts for a pass (held and stored rows,
curvature statistics, projection matrices and index tables, and a batch's captured
factors, activations and the loss's copies of the model's output), i.e. what the run adds
to the process. The model's weights, the data and the framework are already resident
when the plan is made, so ``MemAvailable`` was measured without them: they are neither
counted nor double-counted. A run's resident growth measured 0.94–1.31× its budget
(``tests/test_budgets.py``) and 0.08–1.29× on GPT-2-shaped models with a 50,257-token
vocabulary (``benchmarks/machine_budget.py``, ``docs/planner.md``); half of what is free
leaves a quarter of it to the rest of the machine even at 1.5×.

Inside a container or a cluster job (Docker, Kubernetes, Slurm) the process is held to a
control group's memory limit, which ``/proc/meminfo`` does not show: it reports the whole
host. The cgroup room is, over the process's memory cgroup and each of its ancestors that
sets a limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``)::

    room = limit − (usage − inactive file cache)     (memory.current / memory.usage_in_bytes,
                                                       memory.stat inactive_file: reclaimable)

and the smaller of the two is what is available (source ``"cgroup memory limit"``).

A :class:`Budget` records the bytes and their source; the plan keeps it (``plan.budget``),
``explain()`` shows ``memory budget 11.2 GB = 0.5 × 22.4 GB available (MemAvailable;
memory_fraction)``, and every refusal for memory says where the budget came from and how to change it
(:func:`refusal_note`).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
from dataclasses import asdict, dataclass

from ..errors import MemoryBudgetError, PlanError
from ..options import Options, get_options
from ..units import byte_unit, format_bytes, format_bytes_alike

__all__ = ["Budget", "SETTINGS", "budget_setting", "resolve_budget", "device_budget", "is_here", "available_memory", "budget_bytes",
           "refusal_note", "with_note", "suggest_budget", "FALLBACK_BYTES", "MEMINFO", "CGROUP_ROOT",
           "PROC_CGROUP", "cgroup_room"]

#: the file ``MemAvailable`` is read from (tests point it at a fake one)
MEMINFO = "/proc/meminfo"
#: the cgroup file system and this process's cgroup list (tests point them at fake ones)
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
#: a v1 ``memory.limit_in_bytes`` at or above this means "no limit" (the kernel writes
#: PAGE_COUNTER_MAX, 2^63 rounded down to a page)
_V1_UNLIMITED = 2**60
#: the budget's ``available`` where the machine's free memory cannot be read
FALLBACK_BYTES = 2 * 10**9
#: the ways a budget is given, as the fix a refusal names is written for each (``name``:
#: ``memory_budget``, ``memory_fraction``, ...; ``value`` the fitting value):
#: ``ga.options(name=value)`` in Python; ``explain(memory_budget=value)`` for a budget
#: given to ``explain`` (its fractions are still ``ga.options``'); ``--set options.name=value``
#: for the ``gradalg`` command (its config's ``[options]``)
SETTINGS = ("ga.options", "explain", "cli")
_SETTING: contextvars.ContextVar[str] = contextvars.ContextVar("gradalg_budget_setting", default="ga.options")


@contextlib.contextmanager
def budget_setting(setting: str):
    """Budgets made from the options inside are given by ``setting`` (one of
    :data:`SETTINGS`): the ``gradalg`` command enters ``budget_setting("cli")``, so that a
    refusal names ``--set options.memory_budget=...``, what its user can type."""
    if setting not in SETTINGS:
        raise PlanError(f"budget_setting must be one of {SETTINGS}, got {setting!r}")
    token = _SETTING.set(setting)
    try:
        yield
    finally:
        _SETTING.reset(token)


def setting_now() -> str:
    """How budgets made here are given (one of :data:`SETTINGS`; :func:`budget_setting`)."""
    return _SETTING.get()


@dataclass(frozen=True)
class Budget:
    """A plan's memory budget and where it came from.

    ``bytes``: the budget; ``source``: ``"ga.options(memory_budget=...)"``,
    ``"explain(memory_budget=...)"``, ``"MemAvailable"``, ``"psutil"``,
    ``"free memory of cuda:0 (torch.cuda.mem_get_info)"``, ... ; ``fraction`` and
    ``available`` (bytes) when it is a fraction of a measured amount, else ``None``;
    ``option``: the ``ga.options`` field of that fraction; ``setting``: how this budget was
    given (:data:`SETTINGS`: ``"ga.options"``, ``"explain"`` for a budget given to
    ``explain(memory_budget=...)``, which ``ga.options`` would not override, ``"cli"`` for the
    ``gradalg`` command's options): refusals name the fix that way (:meth:`change`)."""

    bytes: int
    source: str
    fraction: float | None = None
    available: float | None = None
    option: str = "memory_fraction"
    setting: str = "ga.options"

    def __post_init__(self):
        if self.setting not in SETTINGS:
            raise PlanError(f"Budget.setting must be one of {SETTINGS}, got {self.setting!r}")

    def change(self, name: str, value=None) -> str:
        """The fix that sets option ``name`` to ``value`` (None: ``...``), written the way this
        budget was given: ``ga.options(memory_budget='9.3GB')``, ``explain(memory_budget='9.3GB')``
        (a fraction there: ``ga.options(memory_fraction=0.3)``; a budget of a device planned
        for, ``option="device_memory_fraction"``, also by ``explain``: the options' budget does
        not apply to it), or ``--set options.memory_budget=9.3GB`` (the command passes it to
        ``explain`` for a device)."""
        shown = "..." if value is None else value if self.setting == "cli" else repr(value)
        if self.setting == "cli":
            return f"--set options.{name}={shown}"
        # a budget for hardware one plans for (``explain(device="h200")``) ignores
        # ga.options(memory_budget): explain's own argument is the one that changes it
        by_explain = self.setting == "explain" or self.option == "device_memory_fraction"
        call = "explain" if by_explain and name == "memory_budget" else "ga.options"
        return f"{call}({name}={shown})"

    def describe(self) -> str:
        """``11.2 GB = 0.5 × 22.4 GB available (MemAvailable; memory_fraction)`` or
        ``2.15 GB (ga.options(memory_budget=...))``."""
        if self.fraction is None:
            return f"{format_bytes(self.bytes)} ({self.source})"
        shown, available = format_bytes_alike(self.bytes, self.available)
        if self.option == "device_memory_fraction":
            return f"{shown} = {self.fraction:g} × {available} {self.source} ({self.option})"
        return f"{shown} = {self.fraction:g} × {available} available ({self.source}; {self.option})"

    def to_dict(self) -> dict:
        return {**asdict(self), "text": self.describe()}


def _read(path: str) -> str | None:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().strip()
    return None


def _meminfo_available(path: str) -> float | None:
    """``MemAvailable`` of a ``/proc/meminfo`` file in bytes (its ``kB`` are 1024 bytes), None if unreadable."""
    found = re.search(r"^MemAvailable:[ \t]*(\d+)[ \t]*(\w*)", _read(path) or "", re.MULTILINE)
    return float(found[1]) * (1024 if found[2].lower() == "kb" else 1) if found else None


def _inactive_file(folder: str) -> float:
    """Reclaimable page cache charged to the cgroup (``memory.stat``), 0 when unreadable."""
    lines = (line.partition(" ") for line in (_read(os.path.join(folder, "memory.stat")) or "").splitlines())
    found = {key: float(value) for key, _, value in lines
             if key in ("inactive_file", "total_inactive_file") and value.strip().isdigit()}
    return found.get("total_inactive_file", found.get("inactive_file", 0.0))


def _room(folder: str, limit_file: str, usage_file: str) -> float | None:
    """``limit − (usage − inactive file cache)`` of one cgroup folder, None without a limit."""
    limit, usage = _read(os.path.join(folder, limit_file)), _read(os.path.join(folder, usage_file))
    # "max" (v2), missing or unreadable, or v1's "unlimited": no limit here
    if not (limit or "").isdigit() or not (usage or "").isdigit() or int(limit) >= _V1_UNLIMITED:
        return None
    return max(0.0, float(limit) - max(0.0, float(usage) - _inactive_file(folder)))


def _cgroup_folders(root: str, proc_cgroup: str):
    """``(folder, limit file, usage file)`` for this process's memory cgroup and its
    ancestors up to the mount point, v2 (unified) and v1 (``memory`` controller)."""
    for line in (_read(proc_cgroup) or "").splitlines():
        ident, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if ident == "0" and controllers == "":
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        # inside a cgroup namespace the path may not exist under the mount: the mount is the group
        while parts and not os.path.isdir(os.path.join(base, *parts)):
            parts.pop(0)
        for depth in range(len(parts), -1, -1):
            yield (os.path.join(base, *parts[:depth]),) + files


def cgroup_room(root: str | None = None, proc_cgroup: str | None = None) -> float | None:
    """The bytes this process may still take under its control groups' memory limits (the
    smallest room over the limited ones, module docstring), or None where no limit is set or
    none can be read (not Linux, no cgroup file system)."""
    return min((r for folder, limit, usage in _cgroup_folders(root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP)
                if (r := _room(folder, limit, usage)) is not None), default=None)


def available_memory(device=None) -> tuple[float, str]:
    """(bytes available now, where the number comes from) on ``device``: the free memory
    of a CUDA device, else this machine's available RAM (module docstring)."""
    import torch
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        return float(free), f"free memory of cuda:{index} (torch.cuda.mem_get_info)"
    found, room = _meminfo_available(MEMINFO), cgroup_room()
    if room is not None and (found is None or room < found):
        return room, "cgroup memory limit"
    if found is not None:
        return found, "MemAvailable"
    with contextlib.suppress(Exception):    # not installed, or no reading on this platform
        import psutil
        return float(psutil.virtual_memory().available), "psutil"
    return float(FALLBACK_BYTES), "free memory unknown on this platform: a fixed 2 GB"


def is_here(device) -> bool:
    """Whether ``device`` is one this process runs on ("cpu", "cuda:0", a torch.device),
    not a profile of hardware one plans for (a preset name, a DeviceProfile)."""
    import torch
    return device is None or isinstance(device, torch.device) or (
        isinstance(device, str) and (device == "cpu" or device.lower().startswith("cuda")))


def resolve_budget(options: Options, device=None, prof=None) -> Budget:
    """The budget of a plan made now under ``options`` for a model on ``device`` (None: the
    CPU; a torch device). For hardware one plans for without running on it (``device`` a
    preset name or a DeviceProfile, ``prof`` its profile) the default budget is
    ``device_memory_fraction`` of one device's memory (its model is not loaded anywhere)."""
    setting = _SETTING.get()
    if options.memory_budget is not None:
        given = "--set options.memory_budget" if setting == "cli" else "ga.options(memory_budget=...)"
        return Budget(int(options.memory_budget), given, setting=setting)
    if not is_here(device):
        return device_budget(options, prof)
    available, source = available_memory(device)
    return Budget(max(1, int(options.memory_fraction * available)), source, options.memory_fraction, available,
                  setting=setting)


def device_budget(options: Options, prof) -> Budget:
    """``device_memory_fraction`` of one device's memory (``prof.memory``): the budget of a
    plan for hardware one does not run on (``explain(device="h200")``)."""
    fraction = options.device_memory_fraction
    return Budget(max(1, int(fraction * prof.memory)), f"of one {prof.name}'s memory", fraction, prof.memory,
                  option="device_memory_fraction", setting=_SETTING.get())


def budget_bytes(options: Options, device=None) -> int:
    """``resolve_budget(options, device).bytes``: for checks made outside a plan."""
    return resolve_budget(options, device).bytes


def suggest_budget(need: float, headroom: float | None = None) -> str:
    """A ``memory_budget`` string for at least ``(1 + headroom)`` × ``need`` bytes
    (``headroom``: ``ga.options(budget_headroom)``, 0.25 unless set; None: the options in
    force), in the unit :func:`~gradalg.units.format_bytes` writes ``need`` in (so both read
    alike in one sentence: ``5.04 TB`` → ``"6.3TB"``, never ``"6300GB"``), rounded up to
    three significant digits (decimal units, :mod:`gradalg.units`): ``"413kB"``, ``"9.32GB"``."""
    headroom = get_options().budget_headroom if headroom is None else headroom
    unit, scale = byte_unit(max(float(need), 1.0))
    value = (1 + headroom) * max(float(need), 1.0) / scale
    places = 0 if unit == "B" else max(0, 2 - math.floor(math.log10(value)))   # whole bytes
    value = math.ceil(round(value * 10 ** places, 6)) / 10 ** places
    return f"{value:.{places}f}".rstrip("0").rstrip(".") + unit if places else f"{value:.0f}{unit}"


def with_note(err: MemoryBudgetError, budget: Budget, need: float | None, headroom: float) -> str:
    """The message of ``err`` with :func:`refusal_note` as its ``note`` field (its message is
    rendered from its fields; ``headroom``: the plan's ``ga.options(budget_headroom)``)."""
    larger = need is not None and err.needed is not None and need > err.needed
    err.note = refusal_note(budget, need, "the plan's largest pass at a batch of one, not only this one"
                            if larger else "", headroom)
    err.args = (err.render(), *err.args[1:])
    return err.render()


def refusal_note(budget: Budget, need: float | None = None, what: str = "", headroom: float | None = None) -> str:
    """The sentences every refusal for memory ends with: the budget, its source and how to
    change it (with ``need``, the bytes the refused step needs, ``what`` saying what they
    are when not the refused step alone: values that fit it, each ``(1 + headroom)`` ×
    ``need`` rounded up, and saying so; ``headroom``: ``ga.options(budget_headroom)``,
    None: the options in force)."""
    text = f"The memory budget is {budget.describe()}"
    if need is None:
        return text + (f"; change it with {budget.change('memory_budget', '8GB')} (bytes, or a string: '8GB' is "
                       "8·10⁹ bytes, '8GiB' 8·2³⁰)"
                       + (f" or {budget.change(budget.option)}" if budget.fraction is not None else "") + ".")
    headroom = get_options().budget_headroom if headroom is None else headroom
    text += (f". {format_bytes(need)} would fit under {budget.change('memory_budget', suggest_budget(need, headroom))} "
             f"({format_bytes(need)}{': ' + what if what else ''}; {1 + headroom:g} × that rounded up: a "
             f"{headroom * 100:g}% headroom, budget_headroom")
    if budget.fraction is not None and budget.available:
        fraction = math.ceil((1 + headroom) * need / budget.available * 100) / 100
        text += (f"), or {budget.change(budget.option, fraction)} (at least the same headroom" if fraction <= 0.9
                 else f"; more than the {format_bytes(budget.available)} available: better make the run smaller")
    return text + ")."
