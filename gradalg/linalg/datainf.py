"""DataInf's inverse (Kwon et al. 2024), applied by one read of the training rows.

Per block b, with g_ib the training rows (n of them) and λ > 0:

    (F_b + λI)⁻¹ ≈ (1/(nλ)) Σ_i (I − g_ib g_ibᵀ / (λ + ‖g_ib‖²))

so for a query row q (its block q_b):

    H⁻¹q_b = (1/λ) (q_b − (1/n) Σ_i g_ib (g_ibᵀ q_b) / (λ + ‖g_ib‖²))

An approximate inverse known only by this closed form (labels ``implicit`` and
``approximate-inverse``): damping, inverting or powers of it are refused by the rules.
The operator holds no executor: ``rows`` is a callable that returns a fresh iterable of
the training rows, chunk by chunk, as ``{block: rows (c, d_b) or Factors}`` dicts.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch

from ..capture.chunks import flat_block
from ..errors import GradalgError
from .base import LinearOp

__all__ = ["DataInfOp"]


@dataclass
class DataInfOp(LinearOp):
    """``coef`` · DataInf's inverse with damping λ over the rows ``rows()`` streams (module docs)."""

    space: object
    rows: Callable[[], Iterable[dict]]
    damping: float
    coef: float = 1.0
    tags: frozenset = frozenset({"approximate-inverse", "psd"})
    rules: tuple = ()

    form = "implicit"
    kind = "implicit"

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """Query rows (m, dim) ↦ (m, dim), one read of the training rows."""
        lam = self.damping
        if not lam > 0:
            raise GradalgError("DataInf needs a positive damping λ: ga.datainf(G, damping=λ) with λ > 0")
        offsets = self.space.offsets()
        q = {name: rows[:, s] for name, s in offsets.items()}
        acc = {name: torch.zeros_like(v) for name, v in q.items()}
        n = 0
        for blocks in self.rows():
            for i, name in enumerate(offsets):
                g = flat_block(blocks[name]).to(rows.dtype)             # (c, d_b)
                n += g.shape[0] if i == 0 else 0
                coef = (q[name] @ g.T) / (lam + (g * g).sum(1))         # (m, c)
                acc[name] += coef @ g
        if n == 0:
            raise GradalgError("DataInf's inverse over zero training rows: give ga.datainf gradients of a "
                               "non-empty dataset")
        out = [(q[name] - acc[name] / n) / lam for name in offsets]
        return self.coef * torch.cat(out, dim=1)

    def _scale(self, c: float) -> "DataInfOp":
        return replace(self, coef=self.coef * c)
