"""``f(H)`` for a symmetric operator H and a scalar function f of its eigenvalues.

Resolved on H's eigenstructure: the eigenvalues of an explicit operator (diag, block,
dense: float64 eigendecomposition) or of a K-FAC / EK-FAC operator (its Kronecker
eigenbasis), so ``f(H)`` keeps H's structure. SOURCE's segment operators
(:class:`UnrollDecay`, :class:`UnrollResponse`) are the first users.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .operators import OpNode, operand_cost

__all__ = ["Spectral", "UnrollDecay", "UnrollResponse"]


@dataclass(frozen=True)
class UnrollDecay:
    """f(λ) = (1 − ηλ)^K: K steps of gradient descent with learning rate η on a
    quadratic with curvature λ shrink a perturbation by this factor."""

    lr: float
    steps: int

    def __call__(self, lam: torch.Tensor) -> torch.Tensor:
        return torch.pow(1 - self.lr * lam, self.steps)

    def __repr__(self):
        return f"(1−ηλ)^K, η={self.lr:g}, K={self.steps}"


@dataclass(frozen=True)
class UnrollResponse:
    """f(λ) = (1 − (1 − ηλ)^K) / λ = η Σ_{k<K} (1 − ηλ)^k: the response of K steps of
    gradient descent to a constant extra gradient (ηK at λ = 0, its limit)."""

    lr: float
    steps: int

    def __call__(self, lam: torch.Tensor) -> torch.Tensor:
        x = self.lr * lam
        stable = (x > -1) & (x < 1)           # 1 − (1 − x)^K = −expm1(K·log1p(−x)), exact near 0
        safe_x = torch.where(stable, x, torch.zeros_like(x))
        near = -torch.expm1(self.steps * torch.log1p(-safe_x))
        far = 1 - torch.pow(1 - x, self.steps)
        numer = torch.where(stable, near, far)
        small = x.abs() < 1e-300
        ratio = numer / torch.where(small, torch.ones_like(x), x)
        return self.lr * torch.where(small, torch.full_like(x, float(self.steps)), ratio)

    def __repr__(self):
        return f"(1−(1−ηλ)^K)/λ, η={self.lr:g}, K={self.steps}"


@dataclass(frozen=True, eq=False)
class Spectral(OpNode):
    """``fn(op)``: op's eigenvectors, ``fn`` of its eigenvalues (``fn`` is identified by repr)."""

    op: OpNode
    fn: object

    @property
    def space(self):
        return self.op.space

    def labels(self):
        return self.op.labels().spectral(what=self.op.label)

    def statistics(self):
        return self.op.statistics()

    def resolve(self, ctx):
        return ctx.resolve(self.op).spectral(self.fn, self.op.label)

    def apply_cost(self, space, n, prices):
        return operand_cost(self, self.op, space, n, prices)

    @property
    def label(self):
        return f"f(H) = {self.fn!r}"
