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

__all__ = ["DataInfOp", "DataInfSums"]


class DataInfSums:
    """The sums DataInf's inverse applied to query rows q (m, dim) needs, over training
    rows given chunk by chunk (:meth:`update`), per block b, in q's dtype:

        s_b = Σ_i g_ib (g_ibᵀ q_b) / (λ + ‖g_ib‖²)   (m, d_b),    n = Σ 1

    and the result (:meth:`finish`) H⁻¹q = (1/λ) (q − s/n), (m, dim). Sums over disjoint
    parts of the rows add (:meth:`export` / :meth:`absorb`): a pass split in shards gives
    the same result within rounding. (Float64 sums cost two GEMMs at double width per
    chunk and gave the same error against a float64 reference on float32 rows, 8.8e-8
    of the largest score: not used.)"""

    def __init__(self, space, q: torch.Tensor, damping: float):
        if not damping > 0:
            raise GradalgError("DataInf needs a positive damping λ: ga.datainf(G, damping=λ) with λ > 0")
        self.offsets, self.q, self.damping, self.n = space.offsets(), q, damping, 0
        self.qb = {name: q[:, s] for name, s in self.offsets.items()}
        self.sums = {name: torch.zeros_like(v) for name, v in self.qb.items()}

    def update(self, blocks: dict) -> None:
        """Add one chunk of training rows ``{block: (c, d_b) rows or Factors}``."""
        for i, name in enumerate(self.offsets):
            g = flat_block(blocks[name]).to(self.q.dtype)                 # (c, d_b)
            self.n += g.shape[0] if i == 0 else 0
            coef = (self.qb[name] @ g.T) / (self.damping + (g * g).sum(1))    # (m, c)
            self.sums[name] += coef @ g

    def export(self):
        return self.sums, self.n

    def absorb(self, part) -> None:
        sums, n = part
        for name, v in sums.items():
            self.sums[name] += v.to(self.sums[name].device)
        self.n += n

    def finish(self) -> torch.Tensor:
        if self.n == 0:
            raise GradalgError("DataInf's inverse over zero training rows: give ga.datainf gradients of a "
                               "non-empty dataset")
        out = [(self.qb[name] - self.sums[name] / self.n) / self.damping for name in self.offsets]
        return torch.cat(out, dim=1)


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

    def sums(self, q: torch.Tensor) -> "DataInfSums":
        """The sums of its application to the rows ``q`` (m, dim), to be given the training
        rows (a planned pass does: :class:`~gradalg.plan.jobs.apply.ApplyJob`); ``finish()``
        × ``coef`` is :meth:`apply`'s result."""
        return DataInfSums(self.space, q, self.damping)

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """Query rows (m, dim) ↦ (m, dim), one read of the training rows (:class:`DataInfSums`)."""
        sums = self.sums(rows)
        for blocks in self.rows():
            sums.update(blocks)
        return self.coef * sums.finish()

    def _scale(self, c: float) -> "DataInfOp":
        return replace(self, coef=self.coef * c)
