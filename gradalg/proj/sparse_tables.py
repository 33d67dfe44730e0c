"""Index tables of the sparse projectors: ``sparse``, ``mask``, ``grass``, ``factgrass``.

Nothing here is a dense matrix. A sparse JL transform (SJLT) is two (d, s) tables,
the output row and the sign of each non-zero of each column; a mask is a sorted
vector of kept coordinates. Both are drawn on the CPU from a generator seeded by
:meth:`Projector.block_seed` (block name and a part name), cached, and moved to the
device that needs them, so results do not depend on the device or the process.

Parts (the second argument of ``block_seed``), one independent draw each:

============  ==========================================  =========================
kind          tables                                       parts
============  ==========================================  =========================
sparse        SJLT of the block's d coordinates to k       "sjlt"
mask          k of the block's d coordinates               "mask"
mask, global  k of the concatenated space's coordinates    "global-mask" (of all names)
grass         mask_k of d, then SJLT of mask_k to k        "grass-mask", "grass-sjlt"
factgrass     k_out of out, k_in of in, SJLT of k_out·k_in  "mask-out", "mask-in",
                                                           "factgrass-sjlt"
tensorsketch  a row and a sign per output and per input    "ts-out", "ts-in"
============  ==========================================  =========================

As with the dense matrices, a global SJLT (``per_block=False``) is the sum of the
blocks' SJLTs, each drawn with its block's own seed: the columns of an SJLT are
independent, so this *is* one (k, Σd) SJLT.

Memory: an SJLT of d columns takes 5·d·s bytes (int32 rows, int8 signs), held in an
cache on the CPU for the run of one plan (:func:`gradalg.proj.clear_caches`) and copied to the
chunk's device at each use; the CPU kernel (a
weighted ``bincount``, :func:`gradalg.proj.kernels.sjlt_bincount`) reads them as they
are (forming a (d,) int32 signed bin index per call, dropped after it). Its CSR form
(:meth:`SJLT.csr`, 8·d·s bytes more) is built only when asked for.
Each pass that applies a table counts it in its held bytes
(:func:`gradalg.plan.estimates.sparse_table_bytes`). That is small for
``grass`` and ``factgrass`` (d = mask size ≈ 4k) but of the order of the model for a
plain ``sparse`` projection of large layers: at width ``tensorsketch`` (a hash factored
over a layer's outputs and inputs) keeps out + in entries per layer instead.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import cached_property, lru_cache

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .projector import Projector

__all__ = ["SJLT", "sjlt", "mask_indices", "global_mask", "factgrass_tables", "grass_tables", "tensorsketch_tables"]

_RANDPERM_MAX = 1 << 22   # draw a subset by randperm up to this size, by rejection above it


@dataclass(frozen=True)
class SJLT:
    """A (k, d) sparse JL matrix as index tables.

    Column j has the value ``signs[j, c] / √s`` at row ``rows[j, c]`` for c < s, with
    ``rows[j, c]`` uniform in the c-th band ``[⌊ck/s⌋, ⌊(c+1)k/s⌋)`` (so a column's s rows
    are distinct) and independent uniform signs.

    rows : (d, s) int32 (5 bytes a non-zero with the signs: cached per block, see below)
    signs : (d, s) int8, ±1
    k : output rows
    """

    rows: torch.Tensor
    signs: torch.Tensor
    k: int

    @property
    def d(self) -> int:
        """Input dimension (columns of the (k, d) matrix)."""
        return self.rows.shape[0]

    @property
    def s(self) -> int:
        """Non-zeros per column."""
        return self.rows.shape[1]

    def to(self, device) -> "SJLT":
        """The same tables on ``device`` (this object, and its cached CSR, when already there)."""
        if self.rows.device == torch.device(device):
            return self
        return SJLT(self.rows.to(device), self.signs.to(device), self.k)

    def columns(self, start: int, stop: int) -> "SJLT":
        """The (k, stop - start) SJLT of columns ``start:stop``."""
        return SJLT(self.rows[start:stop], self.signs[start:stop], self.k)

    def column_slice(self, start: int, stop: int) -> "SJLT":
        """:meth:`columns`, kept: the same slice asked again returns the same object, so its
        CSR form is built once (the sliced kernel of a block wider than
        ``projection_slice_elements`` asks for the same slices at every chunk)."""
        if (start, stop) == (0, self.d):
            return self
        if (start, stop) not in self._slices:
            self._slices[(start, stop)] = self.columns(start, stop)
        return self._slices[(start, stop)]

    @cached_property
    def _slices(self) -> dict:
        return {}

    @cached_property
    def _csr32(self) -> torch.Tensor:
        """The float32 CSR form: the non-zeros sorted by row (a stable sort of the d·s rows,
        so each row's non-zeros keep their column order). 4·d·s bytes of int32 column
        indices and 4·d·s of values, built once per table."""
        flat = self.rows.flatten()
        index = torch.int32 if flat.numel() < 2 ** 31 else torch.int64
        order = torch.argsort(flat, stable=True)
        crow = torch.zeros(self.k + 1, dtype=torch.int64, device=flat.device)
        crow[1:] = torch.bincount(flat.long(), minlength=self.k).cumsum(0)
        values = self.signs.flatten()[order].to(torch.float32) / math.sqrt(self.s)
        return _csr(crow.to(index), (order // self.s).to(index), values, (self.k, self.d))

    @cached_property
    def _csr_other(self) -> dict:
        return {}

    def csr(self, dtype) -> torch.Tensor:
        """The (k, d) matrix as a sparse CSR tensor of ``dtype`` (cached; another dtype than
        float32 shares its indices and adds its own values); ``x Sᵀ = (S xᵀ)ᵀ`` is then one
        sparse-dense product."""
        base = self._csr32
        if dtype == torch.float32:
            return base
        if dtype not in self._csr_other:
            values = base.values().sign().to(dtype) / math.sqrt(self.s)    # ±1/√s rounded in dtype itself
            self._csr_other[dtype] = _csr(base.crow_indices(), base.col_indices(), values, tuple(base.shape))
        return self._csr_other[dtype]

    def dense(self, dtype=torch.float64) -> torch.Tensor:
        """The explicit (k, d) matrix (for tests and small examples only)."""
        out = torch.zeros(self.k, self.d, dtype=dtype)
        cols = torch.arange(self.d).unsqueeze(1).expand(-1, self.s)
        out.index_put_((self.rows.cpu().long(), cols), self.signs.cpu().to(dtype) / math.sqrt(self.s),
                       accumulate=True)
        return out


def _csr(crow, col, values, shape) -> torch.Tensor:
    with warnings.catch_warnings():   # torch calls its CSR support "beta"
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def _subset(dim: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """``size`` distinct coordinates of ``range(dim)``, uniformly, sorted.   (size,) int64"""
    if size >= dim:
        return torch.arange(dim)
    if dim <= _RANDPERM_MAX or 2 * size >= dim:
        return torch.randperm(dim, generator=gen)[:size].sort().values
    # sequential rejection: draw with replacement, keep first occurrences until size are
    # distinct (a uniform subset, without a dim-sized permutation)
    kept = torch.empty(0, dtype=torch.long)
    while kept.numel() < size:
        draw = torch.cat([kept, torch.randint(0, dim, (2 * (size - kept.numel()) + 16,), generator=gen)])
        uniq, inverse = torch.unique(draw, return_inverse=True)
        first = torch.full((uniq.numel(),), draw.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(draw.numel()), "amin")
        kept = uniq[first.argsort()]
    return kept[:size].sort().values


@lru_cache(maxsize=None)
def _sjlt_cpu(projector: Projector, block_name: str, dim: int, part: str) -> SJLT:
    gen = torch.Generator().manual_seed(projector.block_seed(block_name, part))
    k, s = projector.k, projector.s
    rows = torch.empty(dim, s, dtype=torch.int32)
    for c in range(s):
        lo, hi = (c * k) // s, ((c + 1) * k) // s
        rows[:, c] = torch.randint(lo, hi, (dim,), generator=gen, dtype=torch.int32)
    signs = torch.randint(0, 2, (dim, s), generator=gen, dtype=torch.int8) * 2 - 1
    return SJLT(rows, signs, k)


@lru_cache(maxsize=None)
def _subset_cpu(projector: Projector, block_name: str, dim: int, size: int, part: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(projector.block_seed(block_name, part))
    return _subset(dim, size, gen)


def sjlt(projector: Projector, block_name: str, dim: int, part: str = "sjlt", *, device="cpu") -> SJLT:
    """The SJLT of ``dim`` coordinates to ``projector.k``, with ``projector.s`` non-zeros per column."""
    return _sjlt_cpu(projector, block_name, dim, part).to(device)


def mask_indices(projector: Projector, block_name: str, dim: int, size: int, part: str = "mask", *,
                 device="cpu") -> torch.Tensor:
    """``min(size, dim)`` sorted coordinates of ``range(dim)``, uniformly without replacement.   (size,)"""
    return _subset_cpu(projector, block_name, dim, min(size, dim), part).to(device)


def grass_tables(projector: Projector, block_name: str, dim: int, *, device="cpu"):
    """``(coords (m,), SJLT (k, m))`` of a "grass" projection of a block of ``dim``; m = mask size."""
    m = projector.grass_mask_size(dim)
    return (mask_indices(projector, block_name, dim, m, "grass-mask", device=device),
            sjlt(projector, block_name, m, "grass-sjlt", device=device))


def factgrass_tables(projector: Projector, block_name: str, out: int, n_in: int, *, device="cpu"):
    """``(out_idx (k_out,), in_idx (k_in,), SJLT (k, k_out·k_in))`` of a "factgrass" projection."""
    k_out, k_in = projector.factgrass_shape(out, n_in)
    return (mask_indices(projector, block_name, out, k_out, "mask-out", device=device),
            mask_indices(projector, block_name, n_in, k_in, "mask-in", device=device),
            sjlt(projector, block_name, k_out * k_in, "factgrass-sjlt", device=device))


@lru_cache(maxsize=32)
def _global_mask_cpu(projector: Projector, blocks: tuple[tuple[str, int], ...]):
    total = sum(d for _, d in blocks)
    chosen = _subset_cpu(projector, "|".join(n for n, _ in blocks), total,
                         projector.mask_size(total), "global-mask")
    out, start = {}, 0
    for name, d in blocks:
        inside = (chosen >= start) & (chosen < start + d)
        out[name] = (inside.nonzero().flatten(), chosen[inside] - start)
        start += d
    return out


def global_mask(projector: Projector, blocks: tuple[tuple[str, int], ...], block_name: str, *,
                device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A "mask" with ``per_block=False``: of the space ``blocks`` ((name, dim), in order), k
    coordinates drawn from the concatenation; for ``block_name``, ``(positions, coords)``:
    output positions (in ``range(k)``) and the block's coordinates that land there."""
    positions, coords = _global_mask_cpu(projector, blocks)[block_name]
    return positions.to(device), coords.to(device)


@lru_cache(maxsize=None)
def _tensorsketch_cpu(projector: Projector, block_name: str, out: int, n_in: int):
    parts = []
    for part, m in (("ts-out", out), ("ts-in", n_in)):
        gen = torch.Generator().manual_seed(projector.block_seed(block_name, part))
        rows = torch.randint(0, projector.k, (m,), generator=gen)
        signs = torch.randint(0, 2, (m,), generator=gen, dtype=torch.int8) * 2 - 1
        parts += [rows, signs]
    return tuple(parts)


def tensorsketch_tables(projector: Projector, block_name: str, out: int, n_in: int, *, device="cpu"):
    """``(h_out (out,), σ_out (out,), h_in (in,), σ_in (in,))`` of a "tensorsketch"
    projection of an (out, in) block: coordinate (o, i) goes to row ``(h_out[o] + h_in[i])
    mod k`` with sign ``σ_out[o]·σ_in[i]``. Rows int64, signs int8 (9·(out + in) bytes)."""
    return tuple(t.to(device) for t in _tensorsketch_cpu(projector, block_name, out, n_in))


def clear_tables() -> None:
    """Forget every cached table (the next use builds it again, with the same numbers)."""
    for cached in (_sjlt_cpu, _subset_cpu, _global_mask_cpu, _tensorsketch_cpu):
        cached.cache_clear()

