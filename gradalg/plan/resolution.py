"""Which named rules resolving an operator node will apply, from the expression alone.

Each operator node knows its structure once resolved, in labels
(:meth:`~gradalg.expr.operators.OpNode.labels`, a :class:`~gradalg.linalg.Labels`): each
operation on them picks its rule with the same :func:`gradalg.linalg.rules.choose` /
:func:`~gradalg.linalg.rules.choose_sum` the resolved operators use. So the list equals
the ``rules`` of the resolved operator, and a refusal (a power of an operator known only
through products, damping DataInf, ...) is raised here, before any pass runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import OperatorError
from ..expr import OpNode

__all__ = ["resolution_rules", "operator_rules", "OperatorRules"]


def resolution_rules(node: OpNode) -> list[str]:
    """The names of the rules (:mod:`gradalg.linalg.rules`) that resolving ``node`` applies,
    in order, without reading data; raises the refusal of an operation the structure
    cannot do exactly."""
    if hasattr(node, "expr"):   # an ga.Operator
        node = node.expr
    return list(node.labels().rules)


@dataclass(frozen=True)
class OperatorRules:
    """The rules resolving one operator of an expression will apply (``refusal``: the
    :class:`~gradalg.errors.OperatorError` message instead, when its structure cannot)."""

    op: OpNode
    rules: tuple[str, ...]
    refusal: str | None = None


def operator_rules(root) -> list[OperatorRules]:
    """The resolution rules of every operator ``root`` uses (an inner product's, a
    preconditioner's, a metric's), each operator once, in tree order, without data; a
    refused one carries its refusal. For ``explain()``."""
    out: dict[str, OperatorRules] = {}
    for x in root.walk():
        if isinstance(x, OpNode):
            continue
        for op in x.children:
            if not isinstance(op, OpNode) or op.is_identity or op.token in out:
                continue
            try:
                out[op.token] = OperatorRules(op, tuple(resolution_rules(op)))
            except OperatorError as err:
                out[op.token] = OperatorRules(op, (), str(err))
    return list(out.values())
