"""Influence functions (Koh & Liang, "Understanding black-box predictions via influence
functions", ICML 2017):

    S_qz = ∇L(q)ᵀ (H + (λ + wd) I)⁻¹ ∇L(z)

the first-order change of the query's loss when z is removed (up to 1/n); positive
means z helped q. ``H`` is the curvature of the training objective, ``wd`` its weight
decay and λ extra damping. ``curvature`` picks H, ``solver`` how it is inverted:

=================  ===========================================================  =====================
curvature          H                                                             solvers
=================  ===========================================================  =====================
``gauss_newton``   Gauss-Newton = true Fisher (default): exact from the task's   direct, cg, lissa,
                   ``expected_terms`` (small output spaces), else sampled labels arnoldi
``empirical``      empirical Fisher (1/n) Σ ∇L(z)∇L(z)ᵀ of the true labels        direct
``hessian``        (1/n) Σ ∇²L(z), through Hessian-vector products (torch.func)  cg, lissa, arnoldi
``kfac``/``ekfac`` Kronecker-factored Gauss-Newton (Martens & Grosse 2015;        direct
                   George et al. 2018; Grosse et al. 2023)
``datainf``        DataInf's averaged Sherman-Morrison inverse (Kwon et al. 2024) direct
=================  ===========================================================  =====================

``direct`` forms H explicitly (dense, in the projected space when a ``projector`` is
given: the LoGra / TRAK recipe) and inverts it by eigendecomposition. The iterative
solvers never form H: each step is one pass over the curvature data (Agarwal et al.
2017 for LiSSA; Schioppa et al. 2022 for Arnoldi).

Measured on a small MLP (see docs/fidelity.md) the empirical Fisher loses LDS against
the Gauss-Newton curvature, which is why Gauss-Newton is the default.
"""
from __future__ import annotations

from ..api import (Scores, arnoldi, datainf, fisher, gauss_newton, grads, hessian, kfac)
from ..expr.projection import Projector
from ..task import Task

CURVATURES = ("gauss_newton", "empirical", "hessian", "kfac", "ekfac", "datainf")
SOLVERS = ("direct", "cg", "lissa", "arnoldi")


def gauss_newton_objective(task: Task) -> str:
    """The gradient objective whose Fisher is the task's Gauss-Newton matrix.

    ``task.curvature_objective`` decides when set: language-model tasks
    (``ga.tasks.causal_lm`` …) set "sampled", since one exact term per vocabulary entry
    ("expected", the classification default) is infeasible for V ≈ 50k. Otherwise
    "expected" when the task has ``expected_terms``, else "sampled". The choice shows in
    the plan (``S.explain()``) as the objective of the curvature's gradients.
    """
    if task.curvature_objective is not None:
        return task.curvature_objective
    if task.expected_terms is not None:
        return "expected"
    if task.sampled_loss is not None:
        return "sampled"
    raise ValueError("a Gauss-Newton curvature needs Task(..., expected_terms=...) or "
                     "Task(..., sampled_loss=...) (ga.tasks.classification provides both), or use "
                     "curvature='empirical' / 'hessian'")


def curvature_operator(task: Task, data, *, layers=None, projector: Projector | None = None,
                       curvature: str = "gauss_newton", solver: str = "direct", damping: float = 1e-3,
                       structure: str = "dense", rank: int = 32, seed: int = 0, solver_settings=None,
                       train_grads=None):
    """(H + λI)⁻¹ as a lazy Operator, for every curvature/solver pair in the table above."""
    if curvature not in CURVATURES:
        raise ValueError(f"curvature must be one of {CURVATURES}, got {curvature!r}")
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    settings = dict(solver_settings or {})
    P = projector if projector is not None else (lambda G: G)
    if curvature == "datainf":
        G = train_grads if train_grads is not None else P(grads(task, data, layers))
        return datainf(G, damping)
    if curvature in ("hessian",) or (curvature == "gauss_newton" and solver != "direct"):
        if projector is not None:
            raise ValueError(f"curvature={curvature!r} with solver={solver!r} works in parameter "
                             "coordinates: drop the projector, or use solver='direct'")
        if curvature == "hessian" and solver == "direct":
            solver = "cg"
        H = (hessian if curvature == "hessian" else gauss_newton)(task, data, layers)
        if solver == "arnoldi":
            return arnoldi(H, rank, seed=seed).damp(damping).inv()
        return H.damp(damping).inv(method=solver, **settings)
    if solver != "direct":
        raise ValueError(f"curvature={curvature!r} is formed explicitly: use solver='direct'")
    objective = "loss" if curvature == "empirical" else gauss_newton_objective(task)
    C = P(grads(task, data, layers, objective=objective, seed=seed))
    if curvature in ("kfac", "ekfac"):
        return kfac(C, eigen_correction=curvature == "ekfac").damp(damping).inv()
    return fisher(C, structure=structure).damp(damping).inv()


def influence(task: Task, train, queries, *, layers=None, projector: Projector | None = None,
              damping: float = 1e-3, weight_decay: float = 0.0, curvature: str = "gauss_newton",
              solver: str = "direct", structure: str = "dense", curvature_data=None, rank: int = 32,
              seed: int = 0, solver_settings: dict | None = None) -> Scores:
    """Influence-function scores ``P(Q) @ (H + (λ + wd)I)⁻¹ @ P(G).T``.

    curvature_data : examples H is estimated on (default: ``train``).
    weight_decay : the training objective's L2 coefficient (its Hessian is wd·I).
    rank : eigenvectors kept by ``solver="arnoldi"``.
    """
    G = grads(task, train, layers)
    Q = grads(task, queries, layers)
    if projector is not None:
        G, Q = projector(G), projector(Q)
    Hinv = curvature_operator(task, train if curvature_data is None else curvature_data, layers=layers,
                              projector=projector, curvature=curvature, solver=solver,
                              damping=damping + weight_decay, structure=structure, rank=rank, seed=seed,
                              solver_settings=solver_settings,
                              train_grads=G if curvature_data is None else None)
    return Q @ Hinv @ G.T
