"""The apply job: an operator known only by a closed form over training rows (DataInf's
inverse, :class:`~gradalg.expr.DataInf`) applied to a score's held rows in a planned pass
over its own rows, with its accumulator.

The operator says so with ``Statistic("apply", op, rows)``: applying it to held rows
reads ``rows`` once. The decide stage plans that read as an :class:`ApplyJob` in a pass
over ``rows``, after the held rows are collected and before the scores job that
preconditions them, which names it (``ScoresJob.applied``: its key) and reads the
preconditioned rows by that key when it runs. Elsewhere (a row-wise chain, a self-score)
the operator still reads its rows itself when applied.

class       reads                        produces
ApplyJob    the operator's rows, once    H⁻¹ (held rows): (m, dim), for the scores job
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...capture.chunks import concat_chunks, flatten
from ..cost import Cost, gemm_cost, materialize_cost
from ..estimates import factored_blocks, made_flat_cost, elementwise_cost
from ..memory import positions
from .base import Job

__all__ = ["ApplyJob", "AppliedSums", "held_application"]

#: full-size (m, dim) ops of DataInf's finish, H⁻¹q = coef · (1/λ)(q − s/n) block by block,
#: then concatenated (:meth:`~gradalg.linalg.datainf.DataInfSums.finish`,
#: :meth:`AppliedSums.finish`): s/n (1 read), q − · (2), /λ (1), the concatenation (1), coef ·
#: (1); each writes a fresh tensor
FINISH_OPS = {"reads": 6, "writes": 5}


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
    phase: ClassVar[str] = "statistics"
    ops_per_block: ClassVar[int] = 6
    per_row_set: ClassVar[bool] = True

    def describe(self) -> str:
        return f"apply {self.target.op.label} to the held rows {self.held.label!r} ({self.held.n:,} rows)"

    def chunk_cost(self, node, c, layout, facts) -> Cost:
        """Per block b of d_b coordinates, as :meth:`~gradalg.linalg.datainf.DataInfSums.update`
        runs it on c rows against the m held rows: the rows made flat (factors
        materialized), their squares g∘g into a fresh (c, d_b) tensor and summed over
        coordinates, ``q_b gᵀ`` (a GEMM (m, c, d_b)), ``coef · g`` (a GEMM (m, d_b, c):
        an inner dimension of c, priced as outer products) into a fresh (m, d_b) tensor,
        added to the sums (read twice, written once)."""
        T, factored, elem, m = positions(node, facts.shapes), factored_blocks(node, layout), facts.elem, self.held.n
        return sum((made_flat_cost(b, c, T, factored, elem) + elementwise_cost(c * b.dim, 2, 1, elem)
                    + Cost(flops=2.0 * c * b.dim, bytes=float(elem) * c * b.dim)
                    + gemm_cost(m, c, b.dim, 1, elem) + gemm_cost(m, b.dim, c, 1, elem)
                    + Cost(flops=float(m * b.dim), bytes=3.0 * elem * m * b.dim, faulted=float(elem) * m * b.dim)
                    for b in node.space.blocks), Cost())

    def once_cost(self, facts, storage_of=None, options=None, resolved=None) -> Cost:
        """The m held rows made one flat (m, dim) tensor, ``flatten(concat_chunks(rows))``
        (each block kept as factors materialized, a batched call of m (out, in, T) products
        written into fresh memory, then every block copied into one fresh (m, dim) tensor),
        the (m, dim) sums zeroed (fresh memory), and the finish's :data:`FINISH_OPS`
        full-size ops over (m, dim). The scores job it serves (``ScoresJob.applied``) does
        not apply the operator again."""
        held, elem, m = self.held, facts.elem, self.held.n
        numbers, T = m * held.space.dim, positions(held, facts.shapes)
        factored = factored_blocks(held, storage_of(held) if storage_of is not None else {})
        flat = sum((materialize_cost(m, T[b.name], b.shape[1], b.shape[0], elem) + Cost(faulted=float(elem) * m * b.dim)
                    for b in held.space.blocks if factored[b.name]), Cost()) + elementwise_cost(numbers, 1, 1, elem)
        return (flat + Cost(bytes=float(elem) * numbers, faulted=float(elem) * numbers)
                + elementwise_cost(numbers, FINISH_OPS["reads"], FINISH_OPS["writes"], elem))

    def applied_ops(self) -> tuple:
        """The operator, resolved in this pass (its accumulator's ``ctx.resolve``)."""
        return (self.target.op,)

    def example_bytes(self, facts) -> float:
        return self.streams[0].space.dim * facts.elem      # the rows made flat

    def fixed_bytes(self, facts) -> float:
        """The held rows flat and the sums: m·dim·2·elem."""
        return self.held.n * self.held.space.dim * 2.0 * facts.elem

    def output_bytes(self, n: int) -> float:
        return 8.0 * self.held.n * self.held.space.dim

    # ------------------------------------------------------------------ running
    def accumulator(self, ctx) -> "AppliedSums":
        """The resolved operator's sums of its application to the held rows
        (``resolved.sums(q)``; no data read: its rows are a lazy stream)."""
        resolved = ctx.resolve(self.target.op)
        q = flatten(concat_chunks(ctx.state.rows[self.held.token]), self.held.space)      # (m, dim)
        return AppliedSums(resolved.sums(q), resolved.coef, q)

    def publish(self, result, state) -> None:
        state.results[self.key] = result[1]       # H⁻¹q (m, dim), read by the scores job that names this one


class AppliedSums:
    """The sums of an operator applied to held rows ``q`` (m, dim), fed the operator's rows
    chunk by chunk; ``finish()`` gives ``(q, coef · sums)``, the held rows and H⁻¹q."""

    def __init__(self, sums, coef: float, q):
        self.sums, self.coef, self.q = sums, coef, q

    def update(self, chunk) -> None:
        self.sums.update(chunk.blocks)

    def export(self):
        return self.sums.export()

    def absorb(self, part) -> None:
        self.sums.absorb(part)

    def finish(self):
        return self.q, self.coef * self.sums.finish()

