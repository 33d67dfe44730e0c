"""Operators known only through products, and their iterative inverses.

``ImplicitOp``   c·H + λI through ``matvec(V (m, dim)) -> H V (m, dim)``
``SolvedOp``     (c·H + λI)⁻¹ applied by CG or LiSSA (:mod:`gradalg.linalg.solvers`);
                 when H's products are passes over data, one pass per iteration
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..errors import OptionError
from .base import LinearOp
from .solvers import conjugate_gradient, lissa

__all__ = ["ImplicitOp", "SolvedOp"]


@dataclass
class ImplicitOp(LinearOp):
    """c · H + λ I with H given by ``matvec(V (m, dim)) -> (m, dim)``."""

    space: object
    matvec: Callable
    scale_: float = 1.0
    shift: float = 0.0
    tags: frozenset = frozenset()
    rules: tuple = ()

    form = "implicit"
    kind = "implicit"

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """c · H V + λ V  (m, dim), in the dtype H V and V promote to; c = 1 and λ = 0 (a formation's
        H, CG's undamped operand) make no (m, dim) temporaries for them: before, c · H V and 0 · V and
        their sum, 16·m·dim bytes more beside a formation's float64 columns (session 49)."""
        out = self.matvec(rows)
        out = out if self.scale_ == 1 else self.scale_ * out
        out = out + self.shift * rows if self.shift else out
        return out.to(torch.promote_types(out.dtype, rows.dtype))

    def _scale(self, c: float) -> "ImplicitOp":
        return replace(self, scale_=self.scale_ * c, shift=self.shift * c)

    def _damp(self, damping: float) -> "ImplicitOp":
        return replace(self, shift=self.shift + damping)

    def _inverse(self, what, rule, settings) -> "SolvedOp":
        return SolvedOp(self.space, self, rule.variant, dict(settings))


@dataclass
class SolvedOp(LinearOp):
    """(c·H + λI)⁻¹ applied by an iterative solver (``method``: "cg" or "lissa"),
    tuned by ``settings`` (CG: ``max_iter``, ``rtol``; LiSSA: ``scale``, ``depth``, ``tol``)."""

    space: object
    op: ImplicitOp
    method: str = "cg"
    settings: dict = field(default_factory=dict)
    coef: float = 1.0          # the operator is coef · (c·H + λI)⁻¹
    tags: frozenset = frozenset({"inverse"})
    rules: tuple = ()

    form = "implicit"
    kind = "implicit"

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        c, lam = self.op.scale_, self.op.shift

        def matvec(V):
            return c * self.op.matvec(V)

        if self.method == "cg":
            return self.coef * conjugate_gradient(matvec, rows, lam, **self.settings)
        if self.method == "lissa":
            return self.coef * lissa(matvec, rows, lam, **self.settings)
        raise OptionError(f"unknown solver {self.method!r}: use 'cg' or 'lissa'")

    def solve(self, rows: torch.Tensor, **settings) -> torch.Tensor:
        """(coef · A⁻¹)⁻¹ x = A x / coef: the products themselves, no solver."""
        return self.op.apply(rows) / self.coef

    def _scale(self, c: float) -> "SolvedOp":
        return replace(self, coef=self.coef * c)

    def _inverse(self, what, rule, settings) -> ImplicitOp:
        return self.op._scale(1.0 / self.coef)
