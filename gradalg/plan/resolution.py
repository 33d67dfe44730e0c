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
    return list(getattr(node, "expr", node).labels().rules)     # a ga.Operator's expression, or the node


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
    ops = {op.token: op for x in root.walk() if not isinstance(x, OpNode)
           for op in x.children if isinstance(op, OpNode) and not op.is_identity}    # equal tokens: equal operators
    out = []
    for op in ops.values():
        try:
            out.append(OperatorRules(op, tuple(resolution_rules(op))))
        except OperatorError as err:
            out.append(OperatorRules(op, (), str(err)))
    return out
