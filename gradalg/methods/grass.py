"""GraSS and FactGraSS (Hu et al., "GraSS: Scalable data attribution with gradient
sparsification and sparse projection", 2025):

    GraSS      Φ(z) = SJLT(M ∇L(z))               random mask M, then a sparse JL map
    FactGraSS  Φ(z) = SJLT((M_out D)ᵀ (M_in A))    the mask applied to the factors

followed by the TRAK/LoGra-style influence in the k-dimensional space:

    S_qz = Φ(q)ᵀ (Φᵀ Φ / n + λI)⁻¹ Φ(z)       (Gauss-Newton features when available)
"""
from __future__ import annotations

from .. import proj
from ..api import Scores, fisher, grads
from ..task import Task
from .influence import gauss_newton_objective


def grass(task: Task, train, queries, *, layers=None, k: int = 256, seed: int = 0, damping: float = 1e-3,
          factored: bool = True) -> Scores:
    """(Fact)GraSS influence scores with ``k`` coordinates per layer."""
    P = proj.factgrass(k, seed) if factored else proj.grass(k, seed)
    G, Q = P(grads(task, train, layers)), P(grads(task, queries, layers))
    C = P(grads(task, train, layers, objective=gauss_newton_objective(task), seed=seed))
    return Q @ fisher(C, structure="block").damp(damping).inv() @ G.T
