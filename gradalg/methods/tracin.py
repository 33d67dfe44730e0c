"""TracIn-CP (Pruthi et al., "Estimating training data influence by tracing gradient
descent", NeurIPS 2020):

    S_qz = Σ_c η_c ⟨∇L(q; θ_c), ∇L(z; θ_c)⟩

over saved checkpoints θ_c with the learning rate η_c in force there.
"""
from __future__ import annotations

from typing import Sequence

from ..api import Scores, grads, sum_scores
from ..expr.projection import Projector
from ..task import Task


def tracin(checkpoints: Sequence[Task], learning_rates: Sequence[float], train, queries, *, layers=None,
           projector: Projector | None = None, normalize: bool = False) -> Scores:
    """``Σ_c η_c · P(Q_c) @ P(G_c).T``; one Task per checkpoint (same architecture).

    normalize : use cosine similarities per checkpoint (as in TracIn's "TracInCP-cos").
    """
    checkpoints = list(checkpoints)
    if len(checkpoints) != len(learning_rates):
        raise ValueError(f"got {len(checkpoints)} checkpoints and {len(learning_rates)} learning rates")
    terms = []
    for task in checkpoints:
        G, Q = grads(task, train, layers), grads(task, queries, layers)
        if projector is not None:
            G, Q = projector(G), projector(Q)
        if normalize:
            G, Q = G.normalize(), Q.normalize()
        terms.append(Q @ G.T)
    return sum_scores(terms, learning_rates)
