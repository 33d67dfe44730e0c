"""Kronecker-factored curvature: K-FAC and EK-FAC.

For a layer with per-example gradient ``G_i = D_iᵀ A_i`` (out, in), K-FAC (Martens &
Grosse 2015) approximates the layer's Fisher block

    F = (1/n) Σ_i vec(G_i) vec(G_i)ᵀ  ≈  S ⊗ A,
    A = (1/N_tok) Σ_{i,t} a_it a_itᵀ            (in, in)   activation covariance
    S = (1/n)     Σ_i Σ_t d_it d_itᵀ            (out, out) output-gradient covariance

(``vec`` row-major, so ``S ⊗ A`` acts on G as ``G ↦ S G A``). With eigendecompositions
``A = Q_A diag(λ_A) Q_Aᵀ`` and ``S = Q_S diag(λ_S) Q_Sᵀ``:

    K-FAC   F ≈ (Q_S ⊗ Q_A) diag(λ_S ⊗ λ_A) (Q_S ⊗ Q_A)ᵀ
    EK-FAC  F ≈ (Q_S ⊗ Q_A) diag(Λ) (Q_S ⊗ Q_A)ᵀ,   Λ = (1/n) Σ_i (Q_Sᵀ G_i Q_A)²

(George et al. 2018): the eigenvalues are re-fitted in the Kronecker eigenbasis, which
makes Λ the exact diagonal of F in that basis. Both are stored as a
:class:`~gradalg.linalg.kron.KronOp`
(per block ``Q_S``, ``Q_A`` and the eigenvalues Λ (out, in)), so damping, inverse
and powers act on the eigenvalues: ``(F + λI)⁻¹ G = Q_S [(Q_Sᵀ G Q_A) / (Λ + λ)] Q_Aᵀ``.
Λ is kept as what it is made from (:class:`~gradalg.linalg.kron.BlockEigenvalues`): K-FAC's two vectors
λ_S, λ_A (out + in numbers, not out·in) or EK-FAC's one grid, with damping, scaling,
inverse and powers recorded as elementwise steps, so that the operators of a chain
F → F + λI → (F + λI)⁻¹ share one set of numbers; Λ is made a slice of rows at a time
where it is applied (the same numbers as a grid would give).

Precision of wide factors
-------------------------
A factor of width d ≤ ``float64_width`` (``ga.options(kron_float64_width=8192)``) is
summed and eigendecomposed in float64, as the rest of gradalg's statistics. A wider one
(an MLP's 14336 or 28672) is summed in float32 with a Kahan compensation term (the
chunk sums' rounding carried to the next chunk: the bytes of float64, 8·d², an error of
a few u = 2⁻²⁴ per entry whatever the number of chunks) and eigendecomposed in float32
on its device (half the peak of a float64 eigh, 16·d² instead of 32·d², and many times
faster on a GPU). The result is checked (:func:`checked_eigh`): with the residuals
r_i = ‖M q_i − λ_i q_i‖ and the orthogonality ω = max |QᵀQ − I|, computed in float64
blocks of columns, each eigenvalue is within

    δ = max_i r_i + ω·‖M‖₂ + 2u·‖M‖_F

of one of the float64 matrix (Bauer–Fike for symmetric matrices, plus the float32
rounding of M). A residual or orthogonality above ``rtol`` (``kron_float32_rtol``) is
refused at once. The block's Λ = λ_S ⊗ λ_A then has entries accurate to
δ_Λ = δ_S·max λ_A + max λ_S·δ_A + δ_S·δ_A (EK-FAC, whose squares are summed in float64:
the same relative error, plus u, times its largest re-fitted eigenvalue), kept on the
:class:`~gradalg.linalg.kron.KronOp`; an inverse or negative power dividing by ``min |Λ + λ| < δ_Λ / rtol``
raises :class:`~gradalg.errors.CurvatureError` with these numbers and the fixes (damp by
at least δ_Λ/rtol, project the layer, or float64 factors).

Precision of the stored eigenbases
----------------------------------
Every use of a basis rotates rows in their work dtype (``Q.to(dtype)`` in
:func:`~gradalg.linalg.kron.rotate_factors`, ``rotate_rows``, ``rotate_back``: EK-FAC's
eigenvalue fit, preconditioning queries and training rows, quadratic forms), float32 for
float32 and half-precision rows. A float64 eigendecomposition of statistics summed from
such rows is therefore stored once as its float32 rounding
(:func:`basis_dtype`): bit for bit the numbers every rotation used
when the basis was kept in float64 and cast at each use, at half the bytes (the
Llama-200M shape: 1.6 GB instead of 3.2 GB). Float64 rows keep float64 bases: with a
float32-rounded basis Q̃ (Q̃ᵀQ̃ = I + E, |E| ≈ u) a damped inverse at small damping is
no longer the inverse of its operator ((F + λI)⁻¹(F + λI) − I grows like u·λ_max/λ),
so float64 rows, where a user expects float64 exactness, never get one. The
eigenvalues, the factor sums and the eigendecompositions keep their precision.

Diagonal factors of vocabulary-wide sides
-----------------------------------------
A factor wider than ``diagonal_width`` (``ga.options(kron_diagonal_width=16384)``: an
embedding's or LM head's vocabulary side, 32k–152k) is never formed as a d × d matrix:
only its diagonal is summed (float64, 8·d bytes), and its eigenbasis is the identity
(stored as ``None``), its eigenvalues the diagonal itself:

    A = diag(c) / N_tok,  c_v = #{(i, t): token v at position t of example i}   embedding
        inputs (one-hot rows a_it = e_v): Σ a aᵀ is exactly diagonal, so this is exact;
    S ≈ diag(S) = (1/n) Σ_i Σ_t d_it ∘ d_it                                      a head's
        output gradients: the off-diagonal covariances are dropped (the rule
        ``kronecker.diagonal_factor``, named in the plan).

K-FAC is then ``F ≈ (I ⊗ Q_A) diag(diag(S) ⊗ λ_A) (I ⊗ Q_A)ᵀ`` (for a diagonal S), and
EK-FAC re-fits its eigenvalues per coordinate in that basis, Λ = (1/n) Σ_i (G_i Q_A)²
((V, d) numbers: each example rotated on its own, no V × V matrix anywhere). A tied
embedding/head block is one block whose factors pool its uses (:mod:`gradalg.capture.tying`):
its vocabulary side S sums the embedding's one-hot rows (exactly diagonal) and the head's
logit gradients (diagonal approximation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capture.factors import Factors, OneHot, token_slices
from ..errors import CurvatureError, GradalgError
from ..linalg.kron import is_diagonal_factor, work_dtype

__all__ = ["KronStats", "kron_eigenbasis", "gram", "factor_dtype", "checked_eigh", "EighCheck", "FLOAT32_ROUNDOFF",
           "token_counts"]

#: unit roundoff of float32, u = 2⁻²⁴
FLOAT32_ROUNDOFF = 2.0 ** -24
#: columns per block of the float64 residual check (memory 3·8·d·block bytes)
_CHECK_COLUMNS = 512


def factor_dtype(width: int, float64_width: int | None) -> torch.dtype:
    """float64 for a Kronecker factor of ``width`` ≤ ``float64_width`` (None: always), else float32."""
    return torch.float64 if float64_width is None or width <= float64_width else torch.float32


def token_counts(A: OneHot) -> torch.Tensor:
    """``c_v`` = Σ_{i,t} [token v at a valid position (i, t)] = the diagonal of Σ a aᵀ for
    one-hot activations (which has no other entries), in float64.   Returns (size,)."""
    idx = A.idx.flatten()
    weights = A.weights(torch.float64).flatten()
    return torch.zeros(A.size, dtype=torch.float64, device=idx.device).index_add_(0, idx, weights)


def _compensated_add(total, comp, x):
    """Kahan summation ``total += x`` in total's dtype, ``comp`` carrying the rounding lost
    (None for float64 sums: plain adds). Takes ownership of ``x``. Returns (total, comp)."""
    if total is None:
        return x, (torch.zeros_like(x) if x.dtype != torch.float64 else None)
    if comp is None:
        return total.add_(x), None
    y = x.sub_(comp)                     # the new term, corrected by what the last add lost
    t = total + y
    # what this add lost, c = (t − total) − y, kept negated in the old total's buffer:
    # (total − t) + y = −c exactly in floating point (no extra d × d temporary)
    lost = total.sub_(t).add_(y)
    return t, lost.neg_()


@dataclass
class KronStats:
    """Running sums of one layer's K-FAC factors over chunks of examples.

    Each factor is summed in :func:`factor_dtype` of its width: float64, or float32 with a
    Kahan compensation (``A_comp``, ``S_comp``) beyond ``float64_width``. A factor wider
    than ``diagonal_width`` is summed as its diagonal only, a (d,) float64 vector (module
    docstring, "Diagonal factors"); one-hot activations give their token counts (exact)."""

    A: torch.Tensor | None = None   # Σ a aᵀ  (in, in)
    S: torch.Tensor | None = None   # Σ d dᵀ  (out, out)
    tokens: int = 0                 # positions with a non-zero activation row
    examples: int = 0
    float64_width: int | None = None
    A_comp: torch.Tensor | None = None
    S_comp: torch.Tensor | None = None
    diagonal_width: int | None = None

    def update(self, F: Factors, token_block: int | None = None) -> None:
        """Add Σ_t a_t a_tᵀ and Σ_t d_t d_tᵀ of a chunk, a block of ``token_block`` positions
        of every example at a time (the chunk's products in the rows' precision, the
        running sums in :func:`factor_dtype`; the diagonal of a factor wider than
        ``diagonal_width``, in float64)."""
        dtype = work_dtype(F.D)
        a_dtype, s_dtype = factor_dtype(F.in_features, self.float64_width), factor_dtype(F.out_features,
                                                                                          self.float64_width)
        diag_A = is_diagonal_factor(F.in_features, self.diagonal_width)
        diag_S = is_diagonal_factor(F.out_features, self.diagonal_width)
        for tp in token_slices(F.T, token_block):
            Fp = F.tokens(tp)
            if isinstance(Fp.A, OneHot):       # Σ a aᵀ = diag(token counts), exactly
                counts = token_counts(Fp.A)                                       # (in,)
                sum_A = counts if diag_A else torch.diag(counts).to(a_dtype)
                self.tokens += int(Fp.A.weights(torch.float64).ne(0).sum())
            else:
                A = Fp.A.to(dtype).flatten(0, 1)                                   # (n b, in)
                sum_A = (A * A).sum(0, dtype=torch.float64) if diag_A else gram(A).to(a_dtype)
                self.tokens += int((A != 0).any(dim=1).sum())
                del A
            D = Fp.D.to(dtype).flatten(0, 1)                                       # (n b, out)
            sum_S = (D * D).sum(0, dtype=torch.float64) if diag_S else gram(D).to(s_dtype)
            del D
            self.add_sums(sum_A, sum_S, owned=True)
        self.examples += F.n

    def add_sums(self, A: torch.Tensor | None, S: torch.Tensor | None, owned: bool = False) -> None:
        """Add partial sums (a chunk's, or another shard's :meth:`sums`); ``owned``: the
        tensors are this call's to keep or overwrite (else they are copied where needed)."""
        if A is not None:
            A = A.to(self.A.dtype if self.A is not None else A.dtype)
            if not owned and (self.A is None or self.A_comp is not None):
                A = A.clone()
            self.A, self.A_comp = _compensated_add(self.A, self.A_comp, A)
        if S is not None:
            S = S.to(self.S.dtype if self.S is not None else S.dtype)
            if not owned and (self.S is None or self.S_comp is not None):
                S = S.clone()
            self.S, self.S_comp = _compensated_add(self.S, self.S_comp, S)

    def sums(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(Σ a aᵀ, Σ d dᵀ)`` with their compensations applied."""
        A = self.A if self.A_comp is None else self.A - self.A_comp
        S = self.S if self.S_comp is None else self.S - self.S_comp
        return A, S

    def covariances(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(S, A)`` normalized as in the module docstring."""
        if not self.examples:
            raise GradalgError("K-FAC statistics over zero examples")
        A, S = self.sums()
        return S / self.examples, A / max(self.tokens, 1)


def gram(X: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``Xᵀ X`` for X (m, d), computing only the blocks on and above the diagonal and
    mirroring them (about half the FLOPs of one GEMM for wide X, and exactly
    symmetric).   Returns (d, d)."""
    d = X.shape[1]
    if d <= block:
        return X.T @ X
    out = X.new_empty(d, d)
    for start in range(0, d, block):
        stop = min(start + block, d)
        rows = X[:, start:stop].T @ X[:, start:]           # (stop - start, d - start)
        out[start:stop, start:] = rows
        out[start:, start:stop] = rows.T
    return out


def kron_eigenbasis(S: torch.Tensor, A: torch.Tensor):
    """``(Q_S, λ_S, Q_A, λ_A)`` of symmetric S (out, out) and A (in, in), in float64."""
    lam_S, Q_S = torch.linalg.eigh((S + S.T) / 2)
    lam_A, Q_A = torch.linalg.eigh((A + A.T) / 2)
    return Q_S, lam_S.clamp_min(0), Q_A, lam_A.clamp_min(0)


@dataclass(frozen=True)
class EighCheck:
    """The accuracy of one factor's eigendecomposition M ≈ Q diag(λ) Qᵀ (width ``d``):
    largest residual ``residual`` = max_i ‖M q_i − λ_i q_i‖, orthogonality ``orthogonality``
    = max |QᵀQ − I|, ``norm2`` = ‖M‖₂ and ``frobenius`` = ‖M‖_F; ``error`` (δ) bounds how far
    each computed eigenvalue is from one of the exactly summed matrix (0 in float64)."""

    d: int
    dtype: torch.dtype
    residual: float = 0.0
    orthogonality: float = 0.0
    norm2: float = 0.0
    frobenius: float = 0.0

    @property
    def error(self) -> float:
        if self.dtype == torch.float64:
            return 0.0
        return self.residual + self.orthogonality * self.norm2 + 2 * FLOAT32_ROUNDOFF * self.frobenius

    @property
    def relative(self) -> float:
        """δ / ‖M‖₂."""
        return self.error / self.norm2 if self.norm2 > 0 else 0.0

    def describe(self) -> str:
        rounding = 2 * FLOAT32_ROUNDOFF * self.frobenius
        return (f"residual max‖Mq−λq‖ = {self.residual:.2e}, orthogonality max|QᵀQ−I| = "
                f"{self.orthogonality:.2e}, ‖M‖₂ = {self.norm2:.3e}, float32 rounding 2u‖M‖_F = {rounding:.2e}: "
                f"δ = {self.error:.2e}")


def checked_eigh(M: torch.Tensor, rtol: float, what: str = "a Kronecker factor", float64_fix: int | None = None):
    """``(Q, λ ≥ 0, EighCheck)`` of symmetric M (d, d) in M's dtype, on M's device.

    float64: as :func:`kron_eigenbasis`. float32: the residuals and QᵀQ are then computed in
    float64, ``_CHECK_COLUMNS`` columns at a time (3 d³ multiply-adds; memory 3·8·d·512
    bytes), and a relative residual or orthogonality over ``rtol`` raises
    :class:`~gradalg.errors.CurvatureError`, whose fix is
    ``ga.options(kron_float64_width=float64_fix)`` (default d; the caller passes the widest
    float32 factor of the operator, so that no other factor fails next)."""
    M = (M + M.T) / 2
    lam, Q = torch.linalg.eigh(M)
    d = M.shape[0]
    if M.dtype == torch.float64:
        return Q, lam.clamp_min(0), EighCheck(d, M.dtype)
    lam64 = lam.to(torch.float64)
    residual, orthogonality = 0.0, 0.0
    for c0 in range(0, d, _CHECK_COLUMNS):
        c1 = min(d, c0 + _CHECK_COLUMNS)
        Qc = Q[:, c0:c1].to(torch.float64)                                    # (d, c)
        MQ = torch.empty_like(Qc)
        QQ = torch.empty(d, c1 - c0, dtype=torch.float64, device=Q.device)
        for r0 in range(0, d, _CHECK_COLUMNS):
            r1 = min(d, r0 + _CHECK_COLUMNS)
            MQ[r0:r1] = M[r0:r1].to(torch.float64) @ Qc                       # rows of M q_i
            QQ[r0:r1] = Q[:, r0:r1].to(torch.float64).T @ Qc                  # rows of Qᵀ q_i
        residual = max(residual, float(torch.linalg.vector_norm(MQ - Qc * lam64[c0:c1], dim=0).max()))
        QQ[c0:c1] -= torch.eye(c1 - c0, dtype=torch.float64, device=Q.device)
        orthogonality = max(orthogonality, float(QQ.abs().max()))
    check = EighCheck(d, M.dtype, residual, orthogonality, float(lam64.abs().max()),
                      float(torch.linalg.vector_norm(lam64)))
    if check.norm2 > 0 and max(check.residual / check.norm2, check.orthogonality) > rtol:
        fix = max(d, float64_fix or 0)
        raise CurvatureError(
            f"the float32 eigendecomposition of {what} ({d}×{d}) failed its check: {check.describe()}, "
            f"a relative residual of {check.residual / check.norm2:.2e} or orthogonality error over "
            f"kron_float32_rtol = {rtol:g}. Compute the factors in float64: ga.options(kron_float64_width={fix}) "
            f"({_gb(8.0 * fix * fix)} GB for the widest factor, {_gb(32.0 * fix * fix)} GB at its eigendecomposition), "
            "or project "
            "the layer first (ga.proj.kron(k=...))")
    return Q, lam.clamp_min(0), check


def basis_dtype(eigh_dtype: torch.dtype, rows_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a Kronecker eigenbasis is stored in: the precision every use rotates in.

    Every use of a basis (``rotate_factors`` / ``rotate_rows`` / ``rotate_back``: EK-FAC's
    eigenvalue fit, preconditioning queries and training rows, quadratic forms) casts it to
    the rows' work dtype (:func:`~gradalg.linalg.kron.work_dtype`: float32 for float32 and
    half-precision rows, float64 for float64 rows). A float64 eigendecomposition of factors
    summed from float32 rows is therefore kept as its float32 rounding, made once: the same
    numbers every rotation used (bit for bit; the strides, column-major from ``eigh``, are
    kept), half the bytes (Llama-200M shape: 1.6 GB instead of 3.2 GB) and no cast per
    chunk. Float64 rows (``rows_dtype`` float64, or unknown: None) keep a float64 basis, so
    their rotations stay exact to float64 rounding at any damping; a float32
    eigendecomposition (factors wider than ``kron_float64_width``) stays float32."""
    if eigh_dtype == torch.float64 and rows_dtype is not None and rows_dtype != torch.float64:
        return torch.float32
    return eigh_dtype


def factor_eigenbasis(M: torch.Tensor, rtol: float, what: str, rows_dtype: torch.dtype | None = None,
                      float64_fix: int | None = None):
    """``(Q, λ ≥ 0, EighCheck)`` of one summed factor M, (d, d) or its (d,) diagonal:
    :func:`checked_eigh`, Q then stored in :func:`basis_dtype` of ``rows_dtype`` (strides
    kept: ``Tensor.to`` preserves them; M is dropped first, freed where the caller passed
    its only reference); a diagonal factor gives ``(None, its diagonal, exact)``, the
    identity being its eigenbasis. Sums that overflowed (NaN/inf from finite rows) raise
    :class:`~gradalg.errors.CurvatureError`."""
    if not bool(torch.isfinite(M).all()):   # finite rows whose products overflowed: named, never NaN scores
        raise CurvatureError(
            f"{what} holds NaN/inf ({int((~torch.isfinite(M)).sum()):,} of {M.numel():,} entries) though every "
            "per-example gradient is finite: the sums of products of its activations or output gradients "
            "overflowed (values near the float32 range). Compute in float64 (model.double() and float64 "
            "inputs), scale the inputs down, or leave this layer out")
    if M.dim() == 1:
        return None, M.clamp_min(0), EighCheck(M.shape[0], torch.float64)
    Q, lam, check = checked_eigh(M, rtol, what, float64_fix)
    del M
    return Q.to(basis_dtype(Q.dtype, rows_dtype)), lam, check


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


