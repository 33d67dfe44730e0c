"""Jobs for work an operator does with data when it is applied, planned as passes.

An operator known only by a closed form over training rows (DataInf's inverse,
:class:`~gradalg.expr.DataInf`) says so with ``Statistic("apply", op, rows)``: applying it
to a score's held rows reads ``rows`` once. The decide stage plans that read as an
:class:`ApplyJob` in a pass over ``rows``, after the held rows are collected and before
the scores job that preconditions them; the executor then finds the preconditioned rows
ready (:meth:`~gradalg.exec.base.Executor.precondition_held`). Elsewhere (a row-wise
chain, a self-score) the operator still reads its rows itself when applied.

class       reads                        produces
ApplyJob    the operator's rows, once    H⁻¹ (held rows): (m, dim), for the scores job
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .cost import Cost, gemm_cost
from .estimates import fisher_chunk_cost
from .jobs import Job
from .memory import flat_example_bytes
from .shapes import element_size

__all__ = ["ApplyJob", "held_application"]


def held_application(op):
    """The ``"apply"`` statistic of ``op`` itself (its rows are read when it is applied to
    held rows, by a planned :class:`ApplyJob`), or None."""
    return next((s for s in op.statistics() if s.job == "apply" and s.node is op), None)


@dataclass(eq=False, frozen=True)
class ApplyJob(Job):
    """The operator of the score ``target`` (an :class:`~gradalg.expr.Inner`) applied to
    its held rows ``held`` (m of them) while its rows ``streams[0]`` (n) are read: per chunk
    of c rows and block b, two GEMMs (m, c, d_b) (DataInf's sums,
    :class:`~gradalg.linalg.datainf.DataInfSums`). Keyed by the score: each held side
    gets its own application."""

    kind: ClassVar[str] = "apply"
    output: ClassVar[str] = "rows"
    ops_per_block: ClassVar[int] = 6
    per_row_set: ClassVar[bool] = True

    def describe(self) -> str:
        return f"apply {self.target.op.label} to the held rows {self.held.label!r} ({self.held.n:,} rows)"

    def chunk_cost(self, node, c, layout, elem) -> Cost:
        flat = fisher_chunk_cost(node, c, layout, "diag", elem)     # rows made flat, their squared norms
        return sum((gemm_cost(self.held.n, c, b.dim, 2, elem) for b in node.space.blocks), flat)

    def once_cost(self, elem, storage_of=None, options=None, resolved=None) -> Cost:
        """None of its own; the scores job it serves then does not count the application
        again (``("applied", op token, held token)`` added to ``resolved``)."""
        if resolved is not None:
            resolved.add(("applied", self.target.op.token, self.held.token))
        return Cost()

    def example_bytes(self, dtype) -> float:
        return flat_example_bytes(self.streams[0], dtype, 0.0)      # the rows made flat

    def fixed_bytes(self, dtype) -> float:
        """The held rows flat and the sums: m·dim·2·elem."""
        return self.held.n * self.held.space.dim * 2.0 * element_size(dtype)

    def output_bytes(self, n: int) -> float:
        return 8.0 * self.held.n * self.held.space.dim
