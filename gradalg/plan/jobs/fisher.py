"""The Fisher job: F = (1/n) Σ_i g_i g_iᵀ in float64 (dense d², block Σ d_b², diag d),
with its accumulator."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...capture.chunks import Chunk, flat_block, flatten
from ...errors import DataError
from ...expr import Fisher
from ...linalg import ResolvedOp
from ..cost import Cost, fisher_cost
from ..estimates import materialized_cost
from ..memory import check_statistics_fit
from .base import Job

__all__ = ["StatisticsJob", "FisherJob", "FisherAccumulator"]


@dataclass(eq=False, frozen=True)
class StatisticsJob(Job):
    """A job summing an operator's statistics (the Fisher's, the Kronecker factors'): each
    row set of an example (one per Gauss-Newton term) is its own chunk, what it holds does
    not shrink with fewer queries, and its result is the operator (``state.ops``)."""

    phase: ClassVar[str] = "statistics"
    per_row_set: ClassVar[bool] = True
    shrinks_with_queries: ClassVar[bool] = False

    def publish(self, result, state) -> None:
        state.ops[self.target.token] = result


@dataclass(eq=False, frozen=True)
class FisherJob(StatisticsJob):
    """F = (1/n) Σ_i g_i g_iᵀ in float64 (dense d², block Σ d_b², diag d)."""

    kind: ClassVar[str] = "fisher"
    ops_per_block: ClassVar[int] = 6

    def chunk_cost(self, node, c, layout, facts) -> Cost:
        """The sums Σ g gᵀ over one chunk of ``c`` rows in the operator's structure ("dense",
        "block", or "diag": the squared norms): the rows made flat (factored blocks
        materialized) and their products."""
        return (materialized_cost(node, c, layout, facts.elem, facts.shapes)
                + fisher_cost(c, [b.dim for b in node.space.blocks], self.target.structure))

    def first_decisions(self, options) -> list:
        """A Fisher whose matrix alone exceeds the memory budget is refused here."""
        check_statistics_fit(self.target, options.memory_budget)
        return []

    def example_bytes(self, facts) -> float:
        """One example's rows materialized, their float64 copy and its product (16 bytes more
        per coordinate)."""
        return self.streams[0].space.dim * (facts.elem + 16.0)

    def fixed_bytes(self, facts) -> float:
        return fisher_cost(1, [b.dim for b in self.target.space.blocks], self.target.structure).peak_bytes

    def output_bytes(self, n: int) -> float:
        return self.fixed_bytes(None)

    def accumulator(self, ctx) -> "FisherAccumulator":
        return FisherAccumulator(self.target)


class FisherAccumulator:
    """F = (1/n) Σ_i g_i g_iᵀ, accumulated in float64, as dense, block or diag (its size
    checked against the budget when its job was planned: :meth:`FisherJob.first_decisions`).
    ``acc``: the sums by block (``"block"``), else under the one key None."""

    def __init__(self, node: Fisher):
        self.node, self.space, self.structure = node, node.space, node.structure
        self.acc, self.rows = {}, 0

    def update(self, chunk: Chunk) -> None:
        """Adds the chunk's Σ g gᵀ into the sums in place (``addmm_``): no second (d, d)
        matrix beside them (``x.T @ x`` then ``+=`` held two: the pass measured 2× its
        planned d² float64, 153 MB against 78 MB at d = 3,075). Blocks are made flat one at
        a time."""
        self.rows += chunk.n
        for key in self.space.names if self.structure == "block" else (None,):
            x = (flatten(chunk, self.space) if key is None else flat_block(chunk.blocks[key])).to(torch.float64)
            if self.structure == "diag":
                self._add({key: (x ** 2).sum(0)})
            else:
                self.acc[key] = x.T @ x if key not in self.acc else self.acc[key].addmm_(x.T, x)

    def _add(self, part: dict) -> None:
        for key, value in part.items():
            self.acc[key] = value if key not in self.acc else self.acc[key].add_(value)

    def export(self) -> dict:
        return {"acc": self.acc, "rows": self.rows}

    def absorb(self, state: dict) -> None:
        self.rows += state["rows"]
        self._add(state["acc"])

    def finish(self) -> ResolvedOp:
        if self.rows == 0:
            raise DataError("cannot compute a Fisher over zero examples: give the Fisher rows (its data is empty)")
        n = self.node.grads.n  # rows may repeat an example (objective="expected": one row per term)
        # kept in the accumulation's float64: rounding a rank-deficient Gram matrix (TRAK's
        # ΦᵀΦ with n < k) to float32 leaves eigenvalues of ±1e-7·‖F‖, which a small damping
        # does not cover; rows are cast to the operator where it is applied
        # divided in place, and handed over (a second finish fails loudly, never divides twice):
        # ``acc / n`` made a second (d, d) matrix at the end of the pass
        acc, self.acc = self.acc, None
        if self.structure == "block":
            return ResolvedOp(self.space, "block", {k: v.div_(n) for k, v in acc.items()})
        return ResolvedOp(self.space, self.structure, acc[None].div_(n))
