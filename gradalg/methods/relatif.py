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
from ..linalg.labels import form_of
from .influence import ABSOLUTE_DAMPING, curvature_operator, damping_rule
from .registry import method


#: the default damping (issue 31): ``"auto"`` where H is explicit, chosen by
#: benchmarks/defaults_suite.py across the nine fidelity settings (docs/fidelity.md)
DEFAULT_DAMPING = "auto"


def _has_spectrum(curvature, solver: str) -> bool:
    """Whether the default ``"auto"`` can read H's spectrum: a direct solver on a named explicit
    curvature, or an explicit (not products-only / low-rank / inverse) Operator."""
    if isinstance(curvature, Operator):
        labels = curvature.expr.labels()
        return solver == "direct" and form_of(labels.labels) not in ("implicit", "low-rank") and not (
            {"inverse", "approximate-inverse"} & labels.labels)
    return solver == "direct" and curvature not in ("datainf", "hessian")


@method('RelatIF: influence divided by √(self-influence) of the training example (Barshan et al. 2020)', cli=True)
def relatif(task: Task, train, queries, *, layers=None, projector: Projector | None = None,
            damping=DEFAULT_DAMPING, weight_decay: float = 0.0, curvature="auto",
            solver: str = "direct", seed: int = 0, covariance_max_examples: int | None = None,
            lambda_max_examples: int | None = None) -> Scores:
    """``P(Q) @ H⁻¹ @ P(G).normalize(metric=H⁻¹).T``, H damped by λ + weight decay.

    damping : default ``"auto"`` (issue 31): λ_b per block from H's own spectrum
        (``ga.methods.influence``'s ``damping="auto"``; shown in the plan), the weight decay
        added to it; where H has no spectrum (an iterative solver, DataInf, a products-only or
        low-rank Operator) the absolute 1e-3 (:data:`~gradalg.methods.influence.ABSOLUTE_DAMPING`).
        Chosen by issue 31's rule (best worst case, then mean, LDS across the nine fidelity
        settings, never worse than the previous default by more than its bootstrap interval;
        ``benchmarks/defaults_suite.py``, docs/fidelity.md): worst / mean 0.319 / 0.451 against
        0.289 / 0.450 for the previous absolute 1e-3 (worst on the conv net; the text LMs favour
        1e-3 by 0.02–0.03, inside its intervals). A number: an absolute λ (1e-3 gives the
        previous default); a ``ga.linalg.DampingRule``: another rule.

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
    if damping is DEFAULT_DAMPING and not _has_spectrum(curvature, solver):
        damping = ABSOLUTE_DAMPING
    Hinv = curvature_operator(task, train, layers=layers, projector=projector, curvature=curvature,
                              solver=solver,
                              **({"damping": damping, "weight_decay": weight_decay or None}
                                 if damping_rule(damping) is not None else {"damping": damping + weight_decay}),
                              covariance_max_examples=covariance_max_examples,
                              lambda_max_examples=lambda_max_examples, **named)
    return Q @ Hinv @ G.normalize(metric=Hinv).T
