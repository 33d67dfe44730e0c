"""Influence functions (Koh & Liang, "Understanding black-box predictions via influence
functions", ICML 2017):

    S_qz = ∇L(q)ᵀ (H + (λ + wd) I)⁻¹ ∇L(z)

the first-order change of the query's loss when z is removed (up to 1/n); positive
means z helped q. ``H`` is the curvature of the training objective, ``wd`` its weight
decay and λ extra damping. ``curvature`` picks H, ``solver`` how it is inverted:

=================  ===========================================================  =====================
curvature          H                                                             solvers
=================  ===========================================================  =====================
``auto``           (default) ``gauss_newton`` up to ``ga.options(dense_curvature_dim)``  as those
                   (projected) coordinates with the direct solver, ``ekfac`` above
``gauss_newton``   Gauss-Newton = true Fisher: exact from the task's             direct, cg, lissa,
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
the Gauss-Newton curvature, which is why Gauss-Newton is the default where a dense H fits.
At width a dense H cannot exist (GPT-2 small's 85 M block coordinates: 58 PB), so the
default ``curvature="auto"`` takes EK-FAC above ``ga.options(dense_curvature_dim)``
coordinates (16,384 by default), as Kronfluence does for every model; with an iterative
solver it is the Gauss-Newton through products, which never forms H. The plan names the
choice in the damping's note.

Damping and weight decay (shown in the plan, each ``damp`` with where it came from):

* λ, default ``relative_damping`` × the mean eigenvalue tr(H)/dim of H (Kronfluence's
  heuristic, scale-free) wherever H is explicit: the direct solver's dense / block Fisher
  (factor 1), K-FAC and EK-FAC (the mean of the eigenvalue matrices; factor 0.1, Kronfluence's),
  each factor measured (:data:`RELATIVE_DAMPING`). Operators known only through
  products (CG, LiSSA, Arnoldi) and DataInf have no cheap spectrum: there the default is
  the absolute :data:`ABSOLUTE_DAMPING`. ``damping=`` gives an absolute λ instead.
* the objective's weight decay, from ``weight_decay=`` or read from ``optimizer=`` (a torch
  optimizer or a transformers Trainer, :mod:`gradalg.objective`): wd·I for coupled decay
  (SGD, Adam), wd_j per coordinate where param groups differ, wd·diag(√v̂ + ε) for AdamW's
  decoupled decay. A per-coordinate term is added exactly to an explicit or product-only H
  in parameter coordinates; after a projection, to K-FAC or to DataInf only a uniform wd
  has a form (wd·I in the projected coordinates, the projected-influence convention), and
  the rest is refused with :class:`~gradalg.objective.ObjectiveError`.

Data weight (``data_weight=c``; default 1). The objective is taken to be

    J(θ; ε) = (1/n) Σ_i ε_i ℓ_i(θ) + R(θ),   R'' = the weight-decay term,

and the scores are −n ∂f_q/∂ε_i at ε = c·1 (every example at weight c), for a model
trained at that point (a sum-normalised objective with its data term scaled by c, i.e.
the same training with weight decay wd/c):

    S_qz = (1/c) ∇f_qᵀ (H̄ + λI + R''/c)⁻¹ ∇ℓ_z,   H̄ = (1/n) Σ ∇²ℓ_i,

the damping λ added to H̄ as usual. c = α, the kept fraction of retraining on random
α-subsets, linearises at the mean of those counterfactuals (E[1_S] = α·1) instead of at
the full set. For subsets keeping each example with probability α, the least-squares
linear fit of a quadratic f(ε) has coefficients ∂f/∂ε_i(α·1) + ½(1 − 2α) ∂²f/∂ε_i²: the
gradient at the centre (exactly so at α = ½), where the gradient at ε = 1 is off by every
second-order term, Σ_j ∂²f/∂ε_i∂ε_j (1 − α). A recipe, not a default: it needs the
model trained at ε = c·1 (docs/user_guide.md, "Linearise at the counterfactuals' centre";
measured in docs/fidelity.md). For an objective normalised by the number of kept examples
(a mean loss, mini-batch means) uniform weights cancel and the full model already is the
centre: leave c = 1 there.
"""
from __future__ import annotations

import torch

from ..api import (Operator, Scores, arnoldi, datainf, diagonal, fisher, gauss_newton, grads, hessian, kfac)
from ..expr.projection import Projector, check_projector
from ..objective import DecayTerm, ObjectiveError, training_objective
from ..options import get_options
from ..task import Task
from ..errors import OptionError

CURVATURES = ("auto", "gauss_newton", "empirical", "hessian", "kfac", "ekfac", "datainf")
SOLVERS = ("direct", "cg", "lissa", "arnoldi")
#: default λ / mean eigenvalue of an explicit H, per curvature, measured on the digits MLP
#: (benchmarks/damping_defaults.py, LDS, 50 subsets; docs/user_guide.md "Defaults from the
#: objective"): the dense Gauss-Newton / Fisher 0.726 at 0.1, 0.817 at 0.5, 0.829 at 1;
#: EK-FAC 0.745 at 0.1 (Kronfluence's factor), 0.714 at 0.5, 0.691 at 1; K-FAC 0.753 at 0.1
#: (the old absolute 1e-3: Gauss-Newton 0.818, EK-FAC 0.713, K-FAC 0.722).
RELATIVE_DAMPING = {"gauss_newton": 1.0, "empirical": 1.0, "kfac": 0.1, "ekfac": 0.1}
ABSOLUTE_DAMPING = 1e-3   # default λ where H's spectrum is not at hand (CG, LiSSA, Arnoldi, DataInf)


def check_kron_subsets(curvature: str, covariance_max_examples, lambda_max_examples) -> None:
    """Refuse ``covariance_max_examples`` / ``lambda_max_examples`` (K-FAC / EK-FAC statistics
    on the first m examples, :func:`gradalg.kfac`) with a curvature that has no such
    statistics, and ``lambda_max_examples`` with K-FAC (no eigenvalue correction)."""
    given = [name for name, v in (("covariance_max_examples", covariance_max_examples),
                                  ("lambda_max_examples", lambda_max_examples)) if v is not None]
    if given and curvature not in ("kfac", "ekfac"):
        raise OptionError(f"{given[0]} sets how many examples K-FAC / EK-FAC statistics are estimated on: "
                         f"it applies to curvature='kfac' or 'ekfac', not {curvature!r}. Drop it, or use "
                         "curvature='ekfac'")
    if lambda_max_examples is not None and curvature == "kfac":
        raise OptionError("lambda_max_examples is the number of examples of EK-FAC's eigenvalue correction: "
                         "use it with curvature='ekfac', or leave it None for K-FAC")


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
    raise OptionError("a Gauss-Newton curvature needs Task(..., expected_terms=...) or "
                     "Task(..., sampled_loss=...) (ga.tasks.classification provides both), or use "
                     "curvature='empirical' / 'hessian'")


def check_data_weight(data_weight) -> float:
    """``data_weight`` as a float, or a ValueError naming what a data weight is."""
    try:
        c = float(data_weight)
    except (TypeError, ValueError):
        raise OptionError(f"data_weight must be a number (the uniform weight c every training example had "
                         f"in the objective the model was trained on), got {data_weight!r}") from None
    if not (c > 0.0 and c < float("inf")):
        raise OptionError(f"data_weight must be positive and finite (c = α for a model trained at the mean "
                         f"of α-subsets; 1 for the full set), got {data_weight!r}")
    return c


def decay_term(weight_decay=None, optimizer=None, like=None) -> DecayTerm | None:
    """The objective's weight-decay curvature term in the coordinates of ``like``: from an
    explicit ``weight_decay`` (a number: wd·I), or read from ``optimizer`` (a torch optimizer
    or a transformers Trainer; see :mod:`gradalg.objective`). None when neither is given."""
    if weight_decay is not None and optimizer is not None:
        raise ObjectiveError("give weight_decay= or optimizer=, not both: the optimizer's param groups "
                             "already say the weight decay")
    if optimizer is not None:
        return training_objective(optimizer).decay_term(like)
    if weight_decay:
        return DecayTerm(float(weight_decay), None, f"weight_decay={float(weight_decay):g} (given)")
    return None


def resolve_curvature(curvature: str, solver: str, dim: int) -> tuple[str, str | None]:
    """``(curvature, note)``: ``"auto"`` made concrete for a space of ``dim`` (projected)
    coordinates, and the note the plan shows for it (None for a curvature given by name).

    ``"auto"``: ``"gauss_newton"`` through products with an iterative solver; with the direct
    solver ``"gauss_newton"`` (dense H) when ``dim ≤ ga.options(dense_curvature_dim)``, else
    ``"ekfac"``."""
    if curvature != "auto":
        return curvature, None
    limit = get_options().dense_curvature_dim
    if solver != "direct":
        return "gauss_newton", f"curvature='auto': Gauss-Newton products ({solver})"
    if dim <= limit:
        return "gauss_newton", (f"curvature='auto': dense Gauss-Newton, {dim:,} coordinates ≤ "
                                f"ga.options(dense_curvature_dim={limit})")
    return "ekfac", (f"curvature='auto': EK-FAC, {dim:,} coordinates > ga.options(dense_curvature_dim={limit}) "
                     "(a dense H would need " + f"{8.0 * dim * dim / 2**30:,.1f} GiB)")


def damped(H: Operator, *, damping: float | None, relative_damping: float, explicit: bool,
           decay: DecayTerm | None = None, parameter_coordinates: bool = True, exact_diagonal: bool = True,
           what: str = "this curvature", why: str | None = None) -> Operator:
    """``H + λI + (weight-decay term)``, each part labelled with where it came from
    (``why``: how the curvature was chosen, added to the damping's note).

    explicit : H's spectrum is at hand (relative damping possible).
    parameter_coordinates : H lives in the model's parameter coordinates (no projection).
    exact_diagonal : a per-coordinate decay can be added to H exactly (not K-FAC / DataInf).
    """
    suffix = f"; {why}" if why else ""
    if damping is not None:
        H = H.damp(damping, note="damping (given)" + suffix)
    elif explicit:
        H = H.damp(relative_damping, relative=True, note=f"default: {relative_damping:g} × mean eigenvalue" + suffix)
    else:
        H = H.damp(ABSOLUTE_DAMPING, note="default: no spectrum for products-only H" + suffix)
    if decay is None or decay.zero:
        return H
    if decay.uniform:
        return H.damp(decay.value, note=decay.note)
    _refuse_nonuniform(decay, parameter_coordinates, exact_diagonal, what)
    return H + diagonal(decay.values.to(torch.float64), H, note=decay.note)


def _refuse_nonuniform(decay: DecayTerm, parameter_coordinates: bool, exact_diagonal: bool, what: str) -> None:
    """A per-coordinate decay term has an exact form only on an unprojected H that takes a diagonal."""
    if not parameter_coordinates:
        raise ObjectiveError(
            f"the objective's weight decay differs between coordinates ({decay.note}); in a projected space "
            "it has no exact form (P diag(wd) Pᵀ is not diagonal). Drop the projector, or pass weight_decay= "
            "a single number to use wd·I in the projected coordinates")
    if not exact_diagonal:
        raise ObjectiveError(
            f"the objective's weight decay differs between coordinates ({decay.note}); {what} can absorb "
            "only a uniform wd·I exactly. Use curvature='gauss_newton' (direct or CG), or pass "
            "weight_decay= a single number")


def curvature_operator(task: Task, data, *, layers=None, projector: Projector | None = None,
                       curvature: str = "auto", solver: str = "direct", damping: float | None = None,
                       structure: str = "dense", rank: int = 32, seed: int = 0, solver_settings=None,
                       train_grads=None, relative_damping: float | None = None, weight_decay=None,
                       optimizer=None, covariance_max_examples: int | None = None,
                       lambda_max_examples: int | None = None, data_weight: float = 1.0):
    """(H + λI + decay / c)⁻¹ as a lazy Operator, for every curvature/solver pair in the table above.

    damping : absolute λ; default None: ``relative_damping`` (default per curvature,
        :data:`RELATIVE_DAMPING`) × H's mean eigenvalue where H is explicit, else
        :data:`ABSOLUTE_DAMPING` (see the module docs).
    weight_decay / optimizer : the objective's weight decay, given or read (module docs).
    covariance_max_examples / lambda_max_examples : K-FAC / EK-FAC only: the covariances and
        the eigenvalue correction from the first m examples of ``data`` (:func:`gradalg.kfac`).
    data_weight : c, the uniform data weight the model was trained at: the decay term is
        divided by c (module docs, "Data weight").
    """
    if curvature not in CURVATURES:
        raise OptionError(f"curvature must be one of {CURVATURES}, got {curvature!r}")
    if solver not in SOLVERS:
        raise OptionError(f"solver must be one of {SOLVERS}, got {solver!r}")
    why = None
    if curvature == "auto":
        space = (train_grads if train_grads is not None else
                 (projector or (lambda G: G))(grads(task, data, layers))).space
        curvature, why = resolve_curvature(curvature, solver, space.dim)
    check_kron_subsets(curvature, covariance_max_examples, lambda_max_examples)
    settings = dict(solver_settings or {})
    if relative_damping is None:
        relative_damping = RELATIVE_DAMPING.get(curvature, 0.1)
    P = projector if projector is not None else (lambda G: G)
    decay = decay_term(weight_decay, optimizer, grads(task, data, layers)) if (
        weight_decay is not None or optimizer is not None) else None
    c = check_data_weight(data_weight)
    if decay is not None and c != 1.0:
        decay = decay.scaled(1.0 / c, f"/ data weight {c:g}")
    if curvature == "datainf":
        G = train_grads if train_grads is not None else P(grads(task, data, layers))
        if decay is not None and not decay.uniform:
            _refuse_nonuniform(decay, projector is None, False, "DataInf (one λ per layer)")
        lam = ABSOLUTE_DAMPING if damping is None else damping
        return datainf(G, lam + (decay.value if decay is not None else 0.0))
    if curvature in ("hessian",) or (curvature == "gauss_newton" and solver != "direct"):
        if projector is not None:
            raise OptionError(f"curvature={curvature!r} with solver={solver!r} works in parameter "
                             "coordinates: drop the projector, or use solver='direct'")
        if curvature == "hessian" and solver == "direct":
            solver = "cg"
        H = (hessian if curvature == "hessian" else gauss_newton)(task, data, layers)
        if solver == "arnoldi":
            H = arnoldi(H, rank, seed=seed)
            return damped(H, damping=damping, relative_damping=relative_damping, explicit=False, decay=decay,
                          exact_diagonal=False, what="Arnoldi's low-rank H", why=why).inv()
        return damped(H, damping=damping, relative_damping=relative_damping, explicit=False,
                      decay=decay, why=why).inv(method=solver, **settings)
    if solver != "direct":
        raise OptionError(f"curvature={curvature!r} is formed explicitly: use solver='direct'")
    objective = "loss" if curvature == "empirical" else gauss_newton_objective(task)
    C = P(grads(task, data, layers, objective=objective, seed=seed))
    in_params = projector is None
    if curvature in ("kfac", "ekfac"):
        H = kfac(C, eigen_correction=curvature == "ekfac", covariance_max_examples=covariance_max_examples,
                 lambda_max_examples=lambda_max_examples)
        return damped(H, damping=damping, relative_damping=relative_damping, explicit=True, decay=decay,
                      parameter_coordinates=in_params, exact_diagonal=False, what=curvature.upper(),
                      why=why).inv()
    return damped(fisher(C, structure=structure), damping=damping, relative_damping=relative_damping,
                  explicit=True, decay=decay, parameter_coordinates=in_params, why=why).inv()


def influence(task: Task, train, queries, *, layers=None, projector: Projector | None = None,
              damping: float | None = None, weight_decay: float | None = None, optimizer=None,
              curvature: str = "auto", solver: str = "direct", structure: str = "dense",
              curvature_data=None, rank: int = 32, seed: int = 0, solver_settings: dict | None = None,
              relative_damping: float | None = None, covariance_max_examples: int | None = None,
              lambda_max_examples: int | None = None, query_gradient_rank: int | None = None,
              data_weight: float = 1.0) -> Scores:
    """Influence-function scores ``P(Q) @ (H + λI + wd)⁻¹ @ P(G).T``.

    curvature : "auto" (default): the dense Gauss-Newton up to ``ga.options(dense_curvature_dim)``
        (projected) coordinates with the direct solver, EK-FAC above (a real-size LM), the
        Gauss-Newton through products with an iterative solver; or one of the table's names.
    curvature_data : examples H is estimated on (default: ``train``).
    damping : an absolute λ; default (None) ``relative_damping`` × H's mean eigenvalue for an
        explicit H (default factor per curvature: 1 for the dense Gauss-Newton / Fisher, 0.1 for
        K-FAC / EK-FAC, :data:`RELATIVE_DAMPING`), :data:`ABSOLUTE_DAMPING` for products-only
        solvers and DataInf.
    weight_decay : the training objective's L2 coefficient (its Hessian is wd·I).
    optimizer : the optimizer that trained the model (torch SGD / Adam / AdamW, or a
        transformers Trainer): its weight decay is read per parameter (module docs).
    rank : eigenvectors kept by ``solver="arnoldi"``.
    covariance_max_examples : K-FAC / EK-FAC only: the Kronecker covariances from the first m
        examples of the curvature data (Kronfluence's option of the same name; None: all, exact;
        m ≥ n: all). A clear ``ValueError`` for other curvatures.
    lambda_max_examples : EK-FAC only: the eigenvalue correction from the first m examples.
    data_weight : c (default 1): the model was trained with every example at weight c in a
        sum-normalised objective (e.g. at c = α, the mean of retraining on α-subsets; the same
        training with weight decay wd/c): scores ``(1/c) P(Q) @ (H + λI + wd/c)⁻¹ @ P(G).T``,
        −n ∂f/∂ε_i at ε = c·1 (module docs, "Data weight").
    query_gradient_rank : None (default) exact; r: each preconditioned query's (out, in) blocks
        replaced by their best rank-r approximation (Kronfluence's ``query_gradient_low_rank``),
        ``(Q @ H⁻¹).low_rank(r) @ G.T``: the held query side keeps r·(out + in) numbers per
        block instead of out·in (:mod:`gradalg.expr.lowrank`; the plan shows both sizes).
    """
    G = grads(task, train, layers)
    Q = grads(task, queries, layers)
    if projector is not None:
        G, Q = check_projector(projector)(G), projector(Q)
    Hinv = curvature_operator(task, train if curvature_data is None else curvature_data, layers=layers,
                              projector=projector, curvature=curvature, solver=solver, damping=damping,
                              structure=structure, rank=rank, seed=seed, solver_settings=solver_settings,
                              train_grads=G if curvature_data is None else None,
                              relative_damping=relative_damping, weight_decay=weight_decay, optimizer=optimizer,
                              covariance_max_examples=covariance_max_examples,
                              lambda_max_examples=lambda_max_examples, data_weight=data_weight)
    S = (Q @ Hinv).low_rank(query_gradient_rank) @ G.T if query_gradient_rank is not None else Q @ Hinv @ G.T
    c = check_data_weight(data_weight)
    return S if c == 1.0 else S / c
