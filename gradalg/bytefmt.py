"""How gradalg writes byte counts (and other quantities with a decimal prefix): three
significant digits, decimal units, one unit per sentence. Imports nothing of gradalg, so
that :mod:`gradalg.errors` can render a :class:`~gradalg.errors.MemoryBudgetError` with it;
:mod:`gradalg.units` re-exports it beside :func:`~gradalg.units.parse_bytes`, which reads
what these write."""
from __future__ import annotations

from decimal import Decimal

__all__ = ["si", "format_bytes", "byte_unit", "format_bytes_alike"]

#: the decimal prefixes :func:`si` writes, largest first
_PREFIXES = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def si(x: float) -> str:
    """``x`` to three significant digits with a decimal prefix and a space: ``"11.2 G"``,
    ``"87 M"``, ``"3.4 k"``, ``"512 "`` (add the unit: ``"FLOP"``, ``"B"``). Rounded before
    the prefix is chosen, so 999.7 · 10⁶ is ``"1 G"``, never ``"1e+03 M"``."""
    x = float(f"{x:.3g}")
    for unit, scale in _PREFIXES:
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def format_bytes(nbytes: float) -> str:
    """``nbytes`` as gradalg prints bytes: decimal units, three significant digits
    (``"11.2 GB"``, ``"87 MB"``, ``"512 B"``); :func:`~gradalg.units.parse_bytes` reads it back as that
    many bytes to the printed precision."""
    return f"{si(nbytes)}B"


def byte_unit(nbytes: float) -> tuple[str, float]:
    """``(unit, bytes per unit)`` :func:`format_bytes` writes ``nbytes`` in: ``("GB", 1e9)``
    for 11.2·10⁹, ``("B", 1.0)`` below a kilobyte (rounded to three digits first, as
    :func:`si`)."""
    x = float(f"{float(nbytes):.3g}")
    for unit, scale in _PREFIXES:
        if x >= scale:
            return f"{unit}B", scale
    return "B", 1.0


def format_bytes_alike(*nbytes: float, digits: int = 3) -> tuple[str, ...]:
    """The byte counts of one sentence in one unit, the unit :func:`format_bytes` writes the
    largest in, each to ``digits`` significant digits in positional notation:
    ``format_bytes_alike(5.04e12, 8e11)`` is ``("5.04 TB", "0.8 TB")``, never
    ``"5.04 TB"`` beside ``"800 GB"``. A count under a thousandth of that unit (a few bytes
    beside terabytes) is written in its own (:func:`format_bytes`) rather than as
    ``0.000002 TB``. Each reads back with :func:`~gradalg.units.parse_bytes` as that many bytes to the
    printed precision."""
    unit, scale = byte_unit(max((abs(float(n)) for n in nbytes), default=0.0))
    return tuple(f"{_positional(float(n) / scale, digits)} {unit}" if float(n) == 0 or float(n) / scale >= 1e-3
                 else format_bytes(n) for n in nbytes)


def _positional(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, without an exponent: 0.8, 5.04, 0.00213, 640."""
    text = f"{Decimal(f'{x:.{digits}g}'):f}"
    return text.rstrip("0").rstrip(".") if "." in text else text
