"""RelatIF (Barshan et al., "RelatIF: Identifying explanatory training examples via
relative influence", AISTATS 2020):

    S_qz = ∇L(q)ᵀ H⁻¹ ∇L(z) / √(∇L(z)ᵀ H⁻¹ ∇L(z))

influence divided by the square root of the training example's self-influence, which
stops a few high-loss, high-gradient outliers from dominating every query.
"""
from __future__ import annotations

from ..api import Operator, Scores, grads
from ..expr.projection import Projector, check_projector
from ..task import Task
from .influence import curvature_operator, damping_rule
from .registry import method


@method('RelatIF: influence divided by √(self-influence) of the training example (Barshan et al. 2020)', cli=True)
def relatif(task: Task, train, queries, *, layers=None, projector: Projector | None = None,
            damping: float = 1e-3, weight_decay: float = 0.0, curvature="auto",
            solver: str = "direct", seed: int = 0, covariance_max_examples: int | None = None,
            lambda_max_examples: int | None = None) -> Scores:
    """``P(Q) @ H⁻¹ @ P(G).normalize(metric=H⁻¹).T``, H damped by λ + weight decay.

    damping : an absolute λ (1e-3), or ``"auto"`` / a ``ga.linalg.DampingRule``: λ_b per block
        from H's own spectrum (``ga.methods.influence``), the weight decay added to it.

    curvature : "auto" (default; ``ga.methods.influence``): the dense Gauss-Newton up to
        ``ga.options(dense_curvature_dim)`` (projected) coordinates, EK-FAC above; a name of
        ``ga.methods.influence``'s table; or an Operator H carrying its own knobs
        (``ga.ekfac(G, covariance_max_examples=m)``; :func:`~gradalg.methods.influence.curvature_operator`).
    seed : of sampled labels / Arnoldi, for a named curvature.
    covariance_max_examples / lambda_max_examples : K-FAC / EK-FAC statistics on the first m
    training examples (``ga.methods.influence``), for a named curvature."""
    G, Q = grads(task, train, layers), grads(task, queries, layers)
    if projector is not None:
        G, Q = check_projector(projector)(G), projector(Q)
    named = {} if isinstance(curvature, Operator) else {"seed": seed}
    Hinv = curvature_operator(task, train, layers=layers, projector=projector, curvature=curvature,
                              solver=solver,
                              **({"damping": damping, "weight_decay": weight_decay or None}
                                 if damping_rule(damping) is not None else {"damping": damping + weight_decay}),
                              covariance_max_examples=covariance_max_examples,
                              lambda_max_examples=lambda_max_examples, **named)
    return Q @ Hinv @ G.normalize(metric=Hinv).T
