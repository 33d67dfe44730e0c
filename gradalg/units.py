"""Byte quantities as users type and read them: one convention, both ways.

The convention is dask's (``dask.utils.parse_bytes``, its unit table
``dask.utils.byte_sizes``)::

    "kB" "MB" "GB" "TB" "PB"   (or "k" "M" "G" "T" "P")    powers of 1000:  "8GB"   = 8 · 10⁹ bytes
    "KiB" "MiB" "GiB" "TiB" "PiB" (or "Ki" "Mi" ...)     powers of 1024:  "8GiB"  = 8 · 2³⁰ bytes
    a bare number, or "B"                                bytes:           "4096"  = 4096 bytes

case and spaces ignored (``"4 GB"`` = ``"4gb"`` = ``"4GB"``). Every byte count gradalg prints
(plans, ``explain()``, refusals and the fixes they suggest, the command line) is written by
:func:`format_bytes` in the decimal units, three significant digits (``"11.2 GB"``), so a
number copied from any message into ``ga.options(memory_budget=...)`` is that many bytes to
the printed precision: :func:`parse_bytes` (``format_bytes(n))`` is ``n`` rounded to three
digits.

:func:`parse_bytes` reads the number exactly (as a decimal) and rounds to the nearest byte:
``"4.1GB"`` is 4,100,000,000 bytes, where dask's own parser multiplies floats and truncates
to 4,099,999,999.
"""
from __future__ import annotations

import numbers
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

from .bytefmt import byte_unit, format_bytes, format_bytes_alike, si
from .errors import OptionError

__all__ = ["parse_bytes", "format_bytes", "format_bytes_alike", "byte_unit", "si"]

#: how a byte quantity is written, for error messages
UNITS_HELP = ("a number of bytes or a string like '8GB' (decimal: 8·10⁹ bytes) or '8GiB' (binary: 8·2³⁰ bytes); "
              "units B, kB, MB, GB, TB, PB are powers of 1000, KiB, MiB, GiB, TiB, PiB powers of 1024")

def parse_bytes(value, name: str = "memory_budget") -> int:
    """The bytes ``value`` stands for: an int, a finite float (rounded to the nearest byte)
    or a string in dask's convention (module docstring): ``"4 GB"`` → 4,000,000,000,
    ``"1.5GiB"`` → 1,610,612,736, ``"512"`` → 512, ``"1e9"`` → 10⁹.

    Raises :class:`~gradalg.errors.OptionError` naming ``name``, the value and how to write
    it for anything else: a bool, a negative or non-finite number, a string without a number
    (``"GB"``) or with a unit outside the table (``"4 XB"``, ``"4 GB extra"``)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise OptionError(f"{name} must be {UNITS_HELP}; got {value!r}")
    if isinstance(value, numbers.Real):       # numpy scalars too; Decimal(float) is exact, nan and inf refused below
        number, scale = Decimal(int(value) if isinstance(value, numbers.Integral) else float(value)), 1
    else:
        from dask.utils import byte_sizes     # here: dask loads (0.2 s) only when a string is read
        text = value.replace(" ", "")
        cut = len(text)
        while cut and text[cut - 1].isalpha():
            cut -= 1
        head, unit = text[:cut], text[cut:]
        if unit.lower() not in byte_sizes:
            raise OptionError(f"{name}={value!r}: unknown unit {unit!r}; {name} must be {UNITS_HELP}")
        try:
            number = Decimal(head)
        except InvalidOperation:
            raise OptionError(f"{name}={value!r} has no number before its unit; {name} must be "
                              f"{UNITS_HELP}") from None
        scale = byte_sizes[unit.lower()]
    if not number.is_finite() or number < 0:
        raise OptionError(f"{name}={value!r} is not a finite number of bytes >= 0; {name} must be {UNITS_HELP}")
    return int((number * scale).to_integral_value(ROUND_HALF_EVEN))
