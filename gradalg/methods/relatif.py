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
from ..linalg.autodamp import DampingRule
from ..linalg.labels import form_of
from .influence import (ABSOLUTE_DAMPING, DENSE_HESSIAN_DAMPING, curvature_operator, damping_rule,
                        resolve_curvature)
from .registry import method


class _DefaultDamping(str):
    """The default's marker: equal to ``"auto"``, told apart from a given ``damping="auto"``
    by identity (the default depends on H's form; a given ``"auto"`` is influence's rule)."""


#: the default damping (issue 31), chosen by benchmarks/defaults_suite.py across the nine
#: fidelity settings (docs/fidelity.md): ``"auto"``'s per-block rule where H is block-diagonal
#: (K-FAC / EK-FAC, a block Fisher), one λ from the pooled spectrum where H is dense
#: (:data:`DENSE_DAMPING`), the absolute 1e-3 where H has no spectrum
DEFAULT_DAMPING = _DefaultDamping("auto")
#: what ``curvature="auto"`` takes for RelatIF up to ``ga.options(dense_curvature_dim)`` coordinates: the
#: dense Gauss-Newton, where :data:`DENSE_DAMPING` was chosen. Influence's near-minimum rule
#: (``"near_minimum"``, each side at RelatIF's default for it) was measured on the six dense settings
#: (session 43, the table in :func:`relatif`'s docstring): worst 0.357 = 0.357, mean 0.471 against 0.470,
#: every setting within ±0.009 (inside its interval), at 2–26× the cost where it forms the Hessian:
#: not adopted; ``curvature="near_minimum"`` gives it
DENSE_AUTO = "gauss_newton"
#: the default λ of a dense H: the eigenvalue where H's largest eigenvalues hold 0.95 of its
#: trace, one λ for all blocks (a dense H couples its blocks: per block from its diagonal
#: blocks scored 0.319 on the conv net, one λ 0.356)
DENSE_DAMPING = DampingRule("mass", 0.95, per_block=False, note="RelatIF's default for a dense H (issue 31)")


def _resolved(curvature, solver: str, dim: int, projected: bool, task: Task):
    """The curvature ``curvature="auto"`` takes here (``resolve_curvature`` with :data:`DENSE_AUTO`,
    as :func:`~gradalg.methods.influence.curvature_operator` resolves it); a name or Operator as given."""
    if isinstance(curvature, str) and curvature == "auto":
        return resolve_curvature("auto", solver, dim, dense=DENSE_AUTO, projected=projected, task=task)[0]
    return curvature


def _dense(curvature, solver: str) -> bool:
    """Whether H is formed dense: the Gauss-Newton / empirical Fisher by the direct solver
    (``curvature="auto"`` up to ``ga.options(dense_curvature_dim)`` coordinates, resolved by
    :func:`_resolved`), or a dense Operator."""
    if solver != "direct":
        return False
    if isinstance(curvature, Operator):
        return form_of(curvature.expr.labels().labels) == "dense"
    return curvature in ("gauss_newton", "empirical")


def default_damping(curvature, solver: str):
    """``(damping, gauss_newton_damping)`` of RelatIF's default for the resolved ``curvature``:
    ``"near_minimum"``: :data:`~gradalg.methods.influence.DENSE_HESSIAN_DAMPING` on the formed
    Hessian's side, :data:`DENSE_DAMPING` on the Gauss-Newton's; the formed Hessian:
    DENSE_HESSIAN_DAMPING; another dense H: :data:`DENSE_DAMPING`; a block-diagonal explicit H
    (K-FAC / EK-FAC, a block Fisher): ``"auto"`` per block; no spectrum: the absolute
    :data:`~gradalg.methods.influence.ABSOLUTE_DAMPING` (second entry None: no Gauss-Newton side)."""
    if isinstance(curvature, str) and curvature == "near_minimum":
        return DENSE_HESSIAN_DAMPING, DENSE_DAMPING
    return (ABSOLUTE_DAMPING if not _has_spectrum(curvature, solver) else
            DENSE_HESSIAN_DAMPING if isinstance(curvature, str) and curvature == "dense_hessian" else  # shifted to PSD
            DENSE_DAMPING if _dense(curvature, solver) else "auto"), None


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

    damping : default (issue 31) read from H's own spectrum, shown in the plan with the weight
        decay added to it: where H is block-diagonal (K-FAC / EK-FAC, the LMs' default) λ_b per
        block, ``ga.methods.influence``'s ``damping="auto"``; where H is dense (the dense
        Gauss-Newton, ``curvature="auto"`` on a small model) one λ from its pooled spectrum,
        :data:`DENSE_DAMPING` (a dense H couples its blocks); where H has no spectrum (an
        iterative solver, DataInf, a products-only or low-rank Operator) the absolute 1e-3
        (:data:`~gradalg.methods.influence.ABSOLUTE_DAMPING`). Chosen by issue 31's rule (best
        worst case, then mean, LDS across the nine fidelity settings, never worse than the
        previous default by more than its bootstrap interval; ``benchmarks/defaults_suite.py``,
        docs/fidelity.md "How the defaults were chosen"):

        ================================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====
        damping                           logreg  mlp    lm     lm2    text   instruct  llama  conv   seqcls  worst  mean
        ================================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====
        1e-3 (before issue 31)            0.642   0.484  0.395  0.473  0.375  0.506     0.490  0.289  0.393   0.289  0.450
        ``"auto"`` (per block everywhere)  0.653   0.507  0.395  0.461  0.354  0.477     0.490  0.319  0.406   0.319  0.451
        per block / pooled if dense       0.653   0.518  0.395  0.461  0.354  0.477     0.490  0.356  0.406   0.354  0.457
        ================================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====

        (the text LMs favour 1e-3 by 0.02–0.03, inside its intervals; the LM columns are at the
        block-only layers: at the language tasks' default layers since 2026-12-06, with a small
        vocabulary's embedding/head, ``text`` / ``instruct`` / ``llama`` score 0.667 / 0.707 /
        0.491). ``"auto"`` given: per block on every explicit H; a number: an absolute λ (1e-3 gives the default before issue
        31); a ``ga.linalg.DampingRule``: another rule. With ``curvature="near_minimum"`` the default
        damps each side by its own rule (:func:`default_damping`): the formed Hessian (+ decay) shifted
        to PSD + 0.3 × its mean eigenvalue (``influence.DENSE_HESSIAN_DAMPING``), the Gauss-Newton
        :data:`DENSE_DAMPING`; a given damping applies to both sides, the weight decay kept a term
        (the rule tests −μ_min(H̄ + decay)).

    curvature : "auto" (default; ``ga.methods.influence``): the dense Gauss-Newton up to
        ``ga.options(dense_curvature_dim)`` (projected) coordinates (:data:`DENSE_AUTO`), EK-FAC above; a
        name of ``ga.methods.influence``'s table, ``"near_minimum"`` included; or an Operator H carrying
        its own knobs (``ga.ekfac(G, covariance_max_examples=m)``; :func:`~gradalg.methods.influence.curvature_operator`).
        Influence's dense choice, the formed Hessian where the model is near a minimum (``"near_minimum"``),
        against the dense Gauss-Newton on the six dense settings (session 43; ``benchmarks/defaults_suite.py``,
        docs/fidelity.md "RelatIF under the near-minimum rule"), LDS at RelatIF's default damping:

        ===========================  ======  =====  =====  ========  ========  =======  =====  =====
        dense curvature              logreg  mlp    conv   mlp_gelu  mlp_adam  conv_wd  worst  mean
        ===========================  ======  =====  =====  ========  ========  =======  =====  =====
        Gauss-Newton (the default)   0.653   0.518  0.357  0.427     0.443     0.421    0.357  0.470
        near a minimum               0.645   0.527  0.357  0.426     0.443     0.429    0.357  0.471
        ===========================  ======  =====  =====  ========  ========  =======  =====  =====

        (the rule took the Hessian on logreg, mlp, mlp_gelu, conv_wd; every difference within ±0.009,
        inside the intervals; 2–26× the Gauss-Newton's seconds where the Hessian is formed: kept the
        Gauss-Newton.)
    seed : of sampled labels / Arnoldi, for a named curvature.
    covariance_max_examples / lambda_max_examples : K-FAC / EK-FAC statistics on the first m
    training examples (``ga.methods.influence``), for a named curvature."""
    G, Q = grads(task, train, layers), grads(task, queries, layers)
    if projector is not None:
        G, Q = check_projector(projector)(G), projector(Q)
    named = {} if isinstance(curvature, Operator) else {"seed": seed}
    resolved, gauss_newton_damping = _resolved(curvature, solver, G.space.dim, projector is not None, task), None
    if damping is DEFAULT_DAMPING:
        damping, gauss_newton_damping = default_damping(resolved, solver)
    # the near-minimum rule tests −μ_min(H̄ + decay) and shifts H̄ + decay to PSD: the decay stays a term
    separate = damping_rule(damping) is not None or (isinstance(resolved, str) and resolved == "near_minimum")
    Hinv = curvature_operator(task, train, layers=layers, projector=projector, curvature=curvature,
                              solver=solver, dense_auto=DENSE_AUTO, gauss_newton_damping=gauss_newton_damping,
                              **({"damping": damping, "weight_decay": weight_decay or None}
                                 if separate else {"damping": damping + weight_decay}),
                              covariance_max_examples=covariance_max_examples,
                              lambda_max_examples=lambda_max_examples, **named)
    return Q @ Hinv @ G.normalize(metric=Hinv).T
