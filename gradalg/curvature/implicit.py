"""Operators known only through products: ``H V`` by passes over data, their iterative
inverses, and low-rank (Arnoldi) approximations.

``ImplicitOp``   c·H + λI through ``matvec``; ``inverse()`` returns a solver-backed op
``SolvedOp``     (c·H + λI)⁻¹ applied by CG or LiSSA, one pass over data per iteration
``LowRankOp``    V diag(μ) Vᵀ on H's top-r eigenspace (Arnoldi); inverse = V diag(1/(μ+λ)) Vᵀ,
                 as in Schioppa et al. (2022), which ignores the complement of the subspace
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..errors import GradalgError
from .solvers import conjugate_gradient, lissa

__all__ = ["ImplicitOp", "SolvedOp", "LowRankOp", "dense_by_products"]


def dense_by_products(op) -> torch.Tensor:
    """The full (dim, dim) matrix of an operator known by products: dim of them, so for
    tests and small spaces only."""
    eye = torch.eye(op.space.dim, dtype=torch.float64)
    return op.apply(eye).T


@dataclass
class ImplicitOp:
    """c · H + λ I with H given by ``matvec(V (m, dim)) -> (m, dim)``."""

    space: object
    matvec: Callable
    scale_: float = 1.0
    shift: float = 0.0
    kind: str = "implicit"

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        return self.scale_ * self.matvec(rows) + self.shift * rows

    def scale(self, c: float) -> "ImplicitOp":
        return replace(self, scale_=self.scale_ * c, shift=self.shift * c)

    def damp(self, damping: float) -> "ImplicitOp":
        if damping < 0:
            raise ValueError(f"damping must be non-negative, got {damping}")
        return replace(self, shift=self.shift + damping)

    def inverse(self, what: str = "", method: str = "cg", **settings) -> "SolvedOp":
        return SolvedOp(self, method, settings)

    def power(self, p: float, what: str = ""):
        if p == -1:
            return self.inverse(what)
        if p == 1:
            return self
        raise GradalgError("powers other than ±1 of an operator known only through products need its "
                           "eigendecomposition: use ga.arnoldi(H, rank) first")

    def add(self, other):
        if getattr(other, "kind", None) == "diag" and torch.all(other.data == other.data[0]):
            return self.damp(float(other.data[0]))
        base = self

        def matvec(V):
            return base.apply(V) + other.apply(V)
        return ImplicitOp(self.space, matvec)

    def dense(self) -> torch.Tensor:
        return dense_by_products(self)

    def nbytes(self) -> int:
        return 0


@dataclass
class SolvedOp:
    """(c·H + λI)⁻¹ applied by an iterative solver (``method``: "cg" or "lissa")."""

    op: ImplicitOp
    method: str = "cg"
    settings: dict = field(default_factory=dict)
    kind: str = "implicit"

    @property
    def space(self):
        return self.op.space

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        c, lam = self.op.scale_, self.op.shift

        def matvec(V):
            return c * self.op.matvec(V)

        if self.method == "cg":
            return conjugate_gradient(matvec, rows, lam, **self.settings)
        if self.method == "lissa":
            return lissa(matvec, rows, lam, **self.settings)
        raise ValueError(f"unknown solver {self.method!r}: use 'cg' or 'lissa'")

    def scale(self, c: float):
        return SolvedOp(self.op.scale(1.0 / c), self.method, self.settings)

    def inverse(self, what: str = "", **_):
        return self.op

    def damp(self, damping: float):
        raise GradalgError("damp the operator before inverting it: H.damp(λ).inv()")

    def dense(self) -> torch.Tensor:
        return dense_by_products(self)

    def nbytes(self) -> int:
        return 0


@dataclass
class LowRankOp:
    """V diag(μ) Vᵀ: eigenvalues μ (r,), orthonormal eigenvectors V (dim, r)."""

    space: object
    eigenvalues: torch.Tensor
    vectors: torch.Tensor
    kind: str = "lowrank"

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        V = self.vectors.to(rows.dtype)
        return ((rows @ V) * self.eigenvalues.to(rows.dtype)) @ V.T

    def scale(self, c: float) -> "LowRankOp":
        return replace(self, eigenvalues=c * self.eigenvalues)

    def damp(self, damping: float) -> "LowRankOp":
        """Shift on the kept subspace (the complement stays zero, as in Arnoldi influence)."""
        return replace(self, eigenvalues=self.eigenvalues + damping)

    def inverse(self, what: str = "", **_) -> "LowRankOp":
        if (self.eigenvalues <= 0).any():
            raise GradalgError(f"cannot invert {what or 'the low-rank operator'}: eigenvalue "
                               f"{float(self.eigenvalues.min()):.3g} is not positive; damp it first")
        return replace(self, eigenvalues=1.0 / self.eigenvalues)

    def power(self, p: float, what: str = "") -> "LowRankOp":
        if p < 0:
            return self.inverse(what).power(-p)
        return replace(self, eigenvalues=self.eigenvalues.clamp_min(0) ** p)

    def dense(self) -> torch.Tensor:
        return (self.vectors * self.eigenvalues) @ self.vectors.T

    def nbytes(self) -> int:
        return self.vectors.numel() * self.vectors.element_size()
