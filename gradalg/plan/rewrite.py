"""Rewrites that the executor applies before running (each named; the planner issue
extends this into the staged optimizer).

``absorb_precondition``: ``Inner(Precondition(L, H), I, R)`` → ``Inner(L, H, R)`` (and the
mirror image), so that the executor may apply H to whichever side is smaller: H is
symmetric, so ⟨H L_i, R_j⟩ = ⟨L_i, H R_j⟩.
"""
from __future__ import annotations

from ..expr import Identity, Inner, Precondition, ScoreNode, ScoreSum

__all__ = ["simplify"]


def simplify(node: ScoreNode) -> ScoreNode:
    """Apply the rewrites until nothing changes."""
    if isinstance(node, ScoreSum):
        return ScoreSum(tuple(simplify(t) for t in node.terms), node.coefs)
    if isinstance(node, Inner) and isinstance(node.op, Identity):
        if isinstance(node.left, Precondition):
            return simplify(Inner(node.left.grads, node.left.op, node.right))
        if isinstance(node.right, Precondition):
            return simplify(Inner(node.left, node.right.op, node.right.grads))
    return node
