"""Pairing two labelled results by their ids, never by position.

Every function of :mod:`gradalg.eval` that pairs two arrays (scores and a retrained
ground truth, scores and leave-one-out effects, two runs, two score matrices) reads each
side's ids along each dimension (an :class:`xarray.DataArray`'s coordinate) and puts the
other side in the reference side's order:

    p = locate(reference_ids, other_ids)        # other_ids[p] == reference_ids
    other_aligned = other.take(p, axis=...)

Ids in another order are aligned (the same number as the aligned input); a missing id,
an id the reference does not have (unless the caller allows extra ones), or a repeated
id raises :class:`~gradalg.errors.IdMismatchError` naming a few of them and the fix.
A side without ids (a NumPy array, a tensor, a DataArray without that coordinate) is
paired by position, and only when the lengths agree.
"""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from ..errors import IdMismatchError, ShapeMismatchError

__all__ = ["labels", "locate", "aligned_pair"]


def labels(x, dim: str) -> list | None:
    """The ids of ``x`` along ``dim`` as Python values: the coordinate of an
    :class:`xarray.DataArray` that has one for ``dim``; None for anything else."""
    coords = getattr(x, "coords", None)
    if coords is None or dim not in getattr(x, "dims", ()) or dim not in coords:
        return None
    return np.asarray(coords[dim].values).tolist()


def locate(wanted, available, *, dim: str, wanted_name: str, available_name: str,
           fix: str | Callable[[list, list, list], str], allow_extra: bool = False) -> np.ndarray:
    """Positions ``p`` (int64, len(wanted)) with ``available[p] == wanted``.

    wanted : the reference side's ids, in the order the result takes.
    available : the other side's ids.
    allow_extra : ids of ``available`` that ``wanted`` lacks are left out (leave-one-out
        reads a few training columns of a full score matrix); otherwise refused.
    fix : the sentence that says what to do, or ``fix(missing, extra, repeated)``.

    Raises :class:`IdMismatchError` when an id of ``wanted`` is not in ``available``,
    when ``available`` holds ids ``wanted`` lacks (unless ``allow_extra``), or when an id
    repeats on either side.
    """
    wanted, available = list(wanted), list(available)
    try:
        missing, extra, repeated = IdMismatchError.difference(wanted, available)
    except TypeError as err:      # unhashable labels
        raise IdMismatchError(f"the {dim} ids of {wanted_name} and {available_name} cannot be compared "
                              f"({err}): label examples with ints or strings", dim) from err
    if allow_extra:
        extra = []
    if missing or extra or repeated:
        text = IdMismatchError.describe(missing, extra, repeated, wanted_name, available_name, dim)
        advice = fix(missing, extra, repeated) if callable(fix) else fix
        raise IdMismatchError(f"{wanted_name} and {available_name} are paired by {dim} id, and their ids "
                              f"differ: {text}. {advice}", dim, missing, extra, repeated)
    index = {v: i for i, v in enumerate(available)}
    return np.fromiter((index[v] for v in wanted), dtype=np.int64, count=len(wanted))


def aligned_pair(x, y, what: str = "x and y"):
    """``(x, y)`` as arrays, ``y`` put in ``x``'s order when both are labelled.

    Two :class:`xarray.DataArray` with the same dimensions (in any order) are aligned
    by name and id: ``y`` is transposed to ``x``'s dimensions and, along every dimension
    where both have ids, reordered to ``x``'s ids (any other difference is refused).
    Anything else is paired by position. Returns the two values (array-likes)."""
    if not (_is_dataarray(x) and _is_dataarray(y)):
        return x, y
    x_dims, y_dims = x.dims, y.dims
    if set(x_dims) != set(y_dims) or len(x_dims) != len(y_dims):
        raise ShapeMismatchError(f"cannot pair {what}: their dimensions differ ({x_dims} and {y_dims}); name "
                                 "them alike (DataArray.rename) or pass plain arrays to pair them by position")
    y = y.transpose(*x_dims)
    for axis, dim in enumerate(x_dims):
        ref, other = labels(x, dim), labels(y, dim)
        if ref is None or other is None:
            continue
        p = locate(ref, other, dim=dim, wanted_name="the first array", available_name="the second",
                   fix=f"select the same {dim} ids on both sides explicitly, e.g. y.sel({dim}=x[{dim!r}])")
        y = y.isel({dim: p})
    return x, y


def _is_dataarray(x) -> bool:
    xr = sys.modules.get("xarray")      # a DataArray exists only once xarray is loaded
    return xr is not None and isinstance(x, xr.DataArray)
