"""Which named rules resolving an operator node will apply, from the expression alone.

:func:`resolution_rules` walks an operator node the way :mod:`gradalg.exec.resolve`
does, but on structure labels instead of numbers: each node's labels follow from its
type (a Fisher's structure, K-FAC's Kronecker form, products-only curvature, ...) and
each operation picks its rule with the same :func:`gradalg.linalg.rules.choose` /
:func:`~gradalg.linalg.rules.choose_sum` the operators use. So the list equals the
``rules`` of the resolved operator, and a refusal (a power of an operator known only
through products, damping DataInf, ...) is raised here, before any pass runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..expr import (KFAC, Arnoldi, CurvatureProducts, Damp, DataInf, Dense, Diagonal, Fisher, Identity, Inverse,
                    OpNode, Power, ScaledOp, SumOp)
from ..expr.spectral import Spectral
from ..expr.stored import StoredOp
from ..curvature.kron import diagonal_factor_rules
from ..linalg.rules import choose, choose_sum
from ..options import get_options

__all__ = ["resolution_rules", "operator_rules", "OperatorRules"]

_FORM = {"identity": "diagonal", "diag": "diagonal", "block": "block", "dense": "dense", "kron": "kronecker",
         "lowrank": "low-rank", "implicit": "implicit"}


def _leaf(node: OpNode):
    """(labels, rules, eigenbasis key) of a leaf."""
    if isinstance(node, Identity):
        return frozenset({"diagonal", "identity"}), [], None
    if isinstance(node, Diagonal):
        return frozenset({"diagonal"}), [], None
    if isinstance(node, Dense):
        return frozenset({"dense"}), [], None
    if isinstance(node, Fisher):
        return frozenset({_FORM[node.structure_]}), [], None
    if isinstance(node, KFAC):   # a vocabulary-wide factor kept diagonal: named (ga.options(kron_diagonal_width))
        rules = list(diagonal_factor_rules(node.space, get_options().kron_diagonal_width))
        return frozenset({"kronecker"}), rules, ("kfac", node.grads.token)
    if isinstance(node, CurvatureProducts):
        return frozenset({"implicit"}), [], None
    if isinstance(node, Arnoldi):
        _walk(node.op)   # its operand must resolve (refusals surface here)
        return frozenset({"low-rank"}), [], None
    if isinstance(node, DataInf):
        return frozenset({"implicit", "approximate-inverse"}), [], None
    if isinstance(node, StoredOp):   # a compiled operator knows its labels and rules; a Zarr one its form
        labels = getattr(node.store, "structure", None)
        labels = frozenset(labels) if labels is not None else frozenset({_FORM[node.structure_]})
        return labels - {"psd"}, list(getattr(node.store, "rules", ())), ("stored", node.token)
    raise TypeError(f"no resolution rules for operator {type(node).__name__}")


def _walk(node: OpNode):
    """(labels, rules, eigenbasis key) of ``node`` once resolved."""
    if isinstance(node, Damp):
        labels, rules, key = _walk(node.op)
        if node.relative:
            rules = rules + [choose("damp_relative", labels, what=node.op.label).name]
        return labels, rules + [choose("damp", labels, variant="exact", what=node.op.label).name], key
    if isinstance(node, Inverse):
        labels, rules, key = _walk(node.op)
        rule = choose("inverse", labels, variant=None if node.method == "auto" else node.method, what=node.op.label)
        if rule.name.startswith("implicit.solve"):
            labels = labels | {"inverse"}
        elif rule.name == "implicit.inverse_of_solve":
            labels = labels - {"inverse"}
        return labels, rules + [rule.name], key
    if isinstance(node, Power):
        if node.p == 1:
            return _walk(node.op)
        if node.p == -1:
            return _walk(Inverse(node.op))
        labels, rules, key = _walk(node.op)
        return labels, rules + [choose("power", labels, what=node.op.label).name], key
    if isinstance(node, Spectral):
        labels, rules, key = _walk(node.op)
        return labels - {"psd"}, rules + [choose("spectral", labels, what=node.op.label).name], key
    if isinstance(node, ScaledOp):
        labels, rules, key = _walk(node.op)
        return labels, rules + [choose("scale", labels).name], key
    if isinstance(node, SumOp):
        labels, rules, key = _walk(node.ops[0])
        for op in node.ops[1:]:
            other, other_rules, other_key = _walk(op)
            steps, result, _ = choose_sum(labels, other, same_eigenbasis=key is not None and key == other_key)
            identity = "identity" in labels and "identity" in other
            labels = result | ({"identity"} if identity else set())
            key = (key if key is not None else other_key) if "kronecker" in result else None
            rules = rules + other_rules + steps
        return labels, rules, key
    return _leaf(node)


def resolution_rules(node: OpNode) -> list[str]:
    """The names of the rules (:mod:`gradalg.linalg.rules`) that resolving ``node`` applies,
    in order, without reading data; raises the refusal of an operation the structure
    cannot do exactly."""
    if hasattr(node, "expr"):   # an ga.Operator
        node = node.expr
    return _walk(node)[1]


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
    from ..errors import OperatorError

    out: dict[str, OperatorRules] = {}
    for x in root.walk():
        if isinstance(x, OpNode):
            continue
        for op in x.children:
            if not isinstance(op, OpNode) or isinstance(op, Identity) or op.token in out:
                continue
            try:
                out[op.token] = OperatorRules(op, tuple(resolution_rules(op)))
            except OperatorError as err:
                out[op.token] = OperatorRules(op, (), str(err))
    return list(out.values())
