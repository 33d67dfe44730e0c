"""Cost accounting for plans: exact operation counts from shapes, no tensors.

A :class:`Cost` counts, device-independently,

* ``flops``: floating-point operations (a multiply-add is 2), all of them;
* ``gemms``: the GEMMs among them by shape, ``(m, n, k, count, elem)`` for ``count``
  products ``(m, k) @ (k, n)`` in numbers of ``elem`` bytes, so that a device profile
  prices each at its own rate (a (16, 16) product runs far below the rate of a (512,
  512) one); ``bmms``: batched GEMMs ``(b, m, n, k, count, elem)``, ``count`` calls that
  each multiply ``b`` independent pairs ``(m, k) @ (k, n)`` (``torch.bmm``, an einsum
  over examples): priced by their total size plus one call's fixed cost, not as ``b``
  separate calls; ``eighs``: symmetric eigendecompositions ``(d, count)``;
* ``bytes`` moved through memory (copies, casts, materialized rows) and ``elementwise``
  bytes of a model's forward and backward (activations through nonlinearities, norms);
* ``peak_bytes``, the largest simultaneous footprint;
* ``passes`` over datasets, and fixed costs: module ``calls`` (each forward or backward
  of a module: a hook, an autograd node), small tensor ``ops`` (gradalg's per-chunk
  bookkeeping), captured ``batches`` and recorded ``layer_batches`` (a layer of a
  captured batch), and ``blocks``: the fixed cost of gradalg's own work per block of a
  chunk, ``(kind, count, ops)`` for ``count`` blocks of a job or step of that kind
  ("ekfac", "kfac", "scores", "ghost", "precondition", "resolve", …), priced at the
  device profile's measured seconds per block of that kind (``block_seconds``), else as
  ``ops`` small ops each.

:meth:`gradalg.devices.DeviceProfile.time_of` turns a Cost into seconds; a model's
forward FLOPs and activations are counted by :mod:`gradalg.plan.shapes` from the layer
registry (:mod:`gradalg.capture.layers`). The per-kernel formulas are those of
the kernels in :mod:`gradalg.capture.factors` (the lowest floor the planner imports);
unit tests pin them to exact numbers.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, fields

import torch

from ..capture.factors import dense_flops, ghost_flops
from ..expr.tokens import token_rows
from ..units import si as _si   # FLOPs and bytes: three digits, decimal prefixes

__all__ = ["Cost", "first_example_shape", "tokens_hint", "data_tokens_hint", "gemm_cost", "bmm_cost",
           "gram_cost", "ghost_cost",
           "dense_cost", "materialize_cost", "kron_project_cost", "fisher_cost", "eigh_cost", "block_cost",
           "svd_cost", "SVD_GEMMS"]


@dataclass(frozen=True)
class Cost:
    """An estimated cost: counts from shapes alone, no data read.

    flops : floating-point operations, a multiply-add counted as 2.
    bytes : bytes moved (read and written) through memory.
    peak_bytes : the largest working set held at once (adding two costs takes the max).
    passes : passes over a dataset (forward + backward of each example).
    calls : kernel launches / framework calls (their fixed overhead on a device)."""
    flops: float = 0.0
    bytes: float = 0.0
    peak_bytes: float = 0.0
    passes: float = 0.0
    calls: float = 0.0
    gemms: tuple = ()          # ((m, n, k, count, elem), ...): GEMMs priced by shape (their FLOPs are in flops)
    eighs: tuple = ()          # ((d, count), ...): float64 eigendecompositions (their FLOPs are in flops)
    ops: float = 0.0           # small tensor ops (fixed dispatch cost each)
    batches: float = 0.0       # captured batches (fixed Python cost each)
    layer_batches: float = 0.0  # recorded layers × captured batches
    elementwise: float = 0.0   # bytes of a model's elementwise work (priced at the elementwise bandwidth)
    faulted: float = 0.0       # bytes of fresh memory touched (page faults)
    randoms: float = 0.0       # float64 random numbers drawn on the CPU (a dense projection's matrix)
    bmms: tuple = ()           # ((b, m, n, k, count, elem), ...): count batched calls of b GEMMs each (FLOPs in flops)
    blocks: tuple = ()         # ((kind, count, ops), ...): fixed costs per block of a kind (measured, else ops each)
    #: sparse-JL products (``gradalg.proj.kernels.sjlt_apply``): non-zeros × calls (a row and
    #: sign read, a bin index formed) and non-zeros × rows (one bincount / index_add step),
    #: priced by the profile's ``sjlt_bytes``; non-zeros of tables drawn, by its ``sjlt_build_randoms``
    scatter: float = 0.0
    scatter_rows: float = 0.0
    sjlt_draws: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        """Both costs, one after the other: every field summed (tuples joined), except
        ``peak_bytes``, the larger of the two. Called in every estimate loop (48 k times
        to plan a 7B model twice): the fields are set directly, not through the frozen
        ``__init__`` (there is no ``__post_init__`` to skip), 30 % faster than a call listing them."""
        out = object.__new__(Cost)
        fields_ = out.__dict__
        fields_.update(zip(_FIELDS, map(operator.add, self.__dict__.values(), other.__dict__.values())))
        fields_["peak_bytes"] = max(self.peak_bytes, other.peak_bytes)
        return out

    def scaled(self, c: float) -> "Cost":
        """This cost repeated ``c`` times: every count times ``c`` except ``peak_bytes``
        (repetitions run one after another and reuse the memory)."""
        return Cost(self.flops * c, self.bytes * c, self.peak_bytes, self.passes * c, self.calls * c,
                    tuple((m, n, k, count * c, e) for m, n, k, count, e in self.gemms),
                    tuple((d, count * c) for d, count in self.eighs), self.ops * c, self.batches * c,
                    self.layer_batches * c, self.elementwise * c, self.faulted * c, self.randoms * c,
                    tuple((b, m, n, k, count * c, e) for b, m, n, k, count, e in self.bmms),
                    tuple((kind, count * c, ops) for kind, count, ops in self.blocks),
                    self.scatter * c, self.scatter_rows * c, self.sjlt_draws * c)

    def seconds(self, profile, dtype=torch.float32) -> float:
        """Estimated seconds on a device ``profile`` (:mod:`gradalg.devices`): GEMMs by
        shape, eigendecompositions by size, elementwise traffic, per-call and per-batch overheads."""
        return profile.time_of(self, dtype)

    def __repr__(self) -> str:
        return f"Cost({self.describe()}, {_si(self.bytes)}B moved)"

    def describe(self) -> str:
        """One line for plans: FLOPs, peak memory and passes over data."""
        return (f"~{_si(self.flops)}FLOP, peak ~{_si(self.peak_bytes)}B, "
                f"{self.passes:g} pass(es) over data")


#: Cost's field names in order (as ``__init__`` sets them in an instance's ``__dict__``)
_FIELDS = tuple(f.name for f in fields(Cost))


# ------------------------------------------------------------------ kernel formulas
def gemm_cost(m, n, k, count=1, elem=4) -> Cost:
    """``count`` GEMMs ``(m, k) @ (k, n)`` (a batched matmul is ``count`` of them)."""
    if m <= 0 or n <= 0 or k <= 0 or count <= 0:
        return Cost()
    return Cost(flops=2.0 * m * n * k * count, gemms=((m, n, k, count, elem),))


def bmm_cost(b, m, n, k, count=1, elem=4) -> Cost:
    """``count`` calls of one batched GEMM that multiplies ``b`` independent pairs
    ``(m, k) @ (k, n)`` (``torch.bmm``, ``baddbmm``, an einsum over examples): the FLOPs
    of ``b · count`` products, priced by a device profile at its batched rate plus one
    call's fixed cost per call (:meth:`~gradalg.devices.DeviceProfile.bmm_seconds`).
    A batch of one is a plain GEMM (:func:`gemm_cost`)."""
    if b <= 0 or m <= 0 or n <= 0 or k <= 0 or count <= 0:
        return Cost()
    if b == 1:
        return gemm_cost(m, n, k, count, elem)
    return Cost(flops=2.0 * b * m * n * k * count, bmms=((b, m, n, k, count, elem),))


def gram_cost(rows, d, elem=4, block=128) -> Cost:
    """``Xᵀ X`` for X (rows, d) by :func:`gradalg.curvature.kron.gram`: only the blocks of
    ``block`` columns on and above the diagonal, one GEMM per block row (one (d, d) GEMM for d ≤ ``block``)."""
    return sum((gemm_cost(min(block, d - start), d - start, rows, 1, elem) for start in range(0, d, block)), Cost())


def materialize_cost(n, T, n_in, n_out, elem=4) -> Cost:
    """G_i = D_iᵀ A_i for n examples: one batched call of n GEMMs (out, in, T) (an einsum
    over the examples, ``capture.factors.materialize``) and the (n, out, in) result written."""
    return bmm_cost(n, n_out, n_in, T, 1, elem) + Cost(bytes=float(elem) * n * n_in * n_out)


def ghost_cost(nL, nR, TL, TR, n_in, n_out, elem=4) -> Cost:
    """Ghost inner products of nL × nR examples (2 FLOPs per multiply-add): the
    activation and output-gradient Grams (one GEMM each over the flattened positions),
    then their elementwise product summed over positions."""
    pairs = nL * nR * TL * TR
    flops = 2.0 * ghost_flops(nL, nR, TL, TR, n_in, n_out)
    shaped = gemm_cost(nL * TL, nR * TR, n_in, 1, elem) + gemm_cost(nL * TL, nR * TR, n_out, 1, elem)
    return Cost(flops=flops, gemms=shaped.gemms, bytes=3.0 * elem * pairs)


def dense_cost(nL, nR, TL, TR, n_in, n_out, left_ready=True, elem=4) -> Cost:
    """Materialize the streamed side (and the held side unless ready; one batched call of
    per-example (out, in, T) GEMMs each), then one GEMM."""
    flops = 2.0 * dense_flops(nL, nR, TL, TR, n_in, n_out, left_ready=left_ready)
    shaped = bmm_cost(nR, n_out, n_in, TR, 1, elem) + gemm_cost(nL, nR, n_in * n_out, 1, elem)
    if not left_ready:
        shaped = shaped + bmm_cost(nL, n_out, n_in, TL, 1, elem)
    return Cost(flops=flops, bytes=float(elem) * nR * n_in * n_out, gemms=shaped.gemms, bmms=shaped.bmms)


def kron_project_cost(n, T, n_in, n_out, k_in, k_out, elem=4) -> Cost:
    """(A P_inᵀ, D P_outᵀ): factor-wise Kronecker projection, factors kept."""
    return gemm_cost(n * T, k_in, n_in, 1, elem) + gemm_cost(n * T, k_out, n_out, 1, elem)


def fisher_cost(n, block_dims, structure) -> Cost:
    """Σ g gᵀ over n rows in float64 (the rows cast once): one (d, d, n) GEMM dense,
    one per block, or squares for a diagonal; the statistics' bytes are the peak."""
    if structure == "dense":
        d = sum(block_dims)
        return gemm_cost(d, d, n, 1, 8) + Cost(bytes=12.0 * n * d, peak_bytes=8.0 * d * d)
    if structure == "block":
        return sum((gemm_cost(d, d, n, 1, 8) for d in block_dims),
                   Cost(bytes=12.0 * n * sum(block_dims), peak_bytes=8.0 * sum(d * d for d in block_dims)))
    return Cost(flops=2.0 * n * sum(block_dims), bytes=28.0 * n * sum(block_dims), peak_bytes=8.0 * sum(block_dims))


#: GEMM-equivalents (max(out, in), m, m) of one thin SVD besides its m-sized eigensolve:
#: the bidiagonalization (half of it matrix-vector work, slower than a GEMM) and the two
#: back-transformations; calibrated on the GPT-2 4×256 query pass of
#: ``benchmarks/lowrank_queries.py``, 16 queries (measured / estimated time of the pass: 1.65×
#: with 3, 1.35× with 6; the same pass without SVDs 1.45×)
SVD_GEMMS = 6


def svd_cost(n, n_out, n_in, elem=4) -> Cost:
    """Thin SVDs of n (out, in) matrices (``torch.linalg.svd``, one batched call), priced as
    :data:`SVD_GEMMS` batched GEMMs (max, m, m) per matrix of width m = min(out, in) and
    an m-sized eigendecomposition; the factors written."""
    m, big = min(n_out, n_in), max(n_out, n_in)
    return (bmm_cost(n, big, m, m, SVD_GEMMS, elem) + eigh_cost(m, n)
            + Cost(bytes=float(elem) * n * (n_out + n_in + 1) * m))


def block_cost(kind: str, count: float, ops: float = 0.0) -> Cost:
    """The fixed cost of ``count`` blocks of gradalg's per-block work of ``kind`` (a job's
    work on one block of one chunk, a resolved operator applied to or resolved for one
    block): the casts, views, small products and accumulations beyond the GEMMs and
    traffic counted by shape, priced at the profile's measured seconds per block of that
    kind (:attr:`gradalg.devices.DeviceProfile.block_seconds`), else as ``ops``
    small ops each."""
    if count <= 0:
        return Cost()
    return Cost(blocks=((kind, float(count), float(ops)),))


def eigh_cost(d, count=1) -> Cost:
    """Symmetric eigendecomposition ≈ 9 d³ FLOPs (tridiagonalization + QR iterations)."""
    return Cost(flops=9.0 * d ** 3 * count, peak_bytes=16.0 * d * d, eighs=((d, count),))


# ------------------------------------------------------------------ data
#: ``{(data key, collate_fn): (shape, dtype) | None}`` of the datasets planned so far (bounded)
_FIRST_SHAPES: dict = {}
_FIRST_SHAPES_KEPT = 1024


def first_example_shape(data) -> tuple | None:
    """``(shape, dtype)`` of the first tensor of a batch holding the data's first example
    (its batch dimension first), or None when it cannot be read. Read once per dataset:
    cached by the data's content fingerprint (``DataRef.key``) and ``collate_fn``, so
    every gradient source over the same data shares the read; planning reads one
    example's shape, nothing more."""
    fingerprint = getattr(data, "key", None)
    key = (fingerprint, getattr(data, "collate_fn", None))
    try:
        if fingerprint is not None and key in _FIRST_SHAPES:
            return _FIRST_SHAPES[key]
    except TypeError:         # an unhashable collate_fn: not cached
        fingerprint = None
    shape = None
    with contextlib.suppress(Exception):    # a shape hint must never fail planning
        first = data.first_example_batch()
        while not isinstance(first, torch.Tensor):
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        shape = (tuple(first.shape), first.dtype)
    if fingerprint is not None:
        if len(_FIRST_SHAPES) >= _FIRST_SHAPES_KEPT:
            _FIRST_SHAPES.pop(next(iter(_FIRST_SHAPES)))
        _FIRST_SHAPES[key] = shape
    return shape


def tokens_hint(node) -> int:
    """Positions per example T, read off the first example's shape (1 when unknown).

    Reads the shape of one example of the data (no model is run), once per dataset
    (:func:`first_example_shape` keeps it by the data's fingerprint; nothing is cached
    on the node).
    """
    data = getattr(node.source, "data", None)   # per-token rows (ga.GradientSet.per_token): one position each
    return data_tokens_hint(data) if data is not None and token_rows(node) <= 1 else 1


def data_tokens_hint(data) -> int:
    """Positions per example T of ``data``: the second dimension of an integer first
    tensor (token ids), else 1."""
    first = first_example_shape(data)
    if first is not None and len(first[0]) == 2 and not first[1].is_floating_point:
        return int(first[0][1])
    return 1
