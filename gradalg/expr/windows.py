"""Rows a:b of a gradient expression, as an expression of their own (a *window*).

A row-wise node is computed chunk by chunk from its input (:class:`~gradalg.expr.RowWise`),
so rows a:b of it are the same chain over rows a:b of its *stream root* (the node a pass
iterates: a Source or a stored / captured leaf). :func:`restrict_rows` rebuilds that chain
over rows a:b of the root: a Source (through :meth:`gradalg.expr.GradNode.restrict`) or
a gradient store. Operators are left alone, even one computed from the same dataset: a
Fisher of the training set preconditioning the training rows stays the Fisher of all of
them. Each window is planned and run like any gradient node (the executor's
``window``; a store chunk, DataInf's training rows applied outside a planned pass).

:func:`freeze_ops` replaces the operators of a chain by leaves holding their resolved
numbers, computed once, so the windows (on this process or on Dask workers) never
resolve them again.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import OptionError
from .grads import GradNode, Normalize, Precondition, RowWise, Source
from .stored import Stored, StoredOp

__all__ = ["chain", "stream_root", "restrictable", "by_examples", "restrict_rows", "freeze_ops", "ResolvedStore"]


def chain(node: GradNode):
    """``node``, then each row-wise node's input in turn, ending with the stream root: the
    nodes a pass derives, chunk by chunk, from the chunks it iterates."""
    yield node
    while isinstance(node, RowWise):
        node = node.grads
        yield node


def stream_root(node: GradNode) -> GradNode:
    """The node whose chunks a pass iterates to produce ``node`` row by row."""
    *_, root = chain(node)
    return root


def restrictable(node: GradNode) -> bool:
    """Whether rows a:b of ``node`` can be computed alone (a chain over a Source or a store)."""
    root = stream_root(node)
    return isinstance(root, Source) or (isinstance(root, Stored) and hasattr(root.store, "rows"))


def by_examples(node: GradNode) -> bool:
    """Whether ``node``'s rows can be read in windows of examples: :func:`restrictable`,
    and one row per example (``objective="expected"`` gives one per Gauss-Newton term)."""
    root = stream_root(node)
    return restrictable(node) and not (isinstance(root, Source) and root.objective == "expected")


def _with_root(node: GradNode, root: GradNode) -> GradNode:
    if isinstance(node, RowWise):
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


def freeze_ops(resolve, node: GradNode, memo: dict | None = None) -> GradNode:
    """``node`` with the operators of its row chain replaced by their resolved numbers
    (``resolve(op)``, an executor's ``operator``: once per operator, ``memo`` {token: leaf})."""
    memo = {} if memo is None else memo

    def op_leaf(op):
        if op.token not in memo:
            memo[op.token] = StoredOp(ResolvedStore(resolve(op), op.token, op.label), op.space,
                                      op.structure)
        return memo[op.token]

    return _frozen(node, op_leaf)


def _frozen(x: GradNode, op_leaf) -> GradNode:
    """The row chain of ``x`` with each operator ``op`` replaced by ``op_leaf(op)``. (A
    module function: a recursive closure's cell holds the closure, a cycle that kept
    ``op_leaf``, the executor's ``resolve`` and its run state for the cyclic GC.)"""
    if not isinstance(x, RowWise):
        return x
    changes = {"grads": _frozen(x.grads, op_leaf)}
    if isinstance(x, Precondition) or (isinstance(x, Normalize) and x.op is not None):
        changes["op"] = op_leaf(x.op)
    return replace(x, **changes)
