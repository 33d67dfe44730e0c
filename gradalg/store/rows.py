"""Rows a:b of a gradient expression, computed on their own, for the stores.

A store is written chunk by chunk, each chunk a pure function of its row range, so a
crashed or retried chunk is recomputed to the same numbers: rows a:b of a node are the
rows of its *window* (:func:`~gradalg.expr.windows.restrict_rows`, the row chain over rows
a:b of its stream root), computed by a plan like any gradient node
(:meth:`~gradalg.exec.base.Executor.window`: priced, sized against the memory budget and
shown by ``explain()``). :func:`~gradalg.expr.windows.freeze_ops` replaces the operators of
a chain by leaves holding their resolved numbers, computed once, so the chunks (on this
process or on Dask workers) never resolve them again.
"""
from __future__ import annotations


import torch

from ..api import executor_for  # noqa: F401 - the store's writers use it from here
from ..errors import ExampleIdsError, GradalgError, MemoryBudgetError
from ..capture.chunks import Chunk, flat_block
from ..expr import GradNode
from ..expr.stored import StoredOp
from ..expr.windows import ResolvedStore, freeze_ops, restrict_rows, restrictable
from ..plan.size import FEWER_QUERIES
from . import layout

__all__ = ["executor_for", "restrict_rows", "restrictable", "freeze_ops", "ResolvedStore", "MemoryRows", "flat_rows"]


def fault_policy(executor):
    """The executor's :class:`~gradalg.exec.resilience.FaultPolicy` (defaults for a
    client that came without one)."""
    from ..exec.resilience import FaultPolicy
    policy = getattr(executor, "faults", None)
    return policy if policy is not None else FaultPolicy(retries=getattr(executor, "retries", 0))


def check_shippable(node) -> None:
    """Refuse operators that hold this process's executor (known only through products)."""
    for x in node.walk():
        if isinstance(x, StoredOp) and getattr(x.store.load(), "kind", None) == "implicit":
            raise GradalgError(
                "an operator known only through products (ga.hessian, ga.gauss_newton, ga.datainf, "
                "or an iterative inverse) cannot be sent to Dask workers: write this store with the "
                "local executor, or use an explicit curvature (ga.fisher, ga.kfac, ga.arnoldi)")


class MemoryRows:
    """Rows computed once and kept in memory, as the store of a :class:`Stored` leaf."""

    def __init__(self, chunk: Chunk, token: str, label: str):
        self.chunk = Chunk(chunk.ids, dict(chunk.blocks))
        self.token = f"rows-{token}"
        self.label = label
        self.description = {"rows": token}
        self.summary = {}

    @property
    def n(self) -> int:
        return self.chunk.n

    @property
    def ids(self) -> tuple:
        return self.chunk.ids

    def chunks(self):
        yield self.chunk


def flat_rows(chunk: Chunk, names) -> dict[str, torch.Tensor]:
    """Each block of ``chunk`` as an (n, dim) tensor (factors materialized)."""
    return {name: flat_block(chunk.blocks[name]) for name in names}


def rows_of(executor, node: GradNode, start: int, stop: int) -> Chunk:
    """Rows start:stop of ``node`` (one chunk), by the plan of their window
    (:meth:`~gradalg.exec.base.Executor.window`), checked to be the rows of those examples.
    A window its plan refuses for memory is refused with the fix of fewer rows per chunk
    first (:func:`fewer_rows`), and without the plan's "fewer queries per call": a chunk's
    rows are the ones it holds, and there are no queries to have fewer of."""
    try:
        out = executor.window(node, start, stop)
    except MemoryBudgetError as err:
        err.fixes[:] = [*fewer_rows(executor, node, start, stop), *(f for f in err.fixes if f != FEWER_QUERIES)]
        raise
    if out.n != stop - start:
        raise GradalgError(f"rows {start}:{stop} gave {out.n} rows: the data must give one row per example")
    check_row_ids(out.ids, node.ids[start:stop], f"rows {start}:{stop}")
    return out


def fewer_rows(executor, node: GradNode, start: int, stop: int) -> list[str]:
    """The fix of a store chunk of rows start:stop that its plan refuses for memory: rows
    per chunk that do plan under the budget, halving until one does (each tried by the
    plan of its window, nothing run); none when not even one row does."""
    rows = (stop - start) // 2
    while rows >= 1:
        try:
            executor.plan(restrict_rows(node, start, start + rows))
            return [f"write fewer rows per chunk (ga.store.write(..., chunk_rows={rows}))"]
        except MemoryBudgetError:
            rows //= 2
    return []


def check_row_ids(got, expected, where: str) -> None:
    """Rows are written by position: refuse rows whose ids are not the expected ones, in
    order (a loader or ``collate_fn`` that reorders or swaps examples)."""
    got, expected = list(got), list(expected)
    if got != expected:
        raise ExampleIdsError(layout.ids_difference(f"the ids of the computed {where}", "the expression's", got, expected,
                                             "example")
                              + ": the data yielded other examples, or in another order, than its ids say; "
                                "give the data in the order of its ids (no shuffling sampler or reordering "
                                "collate_fn)")
