"""The Kronecker statistics jobs, K-FAC's factors and EK-FAC's eigenvalue correction,
with their accumulators.

Per 2-D (out, in) block, K-FAC sums S = E[DᵀD] and A = E[AᵀA] over m = c·T positions of a
chunk and eigendecomposes them when its pass ends; EK-FAC (a second pass: it depends on
the K-FAC job of the same operator) rotates each example's gradient into those
eigenbases and sums its squares, Λ = (1/n) Σ_i (Q_Sᵀ G_i Q_A)², rotating the factors or
each example's gradient formed first, whichever is fewer FLOPs (:func:`gradient_first`).
Kernels over factors take ``token_block`` positions at once; factors wider than ``kron_float64_width`` are summed
and eigendecomposed in float32, wider than ``kron_diagonal_width`` kept as their
diagonal (the job's fields, from ``ga.options``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...capture.chunks import Chunk
from ...capture.factors import Factors, token_slices
from ...curvature.kron import FLOAT32_ROUNDOFF, KronStats, basis_dtype, factor_eigenbasis
from ...errors import GradalgError
from ...expr import KFAC, Source
from ...linalg.kron import (BlockEigenvalues, KronOp, diagonal_factor_rules, diagonal_factors, is_diagonal_factor,
                            rotate_factors, rotate_rows, work_dtype)
from ...units import format_bytes, format_bytes_alike
from ..cost import Cost, bmm_cost, block_cost, eigh_cost, gemm_cost, gram_cost
from ..estimates import factored_blocks
from ..decisions import Decision, DecisionKind
from ..memory import positions
from ..shapes import element_size
from .fisher import StatisticsJob
from .scores import reused_buffer

__all__ = ["KronStatisticsJob", "KFACJob", "EKFACJob", "KronAccumulator", "EKFACAccumulator", "kron_factor_bytes",
           "kron_bytes", "kron_output_bytes", "basis_dtype", "correction_traffic", "gradient_first", "rotate_gradients"]


@dataclass(eq=False, frozen=True)
class KronStatisticsJob(StatisticsJob):
    """A job accumulating per-block Kronecker statistics: two (out, out) and (in, in)
    matrices per block are its footprint and its output."""

    #: its operator's eigenvalues are a re-fitted (out, in) grid per block (EK-FAC), not
    #: K-FAC's two vectors (:func:`kron_output_bytes`)
    refits: ClassVar[bool] = False

    def fixed_bytes(self, facts) -> float:
        return kron_bytes(self.target.space, self.kron_float64_width, self.kron_diagonal_width, facts.dtype)

    def bytes_arithmetic(self, facts) -> str:
        """:func:`kron_bytes` spelled out: the sums, bases and eigenvalues of the blocks, and
        the largest eigendecomposition, with the widest factor's size and precision; when a
        dense factor is wider than ``kron_float64_width``, the option that keeps it diagonal
        and what the statistics then take (the fix a refusal names). Bytes in one unit
        (:func:`~gradalg.units.format_bytes_alike`)."""
        space, f64, rows_dtype = self.target.space, self.kron_float64_width, facts.dtype
        t = _KronTerms(space, f64, self.kron_diagonal_width, rows_dtype)
        widest, narrower = t.eigh_width, max([d for d in t.dense if d < t.eigh_width] or [1])
        wide = widest and f64 is not None and widest > f64
        fix = kron_bytes(space, f64, narrower, rows_dtype) if wide else 0.0
        sums, update, bases, lam, eigh, peak, fix = format_bytes_alike(t.sums, t.update, t.bases, t.lam, t.eigh,
                                                                       t.peak, fix)
        dtype = kron_factor_bytes(widest, f64)["dtype"]
        return (f"Kronecker statistics of {len(space.blocks)} block(s): factor sums {sums} + a chunk's update "
                f"({update}), or, finishing block by block, each block's larger of its sums and eigenbases "
                f"(eigenbases {bases} in all) + eigenvalues {lam}"
                + (f" + the largest eigendecomposition ({widest}×{widest}, {dtype}) {eigh}" if widest else "")
                + (f"; {len(t.diagonal)} factor(s) of width {max(t.diagonal):,} kept diagonal" if t.diagonal else "")
                + f" = {peak}"
                + (f"; to keep the {widest}×{widest} factor (and any wider) diagonal instead, "
                   f"ga.options(kron_diagonal_width={narrower}): {fix}" if wide else ""))

    def output_bytes(self, n: int) -> float:
        """The eigenbases and eigenvalues of each block (:attr:`refits`)."""
        return kron_output_bytes(self.target.space, self.kron_float64_width, self.kron_diagonal_width, self.refits,
                                 rows_dtype=self.rows_dtype())

    def rows_dtype(self) -> torch.dtype | None:
        """The dtype of the rows it reads: its model's (as the plan's ``facts.dtype``; None: unknown)."""
        src = next((n for n in (self.streams[0].walk() if self.streams else ()) if isinstance(n, Source)), None)
        return None if src is None else next((p.dtype for p in src.task.model.parameters()), None)

    def _diagonal(self, d: int) -> bool:
        return is_diagonal_factor(d, self.kron_diagonal_width)

    def describe(self) -> str:
        """Its kind and its operator's, and the examples its statistic is estimated on
        when not all (the node's :class:`~gradalg.expr.curvature.SubsetNote` of this kind)."""
        notes = [str(x) for x in self.target.subset_notes() if x.statistic == self.kind]
        kind = "ekfac" if self.target.eigen_correction else "kfac"
        return f"{self.kind} {kind}" + (f" ({notes[0]})" if notes else "")


@dataclass(eq=False, frozen=True)
class KFACJob(KronStatisticsJob):
    """K-FAC's Kronecker factors S = E[DᵀD], A = E[AᵀA] per block, and their eigenbases."""

    kind: ClassVar[str] = "kfac"
    ops_per_block: ClassVar[int] = 14
    reads_stored_factors: ClassVar[bool] = True

    def chunk_cost(self, node, c, layout, facts) -> Cost:
        """The factor sums over one chunk, per 2-D block and m = c·T positions: for A (in)
        and S (out) a dense factor's Gram and d × d float64 sums, a diagonal one's squares."""
        T, cost, elem = positions(node, facts.shapes), Cost(), facts.elem
        for b in (b for b in node.space.blocks if len(b.shape) == 2):
            m = c * T[b.name]
            for d in (b.shape[1], b.shape[0]):   # A, S
                if self._diagonal(d):
                    cost = cost + Cost(flops=2.0 * m * d, bytes=elem * m * d * 2 + 16.0 * d)
                else:
                    cost = cost + gram_cost(m, d, elem) + Cost(bytes=elem * m * d + 24.0 * d * d)
            cost = cost + Cost(bytes=elem * m * b.shape[1])
        return cost

    def once_cost(self, facts, storage_of=None, options=None, resolved=None) -> Cost:
        """The eigendecompositions at the end of its pass: one per dense factor (A, then S)."""
        return sum((eigh_cost(d) for b in self.streams[0].space.blocks if len(b.shape) == 2
                    for d in (b.shape[1], b.shape[0]) if not self._diagonal(d)), Cost())

    def first_decisions(self, options) -> list[Decision]:
        """The precision (float32 or float64) and form (dense or diagonal) of each factor: a
        :class:`~gradalg.plan.decisions.Decision` for each block with a factor wider than
        ``options.kron_float64_width`` (``KRON_PRECISION``, with the bytes of both
        precisions) or wider than ``options.kron_diagonal_width`` (``KRON_DIAGONAL``:
        diagonal, with the bytes of the dense factor it replaces)."""
        op, width, diagonal_width = self.target, options.kron_float64_width, options.kron_diagonal_width
        rows = []
        for b in (b for b in op.space.blocks if len(b.shape) == 2):
            sides = (("S", b.shape[0]), ("A", b.shape[-1]))
            diag = [(label, d) for label, d in sides if d > diagonal_width]
            if diag:
                rows.append(_diagonal_decision(op, b, diag, options))
            wide = [(label, d) for label, d in sides if width < d <= diagonal_width]
            if not wide:
                continue
            f32, f64 = (kron_factor_bytes(max(d for _, d in wide), w) for w in (width, None))
            peak32, peak64 = (format_bytes(f["sum"] + f["basis"] + f["eigh"]) for f in (f32, f64))
            sum32, basis32, eigh32, basis64, eigh64 = format_bytes_alike(f32["sum"], f32["basis"], f32["eigh"],
                                                                         f64["basis"], f64["eigh"])
            factors = " and ".join(f"{label} ({dd}×{dd})" for label, dd in wide)
            rows.append(Decision(
                DecisionKind.KRON_PRECISION, op.token, "float32",
                {"float32": f"{peak32} at its eigendecomposition", "float64": f"{peak64} at its eigendecomposition"},
                f"{factors} wider than ga.options(kron_float64_width={width}): summed in float32 with a Kahan "
                f"compensation ({sum32}), eigendecomposed in float32 on the device (basis {basis32}, workspace "
                f"{eigh32}; float64: {basis64} and {eigh64}) and checked to kron_float32_rtol="
                f"{options.kron_float32_rtol:g} (residual, orthogonality, the error of inverted eigenvalues)",
                block=b.name))
        return rows

    def example_bytes(self, facts) -> float:
        """One example's sums: one token block of its factors in float64 per 2-D block."""
        node = self.streams[0]
        T = positions(node, facts.shapes)
        return sum(self.at_once(T[b.name]) * sum(b.shape) * 8.0 for b in node.space.blocks if len(b.shape) == 2)

    def accumulator(self, ctx) -> "KronAccumulator":
        return KronAccumulator(self.target, self.token_block, self.kron_float64_width, self.kron_float32_rtol,
                               self.kron_diagonal_width)

    def publish(self, result, state) -> None:
        """An EK-FAC operator's eigenbases wait in ``state.kron`` for its correction."""
        where = state.kron if self.target.eigen_correction else state.ops
        where[self.target.token] = result


@dataclass(eq=False, frozen=True)
class EKFACJob(KronStatisticsJob):
    """EK-FAC's eigenvalue correction E[(Q_Sᵀ G Q_A)²], in the KFACJob's eigenbases
    (a second pass: it depends on the KFACJob of the same operator)."""

    kind: ClassVar[str] = "ekfac"
    ops_per_block: ClassVar[int] = 10
    refits: ClassVar[bool] = True

    def chunk_cost(self, node, c, layout, facts) -> Cost:
        """The correction over one chunk: each (out, in) block rotated into the K-FAC
        eigenbases (factors: each example's gradient formed first and rotated where
        :func:`gradient_first` says it is fewer FLOPs, else
        ``kron.rotate_factors``, one example at a time where a factor is diagonal; flat
        rows: ``kron.rotate_rows``), squared and summed."""
        T, factored, cost, elem = positions(node, facts.shapes), factored_blocks(node, layout), Cost(), facts.elem
        for b in (b for b in node.space.blocks if len(b.shape) == 2):
            (out_f, in_f), t = b.shape, T[b.name]
            squares = Cost(bytes=4.0 * elem * c * out_f * in_f)     # rotated, squared, summed
            if not factored[b.name]:                                     # kron.rotate_rows
                cost = (cost + bmm_cost(c, out_f, in_f, out_f, 1, elem) + gemm_cost(c * out_f, in_f, in_f, 1, elem)
                        + squares)
            elif self._diagonal(out_f) or self._diagonal(in_f):
                # rotate_factors one example at a time (EKFACAccumulator), an identity side not rotated
                for d in (d for d in (in_f, out_f) if not self._diagonal(d)):
                    cost = cost + gemm_cost(t, d, d, c, elem)
                cost = cost + gemm_cost(out_f, in_f, t, c, elem) + block_cost("ekfac", c - 1, 3) + squares
            elif gradient_first(b, t):                                   # G_i formed, then rotated (two buffers)
                calls = len(token_slices(int(t), self.token_block))
                cost = (cost + bmm_cost(c, out_f, in_f, t / calls, calls, elem)
                        + gemm_cost(c * out_f, in_f, in_f, 1, elem) + bmm_cost(c, out_f, in_f, out_f, 1, elem)
                        + correction_traffic(c, out_f, in_f, _work_elem(facts), outputs=3))
            else:                                                        # kron.rotate_factors, into a buffer
                cost = (cost + gemm_cost(c * t, in_f, in_f, 1, elem) + gemm_cost(c * t, out_f, out_f, 1, elem)
                        + bmm_cost(c, out_f, in_f, t, 1, elem) + correction_traffic(c, out_f, in_f, _work_elem(facts)))
        return cost

    def once_cost(self, facts, storage_of=None, options=None, resolved=None) -> Cost:
        """Opening and finishing its accumulator (:class:`EKFACAccumulator`), per block of
        m = out·in eigenvalues: its float64 sums made (zeros: 8·m bytes, fresh pages
        faulted in at the profile's ``fault_bandwidth``, as the runner gave the previous
        pass's free pages back) and, when the pass ends, divided by n and cast to the
        K-FAC eigenvalues' dtype (a float64 grid written and read, one in that dtype
        written: 8·m + 16·m + 12·m bytes at the elementwise bandwidth). Each of the two
        steps costs a ``resolve`` unit per block (``block_seconds``, measured on a block's
        eigenvalues made in float64 and cast back: the same ops). A block whose K-FAC
        eigenvalues carry an error bound (a dense factor wider than ``kron_float64_width``,
        eigendecomposed in float32) also has the K-FAC Λ scanned for its extremes and the
        corrected one's max |·| read: one ``resolve`` unit more and
        :data:`BlockEigenvalues.SCAN_SWEEPS <gradalg.linalg.kron.BlockEigenvalues.SCAN_SWEEPS>`
        + 2 float64 sweeps. Unpriced before, the two took 0.4 ms of LoGra's 4 ms correction
        pass on a 1-layer Mistral (issue 28)."""
        blocks, width = self.target.space.blocks, self.kron_float64_width
        wide = [b for b in blocks if len(b.shape) == 2
                and any(width is not None and d > width and not self._diagonal(d) for d in b.shape)]
        # whole-number byte counts (< 2⁵³): summed exactly in any order
        sweeps = sum((8.0 + 16.0 + 12.0) * b.dim for b in blocks) + sum(
            (BlockEigenvalues.SCAN_SWEEPS + 2.0) * 8.0 * b.dim for b in wide)
        fresh = 8.0 * sum(b.dim for b in blocks)          # the sums: the runner returned the last pass's pages
        return block_cost("resolve", 2 * len(blocks) + len(wide)) + Cost(elementwise=sweeps, faulted=fresh)

    def example_bytes(self, facts) -> float:
        """One example's correction, a block at a time (``EKFACAccumulator.update``): its
        row of the reused buffer of rotated gradients, sized to the widest block (w·d_max,
        w the work dtype's bytes: 4, or 8 for float64 rows), beside the rotation of a
        block of flat rows (two rotated copies and their squares, 3·w·d_max), and one
        token block of the widest block's rotated factors, T_b·(out + in)·w; where a
        block's gradients are formed before they are rotated (:func:`gradient_first`), the
        second reused buffer their right rotation is written into (w·d of the widest such
        block). A block with a diagonal factor is rotated one example at a time (counted
        in :meth:`fixed_bytes`)."""
        node, w, T = self.streams[0], _work_elem(facts), positions(self.streams[0], facts.shapes)
        blocks, diag = node.space.blocks, diagonal_factors(node.space, self.kron_diagonal_width)
        widest = max((b.dim for b in blocks if b.name not in diag), default=0)
        factors = max((self.at_once(T[b.name]) * sum(b.shape) * w for b in blocks if len(b.shape) == 2), default=0.0)
        turned = max((b.dim for b in blocks if b.name not in diag and gradient_first(b, T[b.name])), default=0)
        return 4.0 * w * widest + w * turned + factors

    def fixed_bytes(self, facts) -> float:
        """The statistics' bytes: the K-FAC operator it rotates into (its eigenbases and
        eigenvalue vectors, :func:`kron_output_bytes`), its float64 sums of squares (one
        (out, in) grid per block) and, when it finishes, the corrected eigenvalues (one
        grid per block) beside them; one example's rotated gradient of a block with a
        diagonal (vocabulary-wide) factor, which is corrected one example at a time: its
        (out, in) rotated gradient, squared in place, and their float64 copy, 16·out·in
        bytes for the largest such block; and the reused (out, in) buffer of a chunk's
        summed squares, w·d_max (``EKFACAccumulator``)."""
        space, f64, dw = self.target.space, self.kron_float64_width, self.kron_diagonal_width
        diag = diagonal_factors(space, dw)
        stats = kron_output_bytes(space, f64, dw, False, facts.dtype) + sum(     # whole bytes: summed exactly
            _eigenvalue_bytes(o, i, parts, True) + 8.0 * o * i
            for o, i, parts in _factor_parts(space, f64, dw, facts.dtype))
        summed = _work_elem(facts) * max([b.dim for b in space.blocks if b.name not in diag] or [0])
        return stats + max([16.0 * b.dim for b in space.blocks if b.name in diag] or [0.0]) + summed

    def bytes_arithmetic(self, facts) -> str:
        return ("EK-FAC correction: eigenbases, K-FAC and corrected eigenvalues and their float64 sums "
                + format_bytes(self.fixed_bytes(facts)))

    def accumulator(self, ctx) -> "EKFACAccumulator":
        """Rotates into the eigenbases the K-FAC job's pass left in ``ctx.state.kron``."""
        return EKFACAccumulator(self.target, ctx.state.kron[self.target.token], self.token_block, self.buffer_bytes)


def _work_elem(facts) -> int:
    """Bytes per number of the correction's work dtype (``work_dtype`` of the rows): 8 for
    float64 rows, else 4 (half-precision rows are rotated in float32)."""
    return 8 if facts.dtype == torch.float64 else 4


def correction_traffic(c: int, out_f: int, in_f: int, w: int, outputs: int = 1) -> Cost:
    """Memory traffic of EK-FAC's correction of one (out, in) block over a chunk of c
    examples (``EKFACAccumulator.update``) beyond the rotation's GEMMs, with w the work
    dtype's bytes and m = out·in:

    * the batched GEMM's output, written into the reused buffer: w·c·m bytes (its k = T_b
      positions is small for an expert's routed tokens, so the write is not hidden behind
      its FLOPs), ``outputs`` times (3 where the gradients are formed first: G_i, G_i Q_A
      and Q_Sᵀ G_i Q_A, :func:`gradient_first`);
    * the squares, in place: read and write, 2·w·c·m, at the elementwise rate;
    * the sum over the chunk into the reused (out, in) buffer: w·c·m read, w·m written;
    * added into the float64 sums: w·m + 8·m read, 8·m written.

    No fresh memory: the buffers are reused across blocks and chunks (fresh ones are
    faulted in at the page-fault rate: :class:`EKFACAccumulator`)."""
    m = float(out_f) * in_f
    return Cost(bytes=outputs * w * c * m + w * c * m + w * m + (w + 16.0) * m, elementwise=2.0 * w * c * m)


def gradient_first(b, T: int) -> bool:
    """Whether EK-FAC's correction of the (out, in) block ``b`` from factors of ``T``
    positions per example forms each example's gradient G_i = Σ_p D_pᵀ A_p first and
    rotates it, Q_Sᵀ G_i Q_A (2·out·in·(T + out + in) FLOPs per example:
    :func:`rotate_gradients`), rather than rotating its factors, Σ_p (D_p Q_S)ᵀ (A_p Q_A)
    (2·T·(out² + in² + out·in): ``kron.rotate_factors``): when it is fewer FLOPs,
    T·(out² + in²) > out·in·(out + in) — T > d for a d × d block (LoGra's projected
    64 × 64 blocks over 128 positions: 1.5× fewer, over 512: 3×). Not for one-hot inputs
    (an embedding's, or a tied block's): their factors' rotation is a gather. The plan
    prices what the run does (:meth:`EKFACJob.chunk_cost`, :class:`EKFACAccumulator`)."""
    if len(b.shape) != 2 or b.kind in ("embedding", "tied"):
        return False
    out_f, in_f = b.shape
    return T * (out_f ** 2 + in_f ** 2) > out_f * in_f * (out_f + in_f)


def rotate_gradients(F: Factors, Q_S: torch.Tensor, Q_A: torch.Tensor, token_block: int | None = None,
                     out: torch.Tensor | None = None, work: torch.Tensor | None = None) -> torch.Tensor:
    """``Q_Sᵀ G_i Q_A`` for each example, its gradient formed first: G_i = Σ_p D_pᵀ A_p
    over token blocks p (batched GEMMs, into ``out``), then G_i Q_A as one (n·out, in, in)
    GEMM (into ``work``) and Q_Sᵀ · as a batched one (back into ``out``), in the work
    dtype (``work_dtype`` of the rows). ``out``, ``work``: (n, out, in) buffers the
    caller reuses (both or neither). Dense bases and activations only.   (n, out, in)"""
    dtype, n, o, i = work_dtype(F.D), F.n, Q_S.shape[0], Q_A.shape[0]
    G = None
    for tp in token_slices(F.T, token_block):
        Fp = F.tokens(tp)
        D, A = Fp.D.to(dtype).transpose(1, 2), Fp.A.to(dtype)      # (n, out, b), (n, b, in)
        if G is None:
            G = torch.bmm(D, A) if out is None else torch.bmm(D, A, out=out)
        else:
            G.baddbmm_(D, A)
    if G is None:                                                   # no positions: G_i = 0
        return torch.zeros(n, o, i, dtype=dtype, device=F.D.device) if out is None else out.zero_()
    right = torch.matmul(G.view(n * o, i), Q_A.to(dtype), out=None if work is None else work.view(n * o, i))
    return torch.matmul(Q_S.T.to(dtype), right.view(n, o, i), out=out)     # G is not read: written over


# ------------------------------------------------------------------ bytes of the statistics
def kron_factor_bytes(d: int, float64_width: int | None, diagonal_width: int | None = None,
                      rows_dtype: torch.dtype | None = torch.float64) -> dict:
    """Bytes of one d-wide Kronecker factor: ``sum`` (float64, or float32 with its Kahan
    compensation: 8·d² either way), ``basis`` (its eigenvectors as stored:
    :func:`~gradalg.curvature.kron.basis_dtype`, 8·d² for float64 rows, else 4·d²) and
    ``eigh`` (the peak of its eigendecomposition beyond the stored basis: the symmetrized
    input and LAPACK's workspace, 24·d² in float64, and, where the basis is stored in
    float32, the float64 eigenvectors beside their float32 copy, 8·d² − 4·d² more; 12·d²
    in float32, with the float64 check's three (d, 512) column blocks). ``dtype``: the
    eigendecomposition's precision, float32 beyond ``float64_width``. Beyond
    ``diagonal_width`` the factor is its diagonal: a float64 sum of 8·d bytes, no basis
    (the identity) and no eigendecomposition (``"dtype": "diagonal"``). ``rows_dtype``:
    the dtype of the rows (the plan's ``facts.dtype``; None: float64)."""
    if is_diagonal_factor(d, diagonal_width):
        return {"dtype": "diagonal", "sum": 8.0 * d, "basis": 0.0, "eigh": 0.0}
    wide = float64_width is not None and d > float64_width
    elem = 4.0 if wide else 8.0
    stored = element_size(basis_dtype(torch.float32 if wide else torch.float64, rows_dtype))
    return {"dtype": "float32" if wide else "float64", "sum": 8.0 * d * d, "basis": stored * d * d,
            "eigh": 3.0 * elem * d * d + (elem - stored) * d * d + (3 * 8.0 * d * 512 if wide else 0.0)}


def _factor_parts(space, float64_width: int | None, diagonal_width: int | None, rows_dtype=torch.float64):
    """``(out, in, [S's, A's kron_factor_bytes])`` of each block."""
    for b in space.blocks:
        o, i = b.shape[0], b.shape[-1]
        yield o, i, [kron_factor_bytes(d, float64_width, diagonal_width, rows_dtype) for d in (o, i)]


def _eigenvalue_bytes(o: int, i: int, parts, grid: bool) -> float:
    """A block's eigenvalues, float32 when a factor is float32, else float64: K-FAC's
    Λ = λ_S λ_Aᵀ kept as its two vectors (out + in numbers; the grid is made a slice at a
    time where it is applied: :class:`~gradalg.linalg.kron.BlockEigenvalues`), or with
    ``grid`` EK-FAC's re-fitted (out, in) grid."""
    elem = 4.0 if any(p["dtype"] == "float32" for p in parts) else 8.0
    return elem * (o * i if grid else o + i)


class _KronTerms:
    """The terms of :func:`kron_bytes` over a space's blocks: the factor ``sums``, the
    eigen``bases``, ``held`` (each block's larger of the two), K-FAC's eigenvalue vectors
    ``lam``, the largest eigendecomposition's workspace ``eigh`` (of the factor
    ``eigh_width`` wide), the largest block's sums ``copies``, the widths of the factors
    kept d × d (``dense``) and diagonal (``diagonal``); ``update``, a chunk's update: the
    widest dense factor's d × d product with its float64 copy or the Kahan sum's new
    total, 12·d²; and ``peak``, the larger of the two moments."""

    def __init__(self, space, float64_width: int | None, diagonal_width: int | None, rows_dtype):
        self.sums = self.bases = self.held = self.lam = self.eigh = self.copies = 0.0
        self.eigh_width, self.dense, self.diagonal = 0, [], []
        for o, i, parts in _factor_parts(space, float64_width, diagonal_width, rows_dtype):
            s, b = parts[0]["sum"] + parts[1]["sum"], parts[0]["basis"] + parts[1]["basis"]
            self.sums, self.bases, self.held = self.sums + s, self.bases + b, self.held + max(s, b)
            self.copies = max(self.copies, s)
            self.lam += _eigenvalue_bytes(o, i, parts, grid=False)
            for d, p in zip((o, i), parts):
                (self.diagonal if p["dtype"] == "diagonal" else self.dense).append(d)
                if p["eigh"] > self.eigh:
                    self.eigh_width, self.eigh = d, p["eigh"]
        self.update = 12.0 * max(self.dense or [0]) ** 2
        self.peak = max(self.sums + self.update, self.held + self.lam + max(self.eigh, self.copies))


def kron_bytes(space, float64_width: int | None = None, diagonal_width: int | None = None,
               rows_dtype: torch.dtype | None = torch.float64) -> float:
    """K-FAC's statistics and eigendecompositions, the larger of two moments:

    * a chunk's update: every block's two factor sums, and the widest dense factor's
      d × d product with its float64 copy or the Kahan sum's new total (12·d²);
    * finishing, block by block (``KronAccumulator.finish``): a block's sums are freed as
      its covariances are formed and eigendecomposed, so each block holds the larger of
      its sums and its eigenbases; beside them every block's two eigenvalue vectors
      (λ_S, λ_A: K-FAC's Λ = λ_S λ_Aᵀ is never kept as a grid), and the larger of one
      block's covariance copies and one eigendecomposition's workspace.

    Factors wider than ``float64_width`` in float32, wider than ``diagonal_width``
    diagonal (8·d bytes, no basis: :func:`kron_factor_bytes`); bases stored in
    :func:`~gradalg.curvature.kron.basis_dtype` of ``rows_dtype`` (the plan's dtype)."""
    return _KronTerms(space, float64_width, diagonal_width, rows_dtype).peak


def kron_output_bytes(space, float64_width: int | None = None, diagonal_width: int | None = None,
                      refit: bool = False, rows_dtype: torch.dtype | None = torch.float64) -> float:
    """Bytes of the Kronecker operator a job produces: eigenbases (in
    :func:`~gradalg.curvature.kron.basis_dtype` of ``rows_dtype``) and eigenvalues —
    K-FAC's two vectors per block, or with ``refit`` EK-FAC's (out, in) grid per block.
    The operators a score derives from it (damped, inverted, powers) share these numbers
    (:class:`~gradalg.linalg.kron.BlockEigenvalues`): the scores pass holds no other
    copy, and makes Λ a slice of rows at a time (``gradalg.linalg.kron._SLICE_ELEMENTS`` numbers)."""
    return sum(sum(p["basis"] for p in parts) + _eigenvalue_bytes(o, i, parts, refit)
               for o, i, parts in _factor_parts(space, float64_width, diagonal_width, rows_dtype))


def _diagonal_decision(op, b, diag: list, options) -> Decision:
    """The decision about block ``b`` of ``op`` whose factors ``diag`` ([(side, width)]) are kept diagonal."""
    dense = [kron_factor_bytes(d, options.kron_float64_width) for _, d in diag]
    kept = format_bytes(sum(8.0 * d for _, d in diag))
    dense_peak = format_bytes(sum(p["sum"] + p["basis"] for p in dense) + max(p["eigh"] for p in dense))
    why = {("A", "embedding"): "exact: an embedding's one-hot inputs have a diagonal covariance, the token counts",
           ("S", "tied"): "approximated by diag(S): the tied embedding's one-hot rows add exactly diagonal terms, the "
                          "head's output-gradient covariances lose their off-diagonal entries"}
    sides = [f"{label} ({d:,}×{d:,}) " + why.get((label, b.kind), "approximated by its diagonal: the off-diagonal "
                                                                  "covariances are dropped") for label, d in diag]
    return Decision(DecisionKind.KRON_DIAGONAL, op.token, "diagonal",
                    {"diagonal": f"{kept}, no eigendecomposition", "dense": f"{dense_peak} at its eigendecomposition"},
                    f"wider than ga.options(kron_diagonal_width={options.kron_diagonal_width}): " + "; ".join(sides)
                    + ". The identity is the diagonal factor's eigenbasis (rule kronecker.diagonal_factor); EK-FAC "
                      "re-fits its eigenvalues per coordinate", block=b.name)


# ------------------------------------------------------------------ accumulators
def _factors(node, name, value) -> Factors:
    if not isinstance(value, Factors):
        raise GradalgError(
            f"K-FAC needs factored gradients, but block {name!r} is {node.grads.representation[name]}: "
            "apply ga.kfac to gradients from ga.grads (hook backend), optionally projected with "
            "ga.proj.kron, not to normalized, preconditioned or gaussian-projected ones"
        )
    return value


class KronAccumulator:
    """K-FAC's Kronecker factors; ``finish`` gives the eigenbasis and K-FAC eigenvalues.

    ``token_block``: positions of each example whose statistics are computed at once;
    ``float64_width``: factors wider than this are summed and eigendecomposed in float32,
    checked to ``float32_rtol`` (:mod:`gradalg.curvature.kron`, "Precision of wide
    factors"); ``diagonal_width``: factors wider than this are kept as their diagonal, with
    the identity as eigenbasis ("Diagonal factors of vocabulary-wide sides"). All are
    fields of the plan's job (``ga.options``)."""

    def __init__(self, node: KFAC, token_block: int | None = None, float64_width: int | None = None,
                 float32_rtol: float = 1e-2, diagonal_width: int | None = None):
        self.node, self.token_block = node, token_block
        self.float32_rtol, self.diagonal_width = float32_rtol, diagonal_width
        self.stats = {name: KronStats(float64_width=float64_width, diagonal_width=diagonal_width)
                      for name in node.space.names}
        self.rules = diagonal_factor_rules(node.space, diagonal_width)
        #: the widest precision of the rows summed (``work_dtype``): the stored bases' (:func:`basis_dtype`)
        self.rows_dtype: torch.dtype | None = None

    def _saw(self, dtype: torch.dtype | None) -> None:
        if dtype is not None:
            self.rows_dtype = dtype if self.rows_dtype is None else torch.promote_types(self.rows_dtype, dtype)

    def update(self, chunk: Chunk) -> None:
        for name in self.node.space.names:
            F = _factors(self.node, name, chunk.blocks[name])
            self._saw(work_dtype(F.D))
            self.stats[name].update(F, self.token_block)

    def export(self) -> dict:
        return {n: (*st.sums(), st.tokens, st.examples, self.rows_dtype) for n, st in self.stats.items()}

    def absorb(self, state: dict) -> None:
        for name, (A, S, tokens, examples, *rows_dtype) in state.items():
            st = self.stats[name]
            st.add_sums(A, S)
            st.tokens, st.examples = st.tokens + tokens, st.examples + examples
            self._saw(rows_dtype[0] if rows_dtype else torch.float64)

    def finish(self) -> KronOp:
        bases, eigenvalues, errors = {}, {}, {}
        # the float64 width a failed float32 check names: the widest dense factor of all blocks
        widest = max([d for b in self.node.space.blocks if len(b.shape) == 2 for d in b.shape
                      if not is_diagonal_factor(d, self.diagonal_width)] or [0])
        for name in self.node.space.names:
            self.stats[name].examples = self.node.covariance_grads.n   # the examples fed (covariance_max_examples)
            factors = list(self.stats[name].covariances())             # [S, A]
            self.stats[name] = None        # the sums are not needed past their eigendecomposition
            # each factor eigendecomposed and freed (popped: its only reference) before the next
            (Q_S, lam_S, check_S), (Q_A, lam_A, check_A) = [
                factor_eigenbasis(factors.pop(0), self.float32_rtol, f"the {what} factor of {name!r}",
                                  self.rows_dtype, widest) for what in ("output-gradient", "activation")]
            bases[name] = (Q_S, Q_A)
            dtype = torch.promote_types(lam_S.dtype, lam_A.dtype) if torch.float32 not in (
                lam_S.dtype, lam_A.dtype) else torch.float32
            # Λ = λ_S λ_Aᵀ kept as its two vectors (made a slice at a time where applied)
            eigenvalues[name] = BlockEigenvalues((lam_S.to(dtype), lam_A.to(dtype)))
            if check_S.error or check_A.error:
                # |λ̂_S λ̂_A − λ_S λ_A| ≤ δ_S max λ_A + max λ_S δ_A + δ_S δ_A
                top_S, top_A = float(lam_S.max()), float(lam_A.max())
                errors[name] = check_S.error * top_A + top_S * check_A.error + check_S.error * check_A.error
        return KronOp(self.node.space, bases, eigenvalues, eigenvalue_errors=errors,
                      float32_rtol=self.float32_rtol, rules=self.rules)


class EKFACAccumulator:
    """EK-FAC's eigenvalue correction Λ = (1/n) Σ_i (Q_Sᵀ G_i Q_A)² in a K-FAC eigenbasis
    (summed in float64; stored in the K-FAC eigenvalues' dtype). A block with a diagonal
    factor (an identity basis: a vocabulary-wide side) is rotated one example at a time:
    its (out, in) rotated gradient is the size of the block (GPT-2's tied head: 154 MB).

    A chunk's rotated gradients (c, out, in) of at least ``buffer_bytes`` are written into
    one buffer reused across blocks and chunks, squared in place and summed over the
    chunk into a second reused (out, in) buffer, which is added to the float64 sums
    without a float64 copy (the same numbers as ``(R ** 2).sum(0).to(float64)``). Fresh
    tensors there (four per block and chunk, tens of MB each at real widths, above the
    allocator's mmap threshold) cost more in page faults than the rotation's GEMMs: the
    pass took 3–4× its estimate on OLMoE's experts (issue 28). Where the gradients are
    formed before they are rotated (:func:`gradient_first`: more positions than the
    block's width, LoGra's projected blocks), G_i is formed in the first buffer, G_i Q_A
    written into a second (``_turned``) and Q_Sᵀ G_i Q_A back into the first."""

    def __init__(self, node: KFAC, kfac: KronOp, token_block: int | None = None, buffer_bytes: int = 2 ** 20):
        self.node, self.kfac, self.token_block, self.buffer_bytes = node, kfac, token_block, buffer_bytes
        self.sums = {name: torch.zeros(lam.shape, dtype=torch.float64, device=lam.base[0].device)
                     for name, lam in kfac.parts.items()}
        self.blocks = {b.name: b for b in node.space.blocks}
        # the reused buffers (flat), grown to the largest use (reused_buffer)
        self._rotated = self._summed = self._turned = None

    def update(self, chunk: Chunk) -> None:
        for name in self.node.space.names:
            (Q_S, Q_A), value, sums = self.kfac.bases[name], chunk.blocks[name], self.sums[name]
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                # rows kept flat (a Kronecker-projected block over long sequences is
                # smaller than its factors): rotate the (out, in) gradients themselves
                rotated = rotate_rows(value.reshape(value.shape[0], *sums.shape), Q_S, Q_A)
                sums += (rotated ** 2).sum(0).to(sums.dtype)
                continue
            F = _factors(self.node, name, value)
            if Q_S is None or Q_A is None:     # a diagonal factor: one example at a time
                for i in range(F.n):
                    sums += rotate_factors(F[i:i + 1], Q_S, Q_A, self.token_block)[0].square_().to(sums.dtype)
                continue
            dtype, (o, i) = work_dtype(F.D), sums.shape
            out = reused_buffer(self, "_rotated", (F.n, o, i), dtype, F.D.device, self.buffer_bytes)
            if gradient_first(self.blocks[name], F.T):
                work = reused_buffer(self, "_turned", (F.n, o, i), dtype, F.D.device, self.buffer_bytes)
                rotated = rotate_gradients(F, Q_S, Q_A, self.token_block, out=out, work=work).square_()
            else:
                rotated = rotate_factors(F, Q_S, Q_A, self.token_block, out=out).square_()   # ours: in place
            total = reused_buffer(self, "_summed", (o, i), dtype, F.D.device, self.buffer_bytes)
            sums.add_(rotated.sum(0) if total is None else torch.sum(rotated, 0, out=total))
            del rotated

    def export(self) -> dict:
        return self.sums

    def absorb(self, state: dict) -> None:
        for k, v in state.items():
            self.sums[k] += v

    def finish(self) -> KronOp:
        n = self.node.lambda_grads.n   # the examples fed (lambda_max_examples)
        eigenvalues = {k: (s / n).to(self.kfac.parts[k].dtype) for k, s in self.sums.items()}
        errors = {}
        for name, err in self.kfac.eigenvalue_errors.items():
            # the K-FAC basis's relative error, times the largest re-fitted eigenvalue, and
            # the float32 rounding of the stored eigenvalues
            top = self.kfac.parts[name].extremes()[1]
            relative = (err / top if top > 0 else 0.0) + FLOAT32_ROUNDOFF
            errors[name] = relative * float(eigenvalues[name].abs().max())
        return KronOp(self.node.space, self.kfac.bases, eigenvalues, eigenvalue_errors=errors,
                      float32_rtol=self.kfac.float32_rtol, rules=self.kfac.rules)
