"""Resolved operators: the numbers behind an operator node, stored by structure.

``ResolvedOp`` holds ``diag`` (a (dim,) vector), ``block`` (one (d_b, d_b) matrix per
block) or ``dense`` (one (dim, dim) matrix), and implements the operator algebra on
them. Inverses and powers go through a symmetric eigendecomposition in float64, so a
singular matrix is reported (with the fix: damp it) instead of silently amplified.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import GradalgError
from ..expr.operators import coarsest
from ..expr.space import ParamSpace

__all__ = ["ResolvedOp"]


def _sym_fn(matrix: torch.Tensor, fn, what: str) -> torch.Tensor:
    m = matrix.to(torch.float64)
    m = (m + m.T) / 2
    evals, evecs = torch.linalg.eigh(m)
    return (evecs * fn(evals, what).unsqueeze(0)) @ evecs.T


def _inv_values(values: torch.Tensor, what: str) -> torch.Tensor:
    scale = values.abs().max().clamp_min(1e-300)
    if (values <= scale * 1e-15).any():
        raise GradalgError(
            f"cannot invert {what}: it is singular or not positive definite (smallest "
            f"eigenvalue {float(values.min()):.3g}). Add damping first: op.damp(λ) with λ around "
            "1e-3 × the mean eigenvalue, or project to fewer dimensions than examples."
        )
    return 1.0 / values


@dataclass
class ResolvedOp:
    """An operator's numbers. ``kind`` is "diag", "block" or "dense"."""

    space: ParamSpace
    kind: str
    data: object  # (dim,) tensor | dict[name, (d_b, d_b)] | (dim, dim) tensor

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def identity(cls, space, dtype=torch.float32, device="cpu"):
        """The identity on ``space``, held as a diagonal of ones (dim,)."""
        return cls(space, "diag", torch.ones(space.dim, dtype=dtype, device=device))

    # ---- conversions --------------------------------------------------------------
    def as_kind(self, kind: str) -> "ResolvedOp":
        """The same operator stored with a coarser structure."""
        if kind == self.kind:
            return self
        offsets = self.space.offsets()
        if self.kind == "diag" and kind == "block":
            return ResolvedOp(self.space, "block", {n: torch.diag(self.data[s]) for n, s in offsets.items()})
        if kind == "dense":
            return ResolvedOp(self.space, "dense", self.dense())
        raise ValueError(f"cannot convert a {self.kind} operator to {kind}")

    def dense(self) -> torch.Tensor:
        """The full (dim, dim) matrix."""
        if self.kind == "dense":
            return self.data
        if self.kind == "diag":
            return torch.diag(self.data)
        return torch.block_diag(*(self.data[n] for n in self.space.names))

    # ---- algebra ------------------------------------------------------------------
    def scale(self, c: float) -> "ResolvedOp":
        """c · H, in the same structure."""
        if self.kind == "block":
            return ResolvedOp(self.space, "block", {n: c * m for n, m in self.data.items()})
        return ResolvedOp(self.space, self.kind, c * self.data)

    def add(self, other: "ResolvedOp") -> "ResolvedOp":
        """H + H', held in the coarser of the two structures (diag < block < dense)."""
        kind = coarsest(self.kind, other.kind)
        a, b = self.as_kind(kind), other.as_kind(kind)
        if kind == "block":
            return ResolvedOp(self.space, kind, {n: a.data[n] + b.data[n] for n in self.space.names})
        return ResolvedOp(self.space, kind, a.data + b.data)

    def damp(self, damping: float) -> "ResolvedOp":
        """H + λI for λ = ``damping`` ≥ 0."""
        if damping < 0:
            raise ValueError(f"damping must be non-negative, got {damping}")
        ref = self.data if self.kind != "block" else next(iter(self.data.values()))
        return self.add(ResolvedOp.identity(self.space, ref.dtype, ref.device).scale(damping))

    def _map(self, fn, what) -> "ResolvedOp":
        if self.kind == "diag":
            return ResolvedOp(self.space, "diag", fn(self.data.to(torch.float64), what).to(self.data.dtype))
        if self.kind == "block":
            return ResolvedOp(self.space, "block", {
                n: _sym_fn(m, fn, f"{what} (block {n!r})").to(m.dtype) for n, m in self.data.items()})
        return ResolvedOp(self.space, "dense", _sym_fn(self.data, fn, what).to(self.data.dtype))

    def inverse(self, what: str = "the operator") -> "ResolvedOp":
        """H⁻¹ by eigendecomposition of each diagonal / block / dense part; a singular or
        indefinite H raises ``GradalgError`` naming ``what`` and suggesting damping."""
        return self._map(_inv_values, what)

    def power(self, p: float, what: str = "the operator") -> "ResolvedOp":
        """H^p by eigendecomposition: negative ``p`` inverts (and refuses a singular H as
        :meth:`inverse` does); positive ``p`` clamps negative eigenvalues at 0."""
        def fn(values, what):
            if p < 0:
                return _inv_values(values, what) ** (-p)
            return values.clamp_min(0) ** p
        return self._map(fn, what)

    # ---- application --------------------------------------------------------------
    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (n, dim) ↦ rows Hᵀ = (H x_i)_i for symmetric H.   Returns (n, dim)."""
        if self.kind == "diag":
            return rows * self.data.to(rows.dtype)
        if self.kind == "dense":
            return rows @ self.data.to(rows.dtype)
        out = torch.empty_like(rows)
        for name, s in self.space.offsets().items():
            out[:, s] = rows[:, s] @ self.data[name].to(rows.dtype)
        return out

    def nbytes(self) -> int:
        """Bytes the operator's tensors take."""
        if self.kind == "block":
            return sum(m.numel() * m.element_size() for m in self.data.values())
        return self.data.numel() * self.data.element_size()


def damp_resolved(op, damping: float, relative: bool = False):
    """``op + λI``; with ``relative``, λ = damping · tr(op)/dim (the mean eigenvalue of
    an explicit dense, block or diagonal operator)."""
    if not relative:
        return op.damp(damping)
    if not isinstance(op, ResolvedOp) or op.kind not in ("dense", "block", "diag"):
        raise ValueError("relative damping needs an explicit operator (dense, block or diagonal), got "
                         f"{getattr(op, 'kind', type(op).__name__)}: pass an absolute damping")
    if op.kind == "diag":
        trace = float(op.data.sum())
    elif op.kind == "dense":
        trace = float(op.data.diagonal().sum())
    else:
        trace = sum(float(m.diagonal().sum()) for m in op.data.values())
    return op.damp(damping * max(trace, 0.0) / max(op.space.dim, 1))
