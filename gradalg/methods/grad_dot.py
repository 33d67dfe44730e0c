"""Grad-Dot and Grad-Cos.

Grad-Dot (Charpiat et al., "Input similarity from the neural network perspective",
NeurIPS 2019):   S_qz = ⟨∇_θ L(q), ∇_θ L(z)⟩

Grad-Cos (same paper; used by Pruthi et al. 2020 and LESS):
                 S_qz = ⟨∇L(q), ∇L(z)⟩ / (‖∇L(q)‖ ‖∇L(z)‖)
"""
from __future__ import annotations

from ..api import Scores, grads
from ..expr.projection import Projector, check_projector
from ..task import Task
from .registry import method


def _sides(task, train, queries, layers, projector):
    G = grads(task, train, layers)
    Q = grads(task, queries, layers)
    if projector is not None:
        G, Q = check_projector(projector)(G), projector(Q)
    return Q, G


@method('Grad-Dot: ⟨∇L(q), ∇L(z)⟩ (Charpiat et al. 2019)', cli=True)
def grad_dot(task: Task, train, queries, *, layers=None, projector: Projector | None = None,
             query_gradient_rank: int | None = None) -> Scores:
    """``Q @ G.T``: inner products of query and training gradients (optionally projected).

    query_gradient_rank : None (default) exact; r: each query's (out, in) blocks replaced by
        their best rank-r approximation, ``Q.low_rank(r) @ G.T`` (:mod:`gradalg.expr.lowrank`).
    """
    Q, G = _sides(task, train, queries, layers, projector)
    if query_gradient_rank is not None:
        Q = Q.low_rank(query_gradient_rank)
    return Q @ G.T


@method('Grad-Cos: cosine of ∇L(q) and ∇L(z) (Charpiat et al. 2019; Pruthi et al. 2020)', cli=True)
def grad_cos(task: Task, train, queries, *, layers=None, projector: Projector | None = None) -> Scores:
    """``Q.normalize() @ G.normalize().T``: cosine similarity of gradients."""
    Q, G = _sides(task, train, queries, layers, projector)
    return Q.normalize() @ G.normalize().T
