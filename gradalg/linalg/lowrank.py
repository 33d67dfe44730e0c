"""Low-rank operators on a kept eigenspace (Arnoldi, Schioppa et al. 2022).

``LowRankOp`` is V diag(μ) Vᵀ with orthonormal eigenvectors V (dim, r) and eigenvalues
μ (r,). Its algebra stays on the span of V (the complement is zero throughout):
damping shifts μ, the inverse is V diag(1/μ) Vᵀ (the pseudo-inverse), powers are
V diag(μ^p) Vᵀ — the named rules ``low-rank.*_within_subspace``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .base import LinearOp, power_values, reciprocal

__all__ = ["LowRankOp"]


@dataclass
class LowRankOp(LinearOp):
    """V diag(μ) Vᵀ: eigenvalues μ (r,), orthonormal eigenvectors V (dim, r)."""

    space: object
    eigenvalues: torch.Tensor
    vectors: torch.Tensor
    tags: frozenset = frozenset()
    rules: tuple = ()

    form = "low-rank"
    kind = "lowrank"

    def _intrinsic_tags(self) -> frozenset:
        return frozenset({"psd"}) if bool((self.eigenvalues >= 0).all()) else frozenset()

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        V = self.vectors.to(rows.dtype)
        return ((rows @ V) * self.eigenvalues.to(rows.dtype)) @ V.T

    def dense(self) -> torch.Tensor:
        return (self.vectors * self.eigenvalues) @ self.vectors.T

    def nbytes(self) -> int:
        return (self.vectors.numel() + self.eigenvalues.numel()) * self.vectors.element_size()

    def trace(self) -> float:
        return float(self.eigenvalues.sum())

    def _scale(self, c: float) -> "LowRankOp":
        return replace(self, eigenvalues=c * self.eigenvalues)

    def _damp(self, damping: float) -> "LowRankOp":
        return replace(self, eigenvalues=self.eigenvalues + damping)

    def _inverse(self, what, rule, settings) -> "LowRankOp":
        values = self.eigenvalues.to(torch.float64)
        return replace(self, eigenvalues=reciprocal(values, what).to(self.eigenvalues.dtype))

    def _power(self, p, what, rtol) -> "LowRankOp":
        values = self.eigenvalues.to(torch.float64)
        return replace(self, eigenvalues=power_values(values, p, what, rtol).to(self.eigenvalues.dtype))
