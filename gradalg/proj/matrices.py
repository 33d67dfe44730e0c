"""The random matrices behind a :class:`~gradalg.expr.projection.Projector`.

Drawn on the CPU in float64 from a generator seeded per block (and per part for
Kronecker factors), then cast and moved, so results do not depend on the device or the
process. Each matrix is kept in the dtype and on the device it is asked for, for the run
of one plan: a projection applied chunk by chunk casts it once, not once per chunk (a
(512, 85 k) matrix cast for every chunk of 32 rows was most of a dense projection's time),
and a pass draws each block's matrix once, however many blocks the model has (a cache of
64 entries redrew every matrix at every batch of a model with more projected layers than
that, while the plan priced one draw). The plan counts the kept matrices in its memory;
the executor forgets them when a plan's run ends (:func:`gradalg.proj.clear_caches`). The
cached tensors are shared: callers must not modify them in place.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from ..errors import OptionError

if TYPE_CHECKING:
    from .projector import Projector

__all__ = ["dense_matrix", "kron_matrices", "clear_caches"]


def _draw(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "rademacher":
        signs = torch.randint(0, 2, (rows, cols), generator=gen, dtype=torch.int8)
        return (signs.to(torch.float64) * 2 - 1) / math.sqrt(rows)
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64) / math.sqrt(rows)


def _device_key(device) -> str:
    return str(torch.device(device))


@lru_cache(maxsize=None)
def _dense(projector: Projector, block_name: str, dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The (k, dim) matrix drawn in float64 on the CPU, cast to ``dtype`` on ``device``
    once: the key holds the dtype and the device, so each form is its own entry and
    every form holds the same numbers (the float64 draw rounded once)."""
    drawn = _draw(projector.kind_object.draw, projector.k, dim, projector.block_seed(block_name))
    return drawn.to(device=device, dtype=dtype)


def dense_matrix(projector: Projector, block_name: str, dim: int, *, dtype=torch.float32,
                 device="cpu") -> torch.Tensor:
    """The (k, dim) matrix projecting block ``block_name``.

    With ``per_block=False`` the whole space is projected by one (k, Σ dim) matrix;
    its column slice for one block is drawn with that block's own seed, which is the
    same thing as a single matrix and lets each block be projected on its own.
    """
    if projector.kind_object.draw is None:      # a kind of index tables (its kinds.py class sets no draw)
        raise OptionError(f"a {projector.kind} projector has no dense matrix (dense_matrix takes a gaussian, "
                          "rademacher or kron projector); its index tables are in gradalg.proj.sparse_tables "
                          "(SJLT.dense() builds one for tests)")
    return _dense(projector, block_name, dim, dtype, _device_key(device))


@lru_cache(maxsize=None)
def _kron(projector: Projector, block_name: str, out: int, n_in: int, dtype: torch.dtype, device: str):
    k_out, k_in = projector.kron_shape(out, n_in)
    # a side that k does not reduce (k_out = out: k above the layer's size) is kept exact:
    # the identity, not a random square map (which reduces nothing and only adds variance)
    P_out = torch.eye(out, dtype=torch.float64) if k_out == out else \
        _draw("gaussian", k_out, out, projector.block_seed(block_name, "out"))
    P_in = torch.eye(n_in, dtype=torch.float64) if k_in == n_in else \
        _draw("gaussian", k_in, n_in, projector.block_seed(block_name, "in"))
    return P_out.to(device=device, dtype=dtype), P_in.to(device=device, dtype=dtype)


def kron_matrices(projector: Projector, block_name: str, out: int, n_in: int, *,
                  dtype=torch.float32, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(P_out (k_out, out), P_in (k_in, in))`` with N(0, 1/k_·) entries; a side that
    the projection does not reduce (``k_out = out`` or ``k_in = in``, as
    :meth:`~gradalg.expr.projection.Projector.kron_shape` clamps a ``k`` above the layer's
    size) is the identity, so a layer with out·in ≤ k is kept exact."""
    return _kron(projector, block_name, out, n_in, dtype, _device_key(device))


def clear_caches() -> None:
    """Forget every cached matrix (the next use draws it again, with the same numbers)."""
    _dense.cache_clear()
    _kron.cache_clear()
