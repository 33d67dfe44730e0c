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

from dataclasses import dataclass

import torch

from ..capture.factors import Factors, OneHot
from ..errors import GradalgError, MemoryBudgetError

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
class KronOp:
    """Per block: eigenbases ``Q_S`` (out, out), ``Q_A`` (in, in) and eigenvalues (out, in).

    The operator on block b maps G (out, in) to ``Q_S [(Q_Sᵀ G Q_A) ∘ Λ] Q_Aᵀ``.
    """

    space: object
    bases: dict  # name -> (Q_S, Q_A)
    eigenvalues: dict  # name -> (out, in)
    kind: str = "kron"

    def _with(self, eigenvalues) -> "KronOp":
        return KronOp(self.space, self.bases, eigenvalues)

    def scale(self, c: float) -> "KronOp":
        return self._with({k: c * v for k, v in self.eigenvalues.items()})

    def damp(self, damping: float) -> "KronOp":
        if damping < 0:
            raise ValueError(f"damping must be non-negative, got {damping}")
        return self._with({k: v + damping for k, v in self.eigenvalues.items()})

    def inverse(self, what: str = "the Kronecker operator") -> "KronOp":
        out = {}
        for k, v in self.eigenvalues.items():
            if (v <= v.abs().max().clamp_min(1e-300) * 1e-15).any():
                raise GradalgError(
                    f"cannot invert {what} (block {k!r}): eigenvalue {float(v.min()):.3g} is not "
                    "positive. Add damping first: op.damp(λ)."
                )
            out[k] = 1.0 / v
        return self._with(out)

    def power(self, p: float, what: str = "the Kronecker operator") -> "KronOp":
        if p < 0:
            return self.inverse(what).power(-p, what)
        return self._with({k: v.clamp_min(0) ** p for k, v in self.eigenvalues.items()})

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
                from ..exec.chunks import flat_block
                G = flat_block(value)
                rotated = rotate_rows(G.reshape(G.shape[0], o, i), Q_S, Q_A)
            dtype = rotated.dtype
            rotated *= self.eigenvalues[name].to(dtype)
            n = rotated.shape[0]
            back = (rotated.reshape(n * o, i) @ Q_A.T.to(dtype)).reshape(n, o, i)   # · Q_Aᵀ, one GEMM
            out[name] = torch.matmul(Q_S.to(dtype), back).reshape(n, o * i)         # Q_S ·
        return out

    def block_matrix(self, name: str) -> torch.Tensor:
        Q_S, Q_A = self.bases[name]
        K = torch.kron(Q_S, Q_A)
        return (K * self.eigenvalues[name].flatten().unsqueeze(0)) @ K.T

    def dense(self) -> torch.Tensor:
        return torch.block_diag(*(self.block_matrix(n) for n in self.space.names))

    def as_block(self):
        from ..exec.operators import ResolvedOp
        return ResolvedOp(self.space, "block", {n: self.block_matrix(n) for n in self.space.names})

    def add(self, other):
        """Sum with any operator: a damping-like diagonal shift stays Kronecker; else block."""
        from ..exec.operators import ResolvedOp
        if isinstance(other, ResolvedOp) and other.kind == "diag" and torch.all(other.data == other.data[0]):
            return self.damp(float(other.data[0]))
        if isinstance(other, KronOp) and all(
                torch.equal(self.bases[n][0], other.bases[n][0]) and torch.equal(self.bases[n][1], other.bases[n][1])
                for n in self.space.names):
            return self._with({k: v + other.eigenvalues[k] for k, v in self.eigenvalues.items()})
        left = self.as_block()
        return left.add(other.as_block() if isinstance(other, KronOp) else other)

    def nbytes(self) -> int:
        total = 0
        for name in self.space.names:
            Q_S, Q_A = self.bases[name]
            total += (Q_S.numel() + Q_A.numel() + self.eigenvalues[name].numel()) * 8
        return total
