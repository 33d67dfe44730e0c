"""Influence functions (Koh & Liang, "Understanding black-box predictions via influence
functions", ICML 2017):

    S_qz = ∇L(q)ᵀ (H + λI)⁻¹ ∇L(z)

the first-order change of the query's loss when z is removed (up to 1/n). ``H`` is the
curvature of the training objective:

* ``"gauss_newton"`` (default when the task has ``sampled_loss``): the true Fisher
  E_{x} E_{ŷ~p(·|x)} ∇ log p(ŷ|x) ∇ log p(ŷ|x)ᵀ, which equals the Gauss-Newton matrix
  for cross-entropy (Martens 2020). Estimated from gradients of sampled labels.
* ``"empirical"``: the empirical Fisher (1/n) Σ ∇L(z)∇L(z)ᵀ of the true labels.

With a ``projector`` everything lives in the projected space, where a dense H is small
(the LoGra / TRAK recipe); without one H is dense over the captured layers, which only
fits small models (use ``structure="block"`` for a per-layer approximation).
"""
from __future__ import annotations

from ..api import Scores, fisher, grads
from ..expr.projection import Projector
from ..task import Task


def influence(task: Task, train, queries, *, layers=None, projector: Projector | None = None,
              damping: float = 1e-3, curvature: str | None = None, structure: str = "dense",
              curvature_data=None, seed: int = 0) -> Scores:
    """Influence-function scores ``P(Q) @ (H + λI)⁻¹ @ P(G).T``.

    curvature : "gauss_newton" or "empirical" (default: gauss_newton when
        ``task.sampled_loss`` exists, else empirical).
    curvature_data : examples H is estimated on (default: ``train``).
    """
    if curvature is None:
        curvature = "gauss_newton" if task.sampled_loss is not None else "empirical"
    if curvature not in ("gauss_newton", "empirical"):
        raise ValueError(f"curvature must be 'gauss_newton' or 'empirical', got {curvature!r}")
    objective = "sampled" if curvature == "gauss_newton" else "loss"
    G = grads(task, train, layers)
    Q = grads(task, queries, layers)
    C = grads(task, train if curvature_data is None else curvature_data, layers, objective=objective, seed=seed)
    if projector is not None:
        G, Q, C = projector(G), projector(Q), projector(C)
    H = fisher(C, structure=structure).damp(damping)
    return Q @ H.inv() @ G.T
