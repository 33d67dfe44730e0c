"""Rows a:b of a gradient expression, computed on their own.

A store is written chunk by chunk, each chunk a pure function of its row range, so a
crashed or retried chunk is recomputed to the same numbers. :func:`restrict_rows`
rebuilds the *row chain* of a node (the row-wise nodes down to its stream root) over
rows a:b of the root: a Source (through :meth:`gradalg.expr.GradNode.restrict`) or a
gradient store. Operators are left alone, even one computed from the same dataset: a
Fisher of the training set preconditioning the training rows stays the Fisher of all
of them.

:func:`freeze_ops` replaces the operators of a chain by leaves holding their resolved
numbers, computed once, so the chunks (on this process or on Dask workers) never
resolve them again.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from ..errors import ExampleIdsError, GradalgError, OptionError
from ..capture.chunks import Chunk, concat_chunks, flat_block
from ..expr import GradNode, Normalize, Precondition, Source
from ..expr.stored import Stored, StoredOp
from ..plan.planner import ROW_WISE, stream_root
from . import layout

__all__ = ["executor_for", "restrict_rows", "restrictable", "freeze_ops", "ResolvedStore", "MemoryRows", "flat_rows"]


@contextlib.contextmanager
def executor_for(executor):
    """The executor to use; one made here from a name ("dask") is closed afterwards."""
    from ..exec.base import get_executor

    ex = get_executor(executor)
    try:
        yield ex
    finally:
        if isinstance(executor, str):
            ex.close()


def restrictable(node: GradNode) -> bool:
    """Whether rows a:b of ``node`` can be computed alone (a chain over a Source or a store)."""
    root = stream_root(node)
    return isinstance(root, Source) or (isinstance(root, Stored) and hasattr(root.store, "rows"))


def _with_root(node: GradNode, root: GradNode) -> GradNode:
    if isinstance(node, ROW_WISE):
        return replace(node, grads=_with_root(node.grads, root))
    return root


def restrict_rows(node: GradNode, start: int, stop: int) -> GradNode:
    """``node`` over rows ``start:stop`` of its stream root (operators unchanged)."""
    root = stream_root(node)
    if isinstance(root, Source):
        if root.objective == "expected":
            raise OptionError("gradients with objective='expected' have one row per term of the "
                             "Gauss-Newton decomposition, not per example: they cannot be stored or "
                             "scored by rows; use them for curvature (ga.fisher) only")
        return node.restrict(root.data.token, start, stop)
    if isinstance(root, Stored) and hasattr(root.store, "rows"):
        return _with_root(node, Stored(root.store.rows(start, stop), root.space_, root.representation_))
    raise TypeError(f"rows of {root.label!r} cannot be computed by ranges")


class ResolvedStore:
    """Resolved numbers kept in memory, standing for the operator node ``token``."""

    def __init__(self, resolved, token: str, label: str):
        self.resolved, self.token, self.label = resolved, f"resolved-{token}", label
        self.description = {"resolved": token}
        self.summary = {}

    def load(self):
        return self.resolved


def _frozen(executor, op) -> StoredOp:
    resolved = executor.operator(op)
    return StoredOp(ResolvedStore(resolved, op.token, op.label), op.space, op.structure)


def freeze_ops(executor, node: GradNode, memo: dict | None = None) -> GradNode:
    """``node`` with the operators of its row chain replaced by their resolved numbers."""
    memo = {} if memo is None else memo

    def op_leaf(op):
        if op.token not in memo:
            memo[op.token] = _frozen(executor, op)
        return memo[op.token]

    def go(x):
        if not isinstance(x, ROW_WISE):
            return x
        changes = {"grads": go(x.grads)}
        if isinstance(x, Precondition) or (isinstance(x, Normalize) and x.op is not None):
            changes["op"] = op_leaf(x.op)
        return replace(x, **changes)

    return go(node)


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
    """Rows start:stop of ``node`` through ``executor``'s pull path (one chunk)."""
    sub = restrict_rows(node, start, stop)
    chunks = list(executor.iter_chunks(sub))
    if sum(c.n for c in chunks) != stop - start:
        raise GradalgError(f"rows {start}:{stop} gave {sum(c.n for c in chunks)} rows: the data must give "
                           "one row per example")
    out = concat_chunks(chunks)
    check_row_ids(out.ids, node.ids[start:stop], f"rows {start}:{stop}")
    return out


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
