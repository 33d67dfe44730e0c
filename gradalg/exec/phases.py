"""Where a run's time goes: wall seconds per phase.

Every executor run splits its time into the phases of :data:`PHASES`:

``planning``    building and costing the plan (shapes probed on the meta device, the
                device profile read or measured)
``capture``     forward and output backward of every batch, per-example factors,
                projections and other row-wise transforms, rows kept for later
``statistics``  curvature: covariances, eigenvalue corrections, Fisher sums, their
                eigendecompositions and inverses
``scoring``     held rows preconditioned, score and top-k kernels
``assembly``    partial results stitched together and labelled (the DataArray)

Phases nest: time spent in an inner phase is not counted in the outer one (a scoring
kernel that resolves an operator on first use charges the eigendecomposition to
``statistics``), so the phases add up to the run's time. Setting up (imports, building
the task) happens before a run and is for the caller to time (``benchmarks/end_to_end.py``).
"""
from __future__ import annotations

import contextlib
import time

from ..errors import OptionError

__all__ = ["PHASES", "PhaseClock"]

PHASES = ("planning", "capture", "statistics", "scoring", "assembly")


class PhaseClock:
    """Exclusive wall seconds per phase (``seconds``)."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._stack: list[str] = []
        self._since = 0.0

    def _charge(self) -> None:
        """The time since the last charge to the innermost open phase."""
        now = time.perf_counter()
        if self._stack:
            self.seconds[self._stack[-1]] += now - self._since
        self._since = now

    @contextlib.contextmanager
    def phase(self, name: str):
        """Charge the time inside the block to ``name`` (not to the enclosing phase)."""
        if name not in self.seconds:
            raise OptionError(f"unknown phase {name!r}; one of {PHASES}")
        self._charge()
        self._stack.append(name)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def report(self) -> dict[str, float]:
        """``{phase: wall seconds}`` (a copy)."""
        return dict(self.seconds)

    def __repr__(self):
        parts = ", ".join(f"{k} {v:.3g} s" for k, v in self.seconds.items())
        return f"PhaseClock({parts})"
