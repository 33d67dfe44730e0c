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
makes Λ the exact diagonal of F in that basis. Both are stored as a :class:`KronOp`
(per block ``Q_S``, ``Q_A`` and a (out, in) eigenvalue matrix), so damping, inverse
and powers act on the eigenvalues: ``(F + λI)⁻¹ G = Q_S [(Q_Sᵀ G Q_A) / (Λ + λ)] Q_Aᵀ``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..capture.factors import Factors, OneHot, materialize
from ..errors import GradalgError, MemoryBudgetError
from ..linalg import rules as _rules
from ..linalg.base import LinearOp, power_values, reciprocal

__all__ = ["KronStats", "KronOp", "kron_eigenbasis", "rotate_factors", "rotate_rows", "work_dtype", "gram"]


def _dense_acts(A, dtype, max_vocab: int = 8192) -> torch.Tensor:
    if isinstance(A, OneHot):
        if A.size > max_vocab:
            raise MemoryBudgetError(
                f"K-FAC on an embedding with {A.size:,} rows needs a {A.size:,}² activation "
                "covariance; project it first (ga.proj.kron) or leave the embedding out"
            )
        return A.to_dense(dtype)
    return A.to(dtype)


@dataclass
class KronStats:
    """Running sums of one layer's K-FAC factors over chunks of examples."""

    A: torch.Tensor | None = None   # Σ a aᵀ  (in, in)
    S: torch.Tensor | None = None   # Σ d dᵀ  (out, out)
    tokens: int = 0                 # positions with a non-zero activation row
    examples: int = 0

    def update(self, F: Factors) -> None:
        dtype = work_dtype(F.D)  # a chunk's products in the rows' precision, the running sums in float64
        A = _dense_acts(F.A, dtype).flatten(0, 1)   # (n T, in)
        D = F.D.to(dtype).flatten(0, 1)             # (n T, out)
        a, s = gram(A).to(torch.float64), gram(D).to(torch.float64)
        self.A = a if self.A is None else self.A + a
        self.S = s if self.S is None else self.S + s
        self.tokens += int((A != 0).any(dim=1).sum())
        self.examples += F.n

    def covariances(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(S, A)`` normalized as in the module docstring."""
        if not self.examples:
            raise GradalgError("K-FAC statistics over zero examples")
        return self.S / self.examples, self.A / max(self.tokens, 1)


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


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """The precision of per-chunk products for rows ``x``: theirs (float32 or float64),
    float32 for half-precision rows. Running sums stay in float64."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def rotate_factors(F: Factors, Q_S: torch.Tensor, Q_A: torch.Tensor) -> torch.Tensor:
    """``Q_Sᵀ G_i Q_A`` for each example, from factors: ``(D_i Q_S)ᵀ (A_i Q_A)``, in the
    factors' precision.   (n, out, in)"""
    dtype = work_dtype(F.D)
    A = _dense_acts(F.A, dtype) @ Q_A.to(dtype)
    D = F.D.to(dtype) @ Q_S.to(dtype)
    return torch.einsum("nto,nti->noi", D, A)


def rotate_rows(G: torch.Tensor, Q_S: torch.Tensor, Q_A: torch.Tensor) -> torch.Tensor:
    """``Q_Sᵀ G_i Q_A`` for materialized rows ``G`` (n, out, in), in their precision.   (n, out, in)"""
    dtype = work_dtype(G)
    return Q_S.T.to(dtype) @ G.to(dtype) @ Q_A.to(dtype)


@dataclass
class KronOp(LinearOp):
    """Per block: eigenbases ``Q_S`` (out, out), ``Q_A`` (in, in) and eigenvalues Λ (out, in).

    The operator on block b maps G (out, in) to ``Q_S [(Q_Sᵀ G Q_A) ∘ Λ] Q_Aᵀ``; it is
    block-diagonal across the space's blocks. Damping, inverse and powers act on Λ
    (rules ``kronecker.*``), exactly, since ``Q_S ⊗ Q_A`` is orthogonal.
    """

    space: object
    bases: dict  # name -> (Q_S, Q_A)
    eigenvalues: dict  # name -> (out, in)
    tags: frozenset = frozenset()
    rules: tuple = ()

    form = "kronecker"
    kind = "kron"

    def _with(self, eigenvalues) -> "KronOp":
        return replace(self, eigenvalues=eigenvalues)

    def _scale(self, c: float) -> "KronOp":
        return self._with({k: c * v for k, v in self.eigenvalues.items()})

    def _damp(self, damping: float) -> "KronOp":
        return self._with({k: v + damping for k, v in self.eigenvalues.items()})

    def _inverse(self, what, rule, settings) -> "KronOp":
        return self._with({k: reciprocal(v.to(torch.float64), f"{what} (block {k!r})").to(v.dtype)
                           for k, v in self.eigenvalues.items()})

    def _power(self, p, what, rtol) -> "KronOp":
        return self._with({k: power_values(v.to(torch.float64), p, f"{what} (block {k!r})", rtol).to(v.dtype)
                           for k, v in self.eigenvalues.items()})

    def _spectral(self, fn, what) -> "KronOp":
        return self._with({k: fn(v.to(torch.float64)).to(v.dtype) for k, v in self.eigenvalues.items()})

    def trace(self) -> float:
        return sum(float(v.sum()) for v in self.eigenvalues.values())

    def damp_factorwise(self, damping: float, *, rtol: float = 1e-10) -> "KronOp":
        """K-FAC's factor-wise damping, rule ``kronecker.factorwise_damp`` (another operator
        than ``damp(λ)`` = F + λI): per block (S + √λ/π I) ⊗ (A + π√λ I) with
        π² = (tr A / in) / (tr S / out) (Martens & Grosse 2015, §6.3; invariant to how Λ
        splits into λ_S ⊗ λ_A), computed on the eigenvalues
        λ_S ⊗ λ_A. Needs K-FAC's Λ = λ_S λ_Aᵀ (rank one up to ``rtol``); EK-FAC's re-fitted
        eigenvalues are refused."""
        if not damping >= 0:
            raise ValueError(f"damping must be non-negative, got {damping}")
        rule = _rules.choose("damp", self.structure, variant="factorwise")
        root = damping ** 0.5
        out = {}
        for name, lam in self.eigenvalues.items():
            lam64 = lam.to(torch.float64)
            U, sv, Vh = torch.linalg.svd(lam64)
            if len(sv) > 1 and sv[1] > rtol * sv[0]:
                _rules.refuse("damp factor-wise", self.structure,
                              f"block {name!r}: its eigenvalues are not a Kronecker product λ_S ⊗ λ_A "
                              "(EK-FAC re-fits them), so K-FAC's factor-wise damping does not exist for it; "
                              "use damp(λ), exact in the eigenbasis")
            lam_S, lam_A = U[:, 0] * sv[0] ** 0.5, Vh[0] * sv[0] ** 0.5
            sign = 1.0 if float(lam_S.sum()) >= 0 else -1.0      # the SVD's sign is arbitrary
            lam_S, lam_A = sign * lam_S, sign * lam_A
            pi = ((lam_A.mean() / lam_S.mean().clamp_min(1e-300)).clamp_min(0)) ** 0.5
            out[name] = torch.outer(lam_S + root / pi.clamp_min(1e-300), lam_A + pi * root).to(lam.dtype)
        return self._with(out)._recorded(self.rules + (rule.name,), self.tags)

    def _intrinsic_tags(self) -> frozenset:
        return frozenset({"psd"}) if all(bool((v >= 0).all()) for v in self.eigenvalues.values()) else frozenset()

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (n, dim) ↦ (H x_i)_i.   Returns (n, dim)."""
        out = torch.empty_like(rows)
        dtype = work_dtype(rows)  # float32 rows are rotated in float32 (orthogonal maps: no growth)
        for name, s in self.space.offsets().items():
            Q_S, Q_A = (Q.to(dtype) for Q in self.bases[name])
            lam = self.eigenvalues[name].to(dtype)
            G = rows[:, s].reshape(rows.shape[0], Q_S.shape[0], Q_A.shape[0]).to(dtype)
            rotated = Q_S.T @ G @ Q_A
            out[:, s] = (Q_S @ (rotated * lam) @ Q_A.T).flatten(1).to(rows.dtype)
        return out

    def apply_blocks(self, blocks: dict) -> dict:
        """Per block, rows given as :class:`Factors` or (n, out·in) ↦ (n, out·in) rows
        ``Q_S [(Q_Sᵀ G_i Q_A) ∘ Λ] Q_Aᵀ``, without concatenating the blocks.

        Factored rows are rotated in from their factors, ``(D_i Q_S)ᵀ (A_i Q_A)``:
        T·(out² + in² + out·in) per example instead of materializing G_i (T·out·in) and
        rotating it (out·in·(out + in)), whichever is fewer multiply-adds.
        """
        out = {}
        for name, value in blocks.items():
            Q_S, Q_A = self.bases[name]
            o, i = Q_S.shape[0], Q_A.shape[0]
            if isinstance(value, Factors) and value.T * (o * o + i * i) < o * i * (o + i):
                rotated = rotate_factors(value, Q_S, Q_A)
            else:
                G = materialize(value).flatten(1) if isinstance(value, Factors) else value
                rotated = rotate_rows(G.reshape(G.shape[0], o, i), Q_S, Q_A)
            dtype = rotated.dtype
            rotated *= self.eigenvalues[name].to(dtype)
            n = rotated.shape[0]
            back = (rotated.reshape(n * o, i) @ Q_A.T.to(dtype)).reshape(n, o, i)   # · Q_Aᵀ, one GEMM
            out[name] = torch.matmul(Q_S.to(dtype), back).reshape(n, o * i)         # Q_S ·
        return out

    def block_matrix(self, name: str) -> torch.Tensor:
        """Block ``name``'s (out·in, out·in) matrix (Q_S⊗Q_A) diag(vec Λ) (Q_S⊗Q_A)ᵀ."""
        Q_S, Q_A = self.bases[name]
        K = torch.kron(Q_S, Q_A)
        return (K * self.eigenvalues[name].flatten().unsqueeze(0)) @ K.T

    def dense(self) -> torch.Tensor:
        return torch.block_diag(*(self.block_matrix(n) for n in self.space.names))

    def nbytes(self) -> int:
        total = 0
        for name in self.space.names:
            Q_S, Q_A = self.bases[name]
            total += (Q_S.numel() + Q_A.numel() + self.eigenvalues[name].numel()) * 8
        return total
