"""Checks of the numeric arguments of :mod:`gradalg.eval` (counts, seeds, levels, fractions).

Python and NumPy numbers are accepted alike (``np.int64(50)`` subsets, ``np.float32(0.9)``
confidence); anything else, or a value out of range, raises
:class:`~gradalg.errors.OptionError` naming the argument, never a raw ``TypeError`` from a
comparison.
"""
from __future__ import annotations

import numbers

from ..errors import OptionError

__all__ = ["count", "integer", "level", "fraction"]


def integer(name: str, value) -> int:
    """``value`` as an int (a Python or NumPy integer; not a bool or a float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


def count(name: str, value, minimum: int = 1) -> int:
    """An integer ≥ ``minimum``."""
    what = "a positive integer" if minimum == 1 else f"an integer ≥ {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise OptionError(f"{name} must be {what}, got {value!r}")
    return int(value)


def level(name: str, value) -> float:
    """A real number strictly between 0 and 1 (a confidence level)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < 1:
        raise OptionError(f"{name} must be in (0, 1), got {value!r}")
    return float(value)


def fraction(name: str, value) -> float:
    """A real number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) <= 1:
        raise OptionError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)
