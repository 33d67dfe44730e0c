"""One class per projection kind: what a :class:`~gradalg.proj.projector.Projector` of
that kind does to one block, what that costs, and what it keeps.

:attr:`Projector.kind <gradalg.proj.projector.Projector.kind>` is the user's spelling;
:data:`REGISTRY` maps it to its kind object (``p.kind_object``), and every place that
acts on a projection asks that object. For one block ``b`` (shape ``(out, in)`` for a
layer, ``(d,)`` otherwise; ``d = b.dim``) a kind answers:

==============================  ==========================================================
``check(p)``                    its options' own constraints (an ``OptionError`` with the fix)
``check_block(p, b)``           a block it cannot project (kron and factgrass: layers only)
``block_shape(p, shape)``       the block's projected shape (per-block projectors)
``apply(p, block, value, run)``  the run-time kernel: the block's rows (factors or (n, d))
                                → its (n, k_b) projection (kron on factors: factors)
``cost(p, b, rows, prices)``    that kernel's estimate for :class:`Rows`, written in the
                                counts of ``prices``
                                (:class:`gradalg.plan.estimates.ProjectionPrices`)
``table_bytes(p, b)``           bytes of index tables the process keeps for the block
``build_cost(p, b, prices)``    drawing the block's matrix or tables (once per process)
==============================  ==========================================================

and, as class attributes, which options it takes (``per_layer``: always per block;
``factor_sizes``: ``k_out``/``k_in``; ``sjlt``: ``s``; ``masked``: ``mask_k``), its
default ``per_block``, the ``map`` the plan's "projection map" decision names, the
distribution of its dense matrices (``draw``) and whether factored rows stay factors
(``keeps_factors``: kron, so the planner keeps ghost kernels after it).

The abstract methods are the protocol: :func:`register` refuses a class that leaves one
out (``tests/test_projection_kinds.py`` checks every registered kind), so a kind cannot
fall through to another's kernel or cost. Cost formulas are per block for n rows (the
:class:`Rows` of all chunks); the notation is docs/projections.md's: T positions per
example, ``k`` outputs, ``s`` non-zeros per SJLT column, ``elem`` bytes per number.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from ..capture.chunks import flat_block
from ..capture.factors import Factors, compute_dtype, project_factors
from ..errors import OptionError, PlanError
from ..space import Block
from . import kernels as K
from .matrices import dense_matrix, kron_matrices
from .sparse_tables import factgrass_tables, global_mask, grass_tables, mask_indices, sjlt, tensorsketch_tables

if TYPE_CHECKING:
    from .projector import Projector

__all__ = ["ProjectionKind", "TableKind", "LayerKind", "REGISTRY", "register", "Rows", "BlockRun", "project_block",
           "dtype_device", "GRASS_BLOWUP"]

GRASS_BLOWUP = 4   # GraSS / FactGraSS: the mask keeps about 4k coordinates before the SJLT to k

#: the registered kinds by name, in the order of ``gradalg.proj.KINDS``
REGISTRY: dict[str, "ProjectionKind"] = {}


def register(*names: str):
    """Class decorator: register one instance of the kind class under each of ``names``.
    A class that leaves an abstract method out is refused here, naming the methods (so a
    new kind cannot be planned or run without its kernel, cost and tables)."""
    def add(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise PlanError(f"projection kind {cls.__name__} does not implement {', '.join(missing)}: a kind "
                            "gives its kernel, cost, table bytes and build cost (docs/contributing.md, "
                            "'A projection kind')")
        for name in names:
            if name in REGISTRY:
                raise PlanError(f"projection kind {name!r} is registered twice ({type(REGISTRY[name]).__name__} "
                                f"and {cls.__name__})")
            REGISTRY[name] = cls(name)
        return cls
    return add


@dataclass(frozen=True)
class Rows:
    """The rows a projection's estimate is for: n rows in ``chunks`` chunks of up to ``c``,
    T positions per example, arriving as factors (``factored``: an (out, in) block) or flat;
    ``total``: the dimension of the whole space (a global mask's share of its k)."""

    n: int
    c: int
    chunks: int
    T: int
    factored: bool
    total: int


@dataclass(frozen=True)
class BlockRun:
    """What a kind's kernel needs besides the block's rows: the space's ``(name, dim)``
    blocks in order (a global mask), the bound on temporaries (elements, from
    ``ga.options(projection_slice_elements)``), the positions materialized at a time
    (``ga.options(token_block)``) and the executor's ``trace`` (kernel calls by name)."""

    space_blocks: tuple[tuple[str, int], ...] | None = None
    max_elements: int = K.DEFAULT_MAX_ELEMENTS
    token_block: int | None = None
    trace: Counter = field(default_factory=Counter)

    def count(self, key: str) -> None:
        self.trace[key] += 1


def dtype_device(value):
    """(dtype, device) of projection matrices for ``value``: float32 for half-precision rows."""
    if isinstance(value, Factors):
        return compute_dtype(value.D.dtype), value.D.device
    return compute_dtype(value.dtype), value.device


def _device(value):
    return (value.D if isinstance(value, Factors) else value).device


def _form(value) -> str:
    return "factored" if isinstance(value, Factors) else "flat"


def project_block(p: "Projector", block: Block, value, *, space_blocks=None, max_elements: int = K.DEFAULT_MAX_ELEMENTS,
                  token_block: int | None = None):
    """One block's part of ``p``'s projection (its kind's :meth:`ProjectionKind.apply`):
    (n, k_b) for a per-block projector, the block's (n, k) contribution to the sum for a
    global one (``space_blocks`` ((name, dim), in order) is needed by the global mask)."""
    return p.kind_object.apply(p, block, value, BlockRun(space_blocks, max_elements, token_block))


class ProjectionKind(ABC):
    """A projection kind (see the module docstring for the protocol)."""

    per_layer: ClassVar[bool] = False          # always per block (per_block=True required)
    default_per_block: ClassVar[bool] = False
    factor_sizes: ClassVar[bool] = False        # takes k_out / k_in
    sjlt: ClassVar[bool] = False                # its last stage is a sparse JL transform: takes s
    masked: ClassVar[bool] = False              # takes mask_k
    map: ClassVar[str | None] = None            # "dense", "sparse JL", "tensorsketch" or None
    draw: ClassVar[str | None] = None           # the distribution of its dense matrices, if any
    keeps_factors: ClassVar[bool] = False       # factored rows stay factors (ghost products, K-FAC after it)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<projection kind {self.name!r}>"

    def check(self, p: "Projector") -> None:
        """Refuse options this kind cannot take together (beyond which options it takes)."""

    def check_block(self, p: "Projector", b: Block) -> None:
        """Refuse a block this kind cannot project (every block, unless overridden)."""

    def block_shape(self, p: "Projector", shape: tuple[int, ...]) -> tuple[int, ...]:
        """The projected shape of a block of ``shape``: (k,) unless overridden."""
        return (p.k,)

    @abstractmethod
    def apply(self, p: "Projector", block: Block, value, run: BlockRun):
        """The block's rows projected: ``value`` is factors (``G_i = D_iᵀ A_i``) or (n, d)."""

    @abstractmethod
    def cost(self, p: "Projector", b: Block, rows: Rows, prices):
        """The :meth:`apply` calls of ``rows``, as a Cost made by ``prices``."""

    @abstractmethod
    def table_bytes(self, p: "Projector", b: Block) -> float:
        """Bytes of index tables kept for the block (cached by the process for the run)."""

    @abstractmethod
    def build_cost(self, p: "Projector", b: Block, prices):
        """Drawing the block's matrix or tables, once per process."""


@register("gaussian", "rademacher")
class Dense(ProjectionKind):
    """A dense (k, d) matrix, N(0, 1/k) or ±1/√k entries (TRAK), drawn in float64 per block."""

    map = "dense"

    @property
    def draw(self):
        return self.name

    def apply(self, p, block, value, run):
        dtype, device = dtype_device(value)
        return flat_block(value) @ dense_matrix(p, block.name, block.dim, dtype=dtype, device=device).T

    def cost(self, p, b, rows, prices):
        """Factors materialized (T·d per row), then one GEMM (c, k, d) per chunk that reads the
        whole matrix each time (elem·k·d bytes per chunk), the last chunk with the rest."""
        cost = prices.materialize(rows.n, rows.T, b.shape[1], b.shape[0]) if rows.factored else prices.counts()
        full, rest = divmod(rows.n, rows.c)      # full chunks of c rows and a last one of the rest
        return (cost + prices.gemm(rows.c, p.k, b.dim, full) + prices.gemm(rest, p.k, b.dim, 1)
                + prices.counts(bytes=float(prices.elem) * p.k * b.dim * rows.chunks))

    def table_bytes(self, p, b):
        """0: the matrix (8·k·d bytes) is counted by the plan's projection-map decision."""
        return 0.0

    def build_cost(self, p, b, prices):
        """k·d float64 random numbers drawn, cast once to the rows' dtype into fresh memory
        (read 8, written elem bytes each: ``gradalg.proj.matrices.dense_matrix``)."""
        numbers = float(p.k * b.dim)
        return prices.counts(randoms=numbers, bytes=numbers * (8.0 + prices.elem),
                             faulted=numbers * (8.0 + prices.elem))


class LayerKind(ProjectionKind):
    """A kind that acts on the factors of (out, in) layer blocks in parameter coordinates."""

    per_layer = True
    default_per_block = True
    factor_sizes = True
    title: ClassVar[str] = ""

    def check_block(self, p, b):
        if len(b.shape) != 2 or b.basis != "params":
            raise OptionError(f"{self.title} projection needs (out, in) layer blocks in parameter coordinates; "
                              f"block {b.name!r} is {b.shape} in basis {b.basis}. Use ga.proj.grass or "
                              "ga.proj.sparse for other blocks")


@register("kron")
class Kron(LayerKind):
    """LoGra: ``P_out G P_inᵀ`` with Gaussian factors; on factors ``(D P_outᵀ)ᵀ (A P_inᵀ)``,
    which stays factored (ghost products and K-FAC statistics work in the projected space)."""

    title = "a Kronecker"
    draw = "gaussian"
    keeps_factors = True

    def check(self, p):
        if p.k_out is not None and p.k_out * p.k_in != p.k:
            raise OptionError(f"k_out * k_in = {p.k_out * p.k_in} must equal k = {p.k}")

    def block_shape(self, p, shape):
        return p.kron_shape(*shape)

    def apply(self, p, block, value, run):
        dtype, device = dtype_device(value)
        P_out, P_in = kron_matrices(p, block.name, *block.shape, dtype=dtype, device=device)
        if isinstance(value, Factors):
            run.count("kron_factored")
            return project_factors(value, P_out, P_in, run.token_block)
        return (P_out @ value.view(-1, *block.shape) @ P_in.T).flatten(1)

    def cost(self, p, b, rows, prices):
        """On factors two GEMMs over the n·T positions, ``A P_inᵀ`` (in → k_in) and
        ``D P_outᵀ`` (out → k_out); on flat rows ``P_out G_i P_inᵀ``, two GEMMs per row."""
        out, in_ = b.shape
        k_out, k_in = p.kron_shape(out, in_)
        if rows.factored:
            return prices.kron_factors(rows.n, rows.T, in_, out, k_in, k_out)
        return prices.gemm(k_out, in_, out, rows.n) + prices.gemm(k_out, k_in, in_, rows.n)

    def table_bytes(self, p, b):
        return 0.0

    def build_cost(self, p, b, prices):
        """Not counted: two small Gaussian factors (k_out·out + k_in·in numbers)."""
        return prices.counts()


class TableKind(ProjectionKind):
    """A kind applied by index tables (gathers and scatter-adds, no dense matrix); each
    block's kernel costs :func:`~gradalg.plan.estimates.ProjectionPrices.block_ops` small
    ops per chunk on top of its :meth:`work`."""

    def cost(self, p, b, rows, prices):
        return self.work(p, b, rows, prices) + prices.block_ops(rows.chunks)

    @abstractmethod
    def work(self, p, b, rows: Rows, prices):
        """The kernel's arithmetic and memory traffic for ``rows``."""

    def build_cost(self, p, b, prices):
        """The SJLT's non-zeros drawn (``sjlt_draws``, priced by the profile's measured
        ``sjlt_build_randoms``) and the tables' bytes touched fresh; nothing without an SJLT."""
        columns = self.sjlt_columns(p, b)
        return (prices.counts(sjlt_draws=float(columns * p.s), faulted=self.table_bytes(p, b)) if columns
                else prices.counts())

    def sjlt_columns(self, p, b) -> int:
        """Columns d of the block's SJLT stage (0: none)."""
        return 0


def _sjlt_cost(n: int, coords: float, calls: int, prices):
    """An SJLT of ``coords`` input coordinates (times its s) per row, for n rows in ``calls``
    products: each coordinate added into its output bin (a weighted ``bincount`` per example
    on the CPU, ``index_add_`` elsewhere: :func:`~gradalg.proj.kernels.sjlt_apply`): counted
    as ``coords · calls`` non-zeros read and ``coords · n`` bin steps, which the device profile
    prices by its measured ``sjlt_bytes`` (random access, not a GEMM)."""
    return prices.counts(flops=2.0 * n * coords, scatter=float(coords * calls), scatter_rows=float(coords * n))


def _gather_cost(n: int, T: int, m: int, factored: bool, prices):
    """m kept coordinates of n rows. On factors each entry is Σ_t d_{t,o} a_{t,i}: two
    gathers of (n, m, T) position vectors from the transposed factors (strided: priced at
    the elementwise rate) and their product summed over T; on flat rows a gather."""
    elem = prices.elem
    if factored:
        return prices.counts(flops=2.0 * n * T * m, elementwise=4.0 * elem * n * T * m, bytes=3.0 * elem * n * T * m)
    return prices.counts(bytes=2.0 * elem * n * m)


@register("sparse")
class Sparse(TableKind):
    """SJLT of the whole block: ``s`` non-zeros ±1/√s per column (one in each of s bands)."""

    sjlt = True
    map = "sparse JL"

    def apply(self, p, block, value, run):
        run.count(f"sparse_{_form(value)}")
        S = sjlt(p, block.name, block.dim, device=_device(value))
        return K.sjlt_block(value, block.shape, S, run.max_elements, run.token_block)

    def work(self, p, b, rows, prices):
        """n·d·s scatter-adds; factors materialized first (T·d per row, in slices of rows)."""
        cost = _sjlt_cost(rows.n, b.dim * p.s, rows.chunks, prices)
        if rows.factored:
            cost = cost + prices.materialize(rows.n, rows.T, b.shape[1], b.shape[0])
        return cost

    def sjlt_columns(self, p, b):
        return b.dim

    def table_bytes(self, p, b):
        """5·d·s: int32 rows and int8 signs (the CPU kernel's bincount reads them as they are)."""
        return 5.0 * p.s * b.dim


@register("mask")
class Mask(TableKind):
    """k of a block's d coordinates without replacement, scaled by √(d/k); per block (the
    default) or k of the concatenated space (``per_block=False``)."""

    default_per_block = True

    def block_shape(self, p, shape):
        return (p.mask_size(math.prod(shape)),)

    def apply(self, p, block, value, run):
        run.count(f"mask_{_form(value)}")
        device = _device(value)
        if not p.per_block:
            if run.space_blocks is None:
                raise PlanError("a global mask needs the names and sizes of all blocks (space_blocks)")
            positions, coords = global_mask(p, run.space_blocks, block.name, device=device)
            total = sum(d for _, d in run.space_blocks)
            kept = K.entries(value, block.shape, coords, run.max_elements) * math.sqrt(total / p.mask_size(total))
            out = kept.new_zeros(kept.shape[0], p.mask_size(total))
            out[:, positions] = kept
            return out
        m = p.mask_size(block.dim)
        coords = mask_indices(p, block.name, block.dim, m, device=device)
        return K.entries(value, block.shape, coords, run.max_elements) * math.sqrt(block.dim / m)

    def work(self, p, b, rows, prices):
        """The m = min(k, d) kept coordinates gathered (a global mask: the block's share of
        its k, k·d/Σd)."""
        if p.per_block:
            m = p.mask_size(b.dim)
        else:
            m = max(1, round(p.mask_size(rows.total) * b.dim / max(1, rows.total)))
        return _gather_cost(rows.n, rows.T, m, rows.factored, prices)

    def table_bytes(self, p, b):
        """16·min(k, d): positions and coordinates (per block, or its share of a global mask)."""
        return 16.0 * min(p.k, b.dim)


@register("grass")
class Grass(TableKind):
    """GraSS: a mask to ``mask_k`` coordinates (default 4k), then an SJLT to k, per block."""

    per_layer = True
    default_per_block = True
    sjlt = True
    masked = True

    def check(self, p):
        if p.mask_k is not None and p.mask_k < p.k:
            raise OptionError(f"mask_k = {p.mask_k} must be at least k = {p.k}: the mask "
                              "keeps more coordinates than the sparse projection outputs")

    def apply(self, p, block, value, run):
        run.count(f"grass_{_form(value)}")
        coords, S = grass_tables(p, block.name, block.dim, device=_device(value))
        kept = K.entries(value, block.shape, coords, run.max_elements)
        return K.sjlt_apply(kept, S) * math.sqrt(block.dim / coords.numel())

    def work(self, p, b, rows, prices):
        """The m = min(mask_k, d) kept coordinates gathered, then their SJLT (m·s adds per row)."""
        m = p.grass_mask_size(b.dim)
        return (_gather_cost(rows.n, rows.T, m, rows.factored, prices)
                + _sjlt_cost(rows.n, m * p.s, rows.chunks, prices))

    def sjlt_columns(self, p, b):
        return p.grass_mask_size(b.dim)

    def table_bytes(self, p, b):
        """8·m for the mask, 5·m·s for the SJLT."""
        return 8.0 * p.grass_mask_size(b.dim) + 5.0 * p.s * self.sjlt_columns(p, b)


@register("factgrass")
class FactGrass(TableKind, LayerKind):
    """FactGraSS: ``k_out`` output and ``k_in`` input features of the factors kept, the
    small (k_out, k_in) gradient formed, scaled by √(d / (k_out·k_in)), then an SJLT to k."""

    title = "a FactGraSS"
    sjlt = True

    def check(self, p):
        if p.k_out is not None and p.k_out * p.k_in < p.k:
            raise OptionError(f"factgrass keeps k_out * k_in = {p.k_out * p.k_in} features, fewer "
                              f"than k = {p.k}: the sparse projection would only pad; use "
                              f"k_out * k_in >= k (about {GRASS_BLOWUP}k is the default)")

    def apply(self, p, block, value, run):
        run.count(f"factgrass_{_form(value)}")
        out_idx, in_idx, S = factgrass_tables(p, block.name, *block.shape, device=_device(value))
        return K.factgrass(value, block.shape, out_idx, in_idx, S, run.token_block)

    def work(self, p, b, rows, prices):
        """On factors the kept features gathered (2·elem·T·(k_out + k_in) bytes per row) and
        the (k_out, k_in) gradient materialized (T·k_out·k_in); on flat rows a gather of
        k_out·k_in; then its SJLT (k_out·k_in·s adds per row)."""
        out, in_ = b.shape
        k_out, k_in = p.factgrass_shape(out, in_)
        n, T, elem = rows.n, rows.T, prices.elem
        if rows.factored:
            cost = (prices.counts(elementwise=2.0 * elem * n * T * (k_out + k_in))
                    + prices.materialize(n, T, k_in, k_out))
        else:
            cost = prices.counts(elementwise=2.0 * elem * n * k_out * k_in)
        return cost + _sjlt_cost(n, k_out * k_in * p.s, rows.chunks, prices)

    def sjlt_columns(self, p, b):
        if len(b.shape) != 2:
            return 0
        k_out, k_in = p.factgrass_shape(*b.shape)
        return k_out * k_in

    def table_bytes(self, p, b):
        """8·(k_out + k_in) for the masks, 5·k_out·k_in·s for the SJLT (an (out, in) block)."""
        if len(b.shape) != 2:
            return 0.0
        return 8.0 * sum(p.factgrass_shape(*b.shape)) + 5.0 * p.s * self.sjlt_columns(p, b)


@register("tensorsketch")
class TensorSketch(TableKind):
    """TensorSketch: an SJLT of each (out, in) block with the factored hash
    ``(h_out(o) + h_in(i)) mod k`` and sign ``σ_out(o)·σ_in(i)``; a flat (d,) block is (1, d)."""

    map = "tensorsketch"

    @staticmethod
    def _shape(b) -> tuple[int, int]:
        return b.shape if len(b.shape) == 2 else (1, b.dim)

    def apply(self, p, block, value, run):
        run.count(f"tensorsketch_{_form(value)}")
        shape = self._shape(block)
        tables = tensorsketch_tables(p, block.name, *shape, device=_device(value))
        return K.tensor_sketch(value, shape, tables, p.k, run.max_elements, run.token_block)

    def work(self, p, b, rows, prices):
        """On factors, per position two count sketches (T·(out + in) adds) and k bins of real
        FFTs and their product (a ``"tensorsketch"`` block per position and bin, priced by
        the profile's measured ``ts_bytes_per_bin``). On flat rows, per row of each example
        its count sketch (the signed row, n·out·in, scattered into fresh zeros of k), one
        real FFT (F = k/2 + 1 complex bins, fresh) and its product with the row's phase
        shift (fresh), the shift made once per call (its signs expanded, h·f, /k, the complex
        polar: 5·F numbers per row, fresh); the FFTs and products at the measured
        ``ts_flat_bytes``, the fresh memory faulted in."""
        out_f, in_f = self._shape(b)
        n, T, elem = rows.n, rows.T, prices.elem
        if rows.factored:
            return prices.counts(flops=2.0 * n * T * (out_f + in_f), elementwise=n * T * 4.0 * elem * (out_f + in_f),
                                 blocks=(("tensorsketch", float(n * T * p.k), 0.0),))
        F = p.k // 2 + 1
        bins = out_f * F
        fresh = float(elem) * (n * out_f * (in_f + p.k + 4 * F) + rows.chunks * 5 * bins)
        return prices.counts(flops=2.0 * n * b.dim, elementwise=n * out_f * 4.0 * elem * in_f, faulted=fresh,
                             blocks=(("tensorsketch_rows", float(n * bins), 0.0),
                                     ("tensorsketch_shift", float(bins * rows.chunks), 0.0)))

    def table_bytes(self, p, b):
        """9·(out + in): an int64 row and an int8 sign per output and per input."""
        return 9.0 * (sum(b.shape) if len(b.shape) == 2 else 1 + b.dim)
