"""Influence functions (Koh & Liang, "Understanding black-box predictions via influence
functions", ICML 2017):

    S_qz = ∇L(q)ᵀ (H + (λ + wd) I)⁻¹ ∇L(z)

the first-order change of the query's loss when z is removed (up to 1/n); positive
means z helped q. ``H`` is the curvature of the training objective, ``wd`` its weight
decay and λ extra damping. ``curvature`` picks H, ``solver`` how it is inverted:

=================  ===========================================================  =====================
curvature          H                                                             solvers
=================  ===========================================================  =====================
``auto``           (default) ``near_minimum`` up to ``ga.options(dense_curvature_dim)``  as those
                   (projected) coordinates with the direct solver (``gauss_newton``
                   after a projector or where the Hessian's products do not
                   apply: :func:`hessian_refusal`), ``ekfac`` above
``gauss_newton``   Gauss-Newton = true Fisher: exact from the task's             direct, cg, lissa,
                   ``expected_terms`` (small output spaces), else sampled labels arnoldi
``empirical``      empirical Fisher (1/n) Σ ∇L(z)∇L(z)ᵀ of the true labels        direct
``hessian``        (1/n) Σ ∇²L(z), through Hessian-vector products (torch.func)  cg, lissa, arnoldi
``dense_hessian``  (1/n) Σ ∇²L(z) formed from dim Hessian-vector products        direct
                   (parameter coordinates; shifted to PSD by its default damping)
``near_minimum``   ``dense_hessian`` where the model is near a minimum of its     direct
                   objective (−μ_min(H̄ + decay) ≤ r × the Gauss-Newton's mean
                   eigenvalue, r = ``ga.options(hessian_negative_ratio)``), else
                   the dense ``gauss_newton``: decided from the data when it runs
``kfac``/``ekfac`` Kronecker-factored Gauss-Newton (Martens & Grosse 2015;        direct
                   George et al. 2018; Grosse et al. 2023)
``datainf``        DataInf's averaged Sherman-Morrison inverse (Kwon et al. 2024) direct
=================  ===========================================================  =====================

The names are the rows of :data:`CURVATURE_TABLE` (one :class:`Curvature` each: builder,
solvers, knobs, default damping). ``curvature=`` also takes an :class:`~gradalg.api.Operator`
H that carries its own knobs (``ga.ekfac(G, covariance_max_examples=m)``,
``ga.fisher(G, structure="block")``, ``ga.gauss_newton(task, data)``, ``ga.arnoldi(H, rank)``):
it is damped and inverted from its labels, as the named curvature of the same form is.

``direct`` forms H explicitly (dense, in the projected space when a ``projector`` is
given: the LoGra / TRAK recipe) and inverts it by eigendecomposition. ``dense_hessian`` is
the Hessian, known only through products, formed from dim of them
(:class:`~gradalg.expr.curvature.Formed`, parameter coordinates only): it may be indefinite
(the residual term the Gauss-Newton drops), so it is always shifted to positive
semi-definite (λ += max(0, −μ_min) of H + the decay term) and the damping added on top: by
default 0.3 × its mean eigenvalue (:data:`DENSE_HESSIAN_DAMPING`), or a given ``damping=λ``,
``relative_damping``, ``"auto"`` or rule, one λ each (issue 31: the digits MLP 0.859 against
0.829 for the dense Gauss-Newton, but a conv net not trained to a minimum 0.170 against
0.468; docs/fidelity.md "The formed Hessian and a Newton step to the centre"). ``curvature="hessian"`` keeps its
products and iterative solvers (the direct solver there means CG, as before). The iterative
solvers never form H: each step is one pass over the curvature data (Agarwal et al.
2017 for LiSSA; Schioppa et al. 2022 for Arnoldi).

``near_minimum`` decides between the two from the data, with no ground truth
(:class:`~gradalg.expr.NearMinimum`, issue 31): the formed Hessian where the model is near a
minimum of its objective,

    −μ_min(H̄ + decay) ≤ r · tr(G)/dim,   r = ``ga.options(hessian_negative_ratio)`` (1),

G the dense Gauss-Newton (its mean eigenvalue the scale: PSD, exact, formed for the other
side anyway), else the dense Gauss-Newton. At a weight-decayed minimum H̄ + wd ⪰ 0 and
−μ_min(H̄) ≈ wd; a model stopped early has a strongly indefinite H̄, whose PSD shift swamps
the curvature that ranks examples. μ_min is bounded first by up to
``ga.options(hessian_probe_iterations)`` (32) Lanczos products on one vector each, stopped as
soon as the bound proves the Gauss-Newton side (a Ritz value is never below μ_min: the
Hessian is then never formed); otherwise the formed Hessian's own eigenvalues decide, from its
one eigendecomposition (shared with its PSD shift and inverse). Where the Hessian is chosen but
its damped, shifted matrix is singular (``damping=0`` off an exact minimum: the shift leaves an
eigenvalue 0), the Gauss-Newton is taken: ``"auto"`` does not refuse a call the Gauss-Newton
answers (``curvature="dense_hessian"`` by name still does). The plan shows a ``CURVATURE``
decision: the rule before the run, the measured μ_min, scale and ratio after it.

Measured on a small MLP (see docs/fidelity.md) the empirical Fisher loses LDS against
the Gauss-Newton curvature, which is why Gauss-Newton is the default where a dense H fits.
At width a dense H cannot exist (GPT-2 small's 85 M block coordinates: 58 PB), so the
default ``curvature="auto"`` takes EK-FAC above ``ga.options(dense_curvature_dim)``
coordinates (16,384 by default), as Kronfluence does for every model; with an iterative
solver it is the Gauss-Newton through products, which never forms H. The plan names the
choice in the damping's note.

Damping and weight decay (shown in the plan, each ``damp`` with where it came from):

* λ, default ``relative_damping`` × the mean eigenvalue tr(H)/dim of H (Kronfluence's
  heuristic, scale-free) for the direct solver's dense / block Fisher (factor 1, measured,
  :data:`RELATIVE_DAMPING`). K-FAC and EK-FAC default to λ_b for each Kronecker block from
  its own Λ (:data:`DEFAULT_KRONECKER_DAMPING`, ``damping="auto"``'s rule: the eigenvalue
  where the block's largest hold 0.99 of its trace; issue 31, chosen across the nine
  fidelity settings: worst / mean LDS 0.353 / 0.519 against 0.334 / 0.516 for the earlier
  0.1 × the pooled mean, Kronfluence's factor, which ``relative_damping=0.1`` still gives).
  A Kronecker H is block-diagonal, so its blocks' spectra are its spectrum; a dense H
  couples its blocks and keeps one λ (per block from its diagonal blocks it lost 0.11 on a
  conv net, 0.357 against 0.468; one λ from its pooled spectrum, 0.424). Operators known only through
  products (CG, LiSSA, Arnoldi) and DataInf have no cheap spectrum: there the default is
  the absolute :data:`ABSOLUTE_DAMPING`. ``damping=`` gives an absolute λ instead.
  ``damping="auto"`` chooses λ_b for each block b of an explicit H from that block's own
  eigenvalues, with no ground truth (:mod:`gradalg.linalg.autodamp`; the rule per form is
  :data:`AUTO_DAMPING`), and ``damping=ga.linalg.DampingRule(kind, value)`` names a rule;
  the plan shows the rule and where it came from.
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

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..api import (Operator, Scores, arnoldi, datainf, diagonal, fisher, gauss_newton, grads, hessian, kfac)
from ..capture.wrappers import is_sharded
from ..errors import OptionError
from ..expr.curvature import Formed, NearMinimum
from ..expr.projection import Projector, check_projector
from ..linalg.autodamp import DampingRule
from ..linalg.labels import form_of
from ..objective import DecayTerm, ObjectiveError, training_objective
from ..options import get_options
from ..task import Task
from .registry import method

SOLVERS = ("direct", "cg", "lissa", "arnoldi")
#: λ / mean eigenvalue of an explicit H with ``relative_damping`` unset (K-FAC / EK-FAC: only when
#: given as ``relative_damping``; their default is :data:`DEFAULT_KRONECKER_DAMPING`), measured on the digits MLP
#: (benchmarks/damping_defaults.py, LDS, 50 subsets; docs/user_guide.md "Defaults from the
#: objective"): the dense Gauss-Newton / Fisher 0.726 at 0.1, 0.817 at 0.5, 0.829 at 1;
#: EK-FAC 0.745 at 0.1 (Kronfluence's factor), 0.714 at 0.5, 0.691 at 1; K-FAC 0.753 at 0.1
#: (the old absolute 1e-3: Gauss-Newton 0.818, EK-FAC 0.713, K-FAC 0.722).
RELATIVE_DAMPING = {"gauss_newton": 1.0, "empirical": 1.0, "kfac": 0.1, "ekfac": 0.1}
ABSOLUTE_DAMPING = 1e-3   # default λ where H's spectrum is not at hand (CG, LiSSA, Arnoldi, DataInf)
#: ``damping="auto"``: the rule per form of H (:mod:`gradalg.linalg.autodamp`; λ_b from each
#: block's own spectrum, no ground truth), chosen by LDS across the four fidelity settings
#: (benchmarks/auto_damping.py, docs/fidelity.md "Automatic damping")
AUTO_DAMPING = {"dense": DampingRule("mass", 0.95), "block": DampingRule("mass", 0.95),
                "diagonal": DampingRule("mass", 0.95), "kronecker": DampingRule("mass", 0.99)}


#: the default λ of a Kronecker H (K-FAC, EK-FAC; ``damping=None`` and no ``relative_damping``),
#: issue 31: ``damping="auto"``'s Kronecker rule, λ_b per block from its own Λ (mass 0.99), in
#: place of 0.1 × the pooled mean eigenvalue. A Kronecker H is block-diagonal, so its blocks'
#: spectra are its own; a dense H couples its blocks and keeps one λ (1 × its mean eigenvalue:
#: per-block λ from its diagonal blocks lost 0.11 LDS on a conv net). Chosen across the nine
#: fidelity settings (benchmarks/defaults_suite.py; docs/fidelity.md "How the defaults were
#: chosen"): worst / mean 0.353 / 0.519 against 0.334 / 0.516 for influence at its defaults.
DEFAULT_KRONECKER_DAMPING = "auto"
#: the default λ of the formed Hessian (``curvature="dense_hessian"``; ``damping=None`` and no
#: ``relative_damping``): the Hessian shifted to positive semi-definite (λ += max(0, −μ_min) of
#: H + the weight-decay term, the negative curvature the Gauss-Newton drops; at a weight-decayed
#: optimum μ_min(H) ≈ −wd, so the shift is the weight decay when none is given) plus 0.3 × its mean
#: eigenvalue, one λ for the whole matrix (a dense H couples its blocks). Issue 31, digits MLP
#: (benchmarks/explore_centre.py; docs/fidelity.md "The formed Hessian and a Newton step to the centre"):
#: LDS 0.851 / 0.856 / 0.859 / 0.846 at 0.03 / 0.1 / 0.3 / 1 × mean, against 0.829 for the dense
#: Gauss-Newton; logreg 0.940 against 0.922. ``"auto"`` takes it only near a minimum (:data:`DENSE_AUTO`):
#: on the conv net (Adam, no weight decay, not at a minimum) it scores 0.170 against 0.468 (docs/fidelity.md
#: "The formed Hessian as the dense default").
DENSE_HESSIAN_DAMPING = DampingRule("mean", 0.3, per_block=False, psd=True,
                                    note="the default for a formed Hessian (issue 31)")
#: what ``curvature="auto"`` takes with the direct solver up to ``ga.options(dense_curvature_dim)``
#: coordinates: "near_minimum" (issue 31, 2026-12-06), the formed Hessian where −μ_min(H̄ + decay) ≤
#: ``ga.options(hessian_negative_ratio)`` (1) × the Gauss-Newton's mean eigenvalue, else the dense
#: Gauss-Newton. Chosen by issue 31's rule on six dense settings, three of them added after r was
#: fixed (benchmarks/defaults_suite.py; docs/fidelity.md "The formed Hessian where the model is near a
#: minimum"): worst / mean LDS 0.468 / 0.716 against 0.468 / 0.701 for the dense Gauss-Newton
#: ("gauss_newton", the previous default), never below it; the formed Hessian everywhere
#: ("dense_hessian") lost 0.298 on a conv net stopped by Adam.
DENSE_AUTO = "near_minimum"


def hessian_damping(damping, relative_damping) -> DampingRule:
    """The damping of the formed Hessian (``curvature="dense_hessian"``) as a rule with ``psd=True``:
    H̄ (+ the decay term) is shifted to positive semi-definite first (λ += max(0, −μ_min)), then
    damped as asked: by default :data:`DENSE_HESSIAN_DAMPING` (0.3 × its mean eigenvalue), an
    absolute ``damping=λ``, ``relative_damping=r`` (r × mean), ``"auto"`` (the dense rule) or a
    given :class:`~gradalg.linalg.autodamp.DampingRule` — each one λ for the whole matrix."""
    if damping is None and relative_damping is None:
        return DENSE_HESSIAN_DAMPING
    if damping is None:
        return DampingRule("mean", float(relative_damping), per_block=False, psd=True,
                           note=f"relative_damping={float(relative_damping):g} (given) on the Hessian shifted to PSD")
    rule = damping_rule(damping, "dense")
    if rule is not None:
        return replace(rule, psd=True, per_block=False,     # one λ: a dense H couples its blocks
                       note=(rule.note or f"damping={damping!r}") + " on the Hessian shifted to PSD")
    return DampingRule("absolute", float(damping), per_block=False, psd=True,
                       note=f"damping={float(damping):g} (given) on the Hessian shifted to PSD")


def damping_rule(damping, form: str = "dense"):
    """The :class:`~gradalg.linalg.autodamp.DampingRule` ``damping`` asks for (``"auto"``: the
    rule of H's form, :data:`AUTO_DAMPING`; a DampingRule: itself), or None for a number / None."""
    if isinstance(damping, DampingRule):
        return damping
    if isinstance(damping, str):
        if damping != "auto":
            raise OptionError(f"damping must be a number ≥ 0, None, 'auto' or a ga.linalg.DampingRule, got "
                              f"{damping!r}: e.g. damping='auto' or damping=ga.linalg.DampingRule('mass', 0.99)")
        return AUTO_DAMPING.get(form, AUTO_DAMPING["dense"])
    return None


def auto_note(damping, rule) -> str:
    """The plan's provenance of an automatic λ: which rule, given or by ``damping='auto'``."""
    how = rule.note or ("damping='auto'" if isinstance(damping, str) else "damping=DampingRule (given)")
    return f"{how}: {rule.describe()}, from H's own spectrum"


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


def hessian_refusal(task: Task | None) -> str | None:
    """Why ``curvature="auto"`` does not form the Hessian for ``task`` (None: it may): a
    language-model task (its curvature is the sampled Gauss-Newton over the vocabulary; the
    formed Hessian was measured on classifiers), a model sharded across ranks (FSDP, FSDP2: its
    products need whole parameters), or a model whose attention torch cannot push
    a forward-mode tangent through on CPU (``nn.MultiheadAttention``, a transformers model
    whose ``config._attn_implementation`` is not ``"eager"``): the Hessian's products need it."""
    if task is None:
        return "no task"
    if task.curvature_objective == "sampled" or task.expected_terms is None:
        return "the task's curvature is the sampled Gauss-Newton"
    from torch import nn

    if is_sharded(task.model):
        return "the model's parameters are sharded across ranks (FSDP): the Hessian's products need whole parameters"
    for module in task.model.modules():
        if isinstance(module, nn.MultiheadAttention):
            return "nn.MultiheadAttention has no forward-mode AD on CPU (the Hessian's products need it)"
    impl = getattr(getattr(task.model, "config", None), "_attn_implementation", None)
    if impl not in (None, "eager"):
        return f"the model's {impl!r} attention has no forward-mode AD on CPU (the Hessian's products need it)"
    return None


def resolve_curvature(curvature: str, solver: str, dim: int, *, dense: str | None = None,
                      projected: bool = False, task: Task | None = None) -> tuple[str, str | None]:
    """``(curvature, note)``: ``"auto"`` made concrete for a space of ``dim`` (projected)
    coordinates, and the note the plan shows for it (None for a curvature given by name).

    ``"auto"``: ``"gauss_newton"`` through products with an iterative solver; with the direct
    solver ``dense`` (default :data:`DENSE_AUTO`) when ``dim ≤ ga.options(dense_curvature_dim)``,
    else ``"ekfac"``. A formed Hessian lives in parameter coordinates: with a projector
    (``projected``), or where :func:`hessian_refusal` names a reason for ``task``, the dense
    choice is the Gauss-Newton (the note says why)."""
    if curvature != "auto":
        return curvature, None
    limit = get_options().dense_curvature_dim
    if solver != "direct":
        return "gauss_newton", f"curvature='auto': Gauss-Newton products ({solver})"
    if dim <= limit:
        dense = dense or DENSE_AUTO
        refusal = ("projected coordinates" if projected else hessian_refusal(task)) \
            if dense in ("dense_hessian", "near_minimum") else None
        if refusal:
            return "gauss_newton", (f"curvature='auto': dense Gauss-Newton, {dim:,} coordinates ≤ "
                                    f"ga.options(dense_curvature_dim={limit}) (not the Hessian: {refusal})")
        if dense == "dense_hessian":
            return "dense_hessian", (f"curvature='auto': the Hessian formed from {dim:,} products, {dim:,} "
                                     f"coordinates ≤ ga.options(dense_curvature_dim={limit})")
        if dense == "near_minimum":
            r = get_options().hessian_negative_ratio
            return "near_minimum", (f"curvature='auto': {dim:,} coordinates ≤ ga.options(dense_curvature_dim="
                                    f"{limit}); the formed Hessian if −μ_min ≤ ga.options(hessian_negative_ratio="
                                    f"{r:g}) × the Gauss-Newton's mean eigenvalue, else the dense Gauss-Newton")
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
    rule = damping_rule(damping, form_of(H.expr.labels().labels) if explicit else "implicit")
    if rule is not None:
        if not explicit:
            raise OptionError(f"damping={damping!r} chooses λ from the spectrum of H, which {what} does not have "
                              f"(products only or low-rank): pass an absolute damping=λ, e.g. {ABSOLUTE_DAMPING:g}")
        if rule.psd and decay is not None and not decay.zero:
            # shifted to PSD: the shift is read from the whole objective's curvature H + decay
            return _with_decay(H, decay, parameter_coordinates, exact_diagonal, what).damp(
                rule, note=auto_note(damping, rule) + suffix)
        H = H.damp(rule, note=auto_note(damping, rule) + suffix)
    elif damping is not None:
        H = H.damp(damping, note="damping (given)" + suffix)
    elif explicit:
        H = H.damp(relative_damping, relative=True, note=f"default: {relative_damping:g} × mean eigenvalue" + suffix)
    else:
        H = H.damp(ABSOLUTE_DAMPING, note="default: no spectrum for products-only H" + suffix)
    if decay is None or decay.zero:
        return H
    return _with_decay(H, decay, parameter_coordinates, exact_diagonal, what)


def _with_decay(H: Operator, decay: DecayTerm, parameter_coordinates: bool, exact_diagonal: bool,
                what: str) -> Operator:
    """H + the weight-decay term: wd·I, or diag(wd_j) where it has an exact form."""
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


@dataclass(frozen=True)
class Curvature:
    """One named curvature of the table above: how H is built from the data, which solvers
    invert it, its knobs, and its default relative damping (None: products only, so the
    absolute :data:`ABSOLUTE_DAMPING`).

    ``build(task, data, layers, projector, solver, options)`` returns H, undamped, as a lazy
    :class:`~gradalg.api.Operator`; the damping, weight decay and inverse are added by
    :func:`curvature_operator`. DataInf has no builder (None): its operator is the damped
    inverse itself, ``ga.datainf(G, λ + wd)``, built there.
    """

    name: str
    build: Callable | None
    solvers: tuple[str, ...]
    options: tuple[str, ...]
    relative_damping: float | None
    description: str


def _formed(objective):
    """A builder of the Fisher / Gauss-Newton formed from (projected) gradient rows."""
    def build(task, data, layers, P, solver, o):
        obj = objective or gauss_newton_objective(task)
        C = P(grads(task, data, layers, objective=obj, seed=o.get("seed", 0)))
        return fisher(C, structure=o.get("structure", "dense"))
    return build


def _kron(eigen_correction):
    """A builder of K-FAC (``eigen_correction=False``) or EK-FAC of the Gauss-Newton rows."""
    def build(task, data, layers, P, solver, o):
        C = P(grads(task, data, layers, objective=gauss_newton_objective(task), seed=o.get("seed", 0)))
        return kfac(C, eigen_correction=eigen_correction, covariance_max_examples=o.get("covariance_max_examples"),
                    lambda_max_examples=o.get("lambda_max_examples"))
    return build


def _gauss_newton(task, data, layers, P, solver, o):
    """Formed (direct solver), else through products (CG, LiSSA, Arnoldi)."""
    if solver == "direct":
        return _formed(None)(task, data, layers, P, solver, o)
    return gauss_newton(task, data, layers)


def _hessian(task, data, layers, P, solver, o):
    return hessian(task, data, layers)


def _dense_hessian(task, data, layers, P, solver, o):
    """The Hessian formed from dim of its products (parameter coordinates)."""
    return Operator(Formed(hessian(task, data, layers).expr))


#: the named curvatures, by name (``curvature="<name>"``); ``"auto"`` picks one of them
CURVATURE_TABLE: dict[str, Curvature] = {c.name: c for c in (
    Curvature("gauss_newton", _gauss_newton, ("direct", "cg", "lissa", "arnoldi"),
              ("structure", "seed", "rank", "solver_settings", "relative_damping"), RELATIVE_DAMPING["gauss_newton"],
              "Gauss-Newton = true Fisher (exact expected terms, else sampled labels)"),
    Curvature("empirical", _formed("loss"), ("direct",), ("structure", "seed", "relative_damping"),
              RELATIVE_DAMPING["empirical"],
              "empirical Fisher of the true labels"),
    Curvature("hessian", _hessian, ("cg", "lissa", "arnoldi"), ("rank", "seed", "solver_settings"), None,
              "(1/n) Σ ∇²L(z) through Hessian-vector products"),
    Curvature("dense_hessian", _dense_hessian, ("direct",), ("relative_damping",), None,
              "(1/n) Σ ∇²L(z) formed from dim Hessian-vector products (default damping: shifted to PSD)"),
    Curvature("kfac", _kron(False), ("direct",), ("covariance_max_examples", "seed", "relative_damping"),
              RELATIVE_DAMPING["kfac"],
              "K-FAC of the Gauss-Newton rows"),
    Curvature("ekfac", _kron(True), ("direct",),
              ("covariance_max_examples", "lambda_max_examples", "seed", "relative_damping"),
              RELATIVE_DAMPING["ekfac"],
              "EK-FAC of the Gauss-Newton rows"),
    Curvature("datainf", None, ("direct",), (), None, "DataInf's averaged Sherman-Morrison inverse (damping inside)"),
)}
#: ``"near_minimum"``: the formed Hessian where the model is near a minimum of its objective, else the
#: dense Gauss-Newton, decided from the data when it runs (:func:`_near_minimum`; issue 31)
CURVATURES = ("auto", *CURVATURE_TABLE, "near_minimum")
#: the knobs of a named curvature, accepted as keywords of influence / curvature_operator
#: (an Operator given as ``curvature=`` carries its own: ``ga.ekfac(G, covariance_max_examples=m)``)
CURVATURE_OPTIONS = ("structure", "rank", "seed", "solver_settings", "relative_damping",
                     "covariance_max_examples", "lambda_max_examples")
#: the knobs an Operator given as ``curvature=`` still takes from the call (how it is damped and solved)
OPERATOR_CALL_OPTIONS = ("relative_damping", "solver_settings")
#: default λ / mean eigenvalue of an explicit H given as an Operator, by its form (the named
#: curvatures' measured factors, :data:`RELATIVE_DAMPING`, by the form they resolve to; a
#: Kronecker H without ``damping`` / ``relative_damping`` takes :data:`DEFAULT_KRONECKER_DAMPING`)
RELATIVE_DAMPING_BY_FORM = {"dense": 1.0, "block": 1.0, "diagonal": 1.0, "kronecker": 0.1}


def _check_options(options: dict, allowed: tuple[str, ...], what: str) -> None:
    """Refuse a keyword that is not a curvature knob, or one not in ``allowed`` (for an Operator:
    one it carries itself) given a value other than None."""
    for name, value in options.items():
        if name not in CURVATURE_OPTIONS:
            raise OptionError(f"unknown keyword {name!r}: the curvature knobs are {list(CURVATURE_OPTIONS)}; "
                              "other knobs belong to an Operator passed as curvature= (e.g. "
                              "ga.ekfac(G, covariance_max_examples=m))")
        if name not in allowed and value is not None:
            raise OptionError(f"{name}= is a knob of a named curvature; {what} carries its own. Set it on the "
                              "operator (ga.ekfac(G, covariance_max_examples=m), ga.fisher(G, structure=...), "
                              "ga.arnoldi(H, rank, seed=...)), or pass curvature= by name")


def _operator_inverse(H: Operator, *, solver: str, damping, relative_damping, decay, why, what: str,
                      settings: dict) -> Operator:
    """(H + λI + decay)⁻¹ for a curvature H, damped and inverted according to its labels.

    An H tagged ``inverse`` / ``approximate-inverse`` is used as the inverse (no damping may
    be added); ``implicit`` (products only): absolute damping, iterative ``solver`` (direct → CG);
    ``low-rank``: absolute damping, inverted in closed form; any other form: relative damping
    (``relative_damping``, default by form), inverted by structure (direct solver only)."""
    labels = H.expr.labels()
    form = form_of(labels.labels)
    in_params = all(b.basis == "params" for b in H.space.blocks)
    if {"inverse", "approximate-inverse"} & labels.labels:
        if damping is not None or decay is not None:
            raise OptionError(f"curvature= is already an inverse ({what}): its damping is inside it. Drop "
                              "damping= / weight_decay= / optimizer=, or pass the curvature H itself")
        return H
    if form == "implicit":
        method = "cg" if solver == "direct" else solver
        if method == "arnoldi":
            raise OptionError("solver='arnoldi' with a curvature Operator: pass ga.arnoldi(H, rank) as curvature= "
                              "(the operator carries its rank and seed)")
        return damped(H, damping=damping, relative_damping=0.0, explicit=False, decay=decay,
                      parameter_coordinates=in_params, why=why).inv(method=method, **settings)
    if solver != "direct":
        raise OptionError(f"curvature= is formed explicitly ({what}, {form}): use solver='direct'")
    if form == "low-rank":
        return damped(H, damping=damping, relative_damping=0.0, explicit=False, decay=decay,
                      parameter_coordinates=in_params, exact_diagonal=False, what=what, why=why).inv()
    if damping is None and relative_damping is None and form == "kronecker":
        damping = DEFAULT_KRONECKER_DAMPING          # the default: λ_b per Kronecker block (issue 31)
        why = "the default for a Kronecker H since issue 31" + (
            f"; {why}" if why else "")
    if relative_damping is None:
        relative_damping = RELATIVE_DAMPING_BY_FORM.get(form, 1.0)
    return damped(H, damping=damping, relative_damping=relative_damping, explicit=True, decay=decay,
                  parameter_coordinates=in_params, exact_diagonal=form != "kronecker", what=what, why=why).inv()


def curvature_operator(task: Task, data, *, curvature="auto", solver: str = "direct",
                       damping: float | None = None, layers=None, projector: Projector | None = None,
                       weight_decay=None, optimizer=None, data_weight: float = 1.0, train_grads=None,
                       dense_auto: str | None = None, gauss_newton_damping=None, **curvature_options):
    """(H + λI + decay / c)⁻¹ as a lazy Operator, for every curvature/solver pair in the table above.

    curvature : ``"auto"``, a name of :data:`CURVATURE_TABLE`, or an :class:`~gradalg.api.Operator`
        H that carries its own knobs (``ga.ekfac(G, covariance_max_examples=m)``,
        ``ga.fisher(G, structure="block")``, ``ga.gauss_newton(task, data)``,
        ``ga.arnoldi(H, rank)``, ``ga.datainf(G, λ)`` …), damped and inverted by its labels
        (a kronecker form takes λ_b per block, :data:`DEFAULT_KRONECKER_DAMPING`, dense / block /
        diagonal the relative damping 1, products and low-rank the absolute
        :data:`ABSOLUTE_DAMPING`; an inverse is used as it is).
    damping : absolute λ; default None: ``relative_damping`` (default per curvature,
        :data:`RELATIVE_DAMPING`) × H's mean eigenvalue where H is explicit and not Kronecker,
        λ_b per block (:data:`DEFAULT_KRONECKER_DAMPING`) for K-FAC / EK-FAC unless
        ``relative_damping`` is given, else :data:`ABSOLUTE_DAMPING` (see the module docs); ``"auto"`` or a
        :class:`~gradalg.linalg.autodamp.DampingRule`: λ_b per block from its spectrum.
    gauss_newton_damping : ``"near_minimum"`` only (``curvature="auto"``'s dense choice where it is
        that rule): the damping of its Gauss-Newton side, read as ``damping`` is (a number, ``"auto"``
        or a DampingRule); None (default): ``damping`` on both sides, the Hessian side through
        :func:`hessian_damping`. RelatIF passes its own dense rule here (:data:`~gradalg.methods.relatif.DENSE_DAMPING`).
        Given with any other curvature it is an OptionError.
    weight_decay / optimizer : the objective's weight decay, given or read (module docs).
    data_weight : c, the uniform data weight the model was trained at: the decay term is
        divided by c (module docs, "Data weight").
    **curvature_options : the knobs of a named curvature (:data:`CURVATURE_OPTIONS`), kept as
        keywords for compatibility: ``structure`` ("dense" | "block" | "diag", formed
        Fisher), ``rank`` / ``seed`` (Arnoldi; ``seed`` also of sampled labels),
        ``solver_settings`` (CG / LiSSA), ``relative_damping``, ``covariance_max_examples`` /
        ``lambda_max_examples`` (K-FAC / EK-FAC statistics on the first m examples of
        ``data``, :func:`gradalg.kfac`). With an Operator only ``relative_damping`` and
        ``solver_settings`` apply; the others are refused (the operator carries them).
    """
    if solver not in SOLVERS:
        raise OptionError(f"solver must be one of {SOLVERS}, got {solver!r}")
    settings = dict(curvature_options.get("solver_settings") or {})
    decay = decay_term(weight_decay, optimizer, grads(task, data, layers)) if (
        weight_decay is not None or optimizer is not None) else None
    c = check_data_weight(data_weight)
    if decay is not None and c != 1.0:
        decay = decay.scaled(1.0 / c, f"/ data weight {c:g}")
    if isinstance(curvature, Operator):
        _check_options(curvature_options, OPERATOR_CALL_OPTIONS, "an Operator given as curvature=")
        return _operator_inverse(curvature, solver=solver, damping=damping,
                                 relative_damping=curvature_options.get("relative_damping"), decay=decay,
                                 why=None, what=f"a {curvature.structure} operator", settings=settings)
    if curvature not in CURVATURES:
        raise OptionError(f"curvature must be one of {CURVATURES} or a ga.Operator (e.g. ga.ekfac(G)), "
                          f"got {curvature!r}")
    _check_options(curvature_options, CURVATURE_OPTIONS, "")
    why = None
    if curvature == "auto":
        space = (train_grads if train_grads is not None else
                 (projector or (lambda G: G))(grads(task, data, layers))).space
        curvature, why = resolve_curvature(curvature, solver, space.dim, dense=dense_auto,
                                           projected=projector is not None, task=task)
    o = curvature_options
    check_kron_subsets(curvature, o.get("covariance_max_examples"), o.get("lambda_max_examples"))
    if curvature == "near_minimum":
        refusal = ("a projector (the formed Hessian lives in parameter coordinates)" if projector is not None else
                   f"solver={solver!r} (it is formed and solved directly)" if solver != "direct" else
                   hessian_refusal(task))
        if refusal:
            raise OptionError(f"curvature='near_minimum' forms the Hessian, which does not apply here: {refusal}. "
                              "Use curvature='gauss_newton' (or 'auto')")
        return _near_minimum(task, data, layers, hessian_side=hessian_damping(damping, o.get("relative_damping")),
                             gauss_newton_side=damping if gauss_newton_damping is None else gauss_newton_damping,
                             decay=decay, why=why, options=o)
    if gauss_newton_damping is not None:
        raise OptionError(f"gauss_newton_damping= is the damping of curvature='near_minimum''s Gauss-Newton side; "
                          f"curvature is {curvature!r} here: drop it, or pass damping=")
    entry = CURVATURE_TABLE[curvature]
    relative_damping = o.get("relative_damping")
    if relative_damping is None and curvature not in ("kfac", "ekfac"):   # Kronecker: the default rule
        relative_damping = entry.relative_damping if entry.relative_damping is not None else 0.1
    P = projector if projector is not None else (lambda G: G)
    if curvature == "datainf":
        G = train_grads if train_grads is not None else P(grads(task, data, layers))
        if decay is not None and not decay.uniform:
            _refuse_nonuniform(decay, projector is None, False, "DataInf (one λ per layer)")
        if damping_rule(damping) is not None:
            raise OptionError(f"damping={damping!r}: DataInf's inverse is closed-form, with no spectrum to read; "
                              f"pass an absolute damping=λ (default {ABSOLUTE_DAMPING:g})")
        lam = ABSOLUTE_DAMPING if damping is None else damping
        return datainf(G, lam + (decay.value if decay is not None else 0.0))
    if solver != "direct" and solver not in entry.solvers:
        raise OptionError(f"curvature={curvature!r} is formed explicitly: use solver='direct'")
    if (entry.relative_damping is None or solver != "direct") and projector is not None:   # through products
        raise OptionError(f"curvature={curvature!r} with solver={solver!r} works in parameter "
                          "coordinates: drop the projector, or use solver='direct'")
    H = entry.build(task, data, layers, P, solver, o)
    if curvature == "dense_hessian":          # always shifted to PSD; the damping on top
        damping = hessian_damping(damping, o.get("relative_damping"))
    what = curvature.upper() if curvature in ("kfac", "ekfac") else "this curvature"
    if solver == "arnoldi":
        H, solver, what = arnoldi(H, o.get("rank", 32), seed=o.get("seed", 0)), "direct", "Arnoldi's low-rank H"
    return _operator_inverse(H, solver=solver, damping=damping, relative_damping=relative_damping, decay=decay,
                             why=why, what=what, settings=settings)


def _near_minimum(task, data, layers, *, hessian_side: DampingRule, gauss_newton_side, decay, why,
                  options) -> Operator:
    """``curvature="auto"``'s dense choice decided from the data (:data:`DENSE_AUTO` =
    ``"near_minimum"``): a :class:`~gradalg.expr.NearMinimum` over the damped inverses of the
    formed Hessian (``hessian_side``, a ``psd`` rule from :func:`hessian_damping`: by default shifted
    to PSD, + 0.3 × mean) and of the dense Gauss-Newton (``gauss_newton_side``: a number, ``"auto"``, a
    DampingRule, or None for ``relative_damping``, default 1 × mean; influence passes its ``damping``
    to both, RelatIF its own dense rule here), each with the objective's ``decay``;
    the formed Hessian and Gauss-Newton nodes are the ones those inverses hold (resolved once).
    Where the Hessian's damped, shifted matrix is singular (``damping=0`` off an exact minimum:
    the PSD shift leaves μ = 0) the Gauss-Newton is taken, and the plan's decision says so."""
    H = _dense_hessian(task, data, layers, None, "direct", options)
    G = _gauss_newton(task, data, layers, lambda x: x, "direct", options)
    rel = options.get("relative_damping")
    head = (why or "curvature='auto'").split(";")[0]
    H_inv = _operator_inverse(H, solver="direct", damping=hessian_side, relative_damping=rel,
                              decay=decay, why=f"{head}; near a minimum: the formed Hessian", what="this curvature",
                              settings={})
    G_inv = _operator_inverse(G, solver="direct", damping=gauss_newton_side,
                              relative_damping=RELATIVE_DAMPING["gauss_newton"] if rel is None else rel,
                              decay=decay, why=f"{head}; not near a minimum: the dense Gauss-Newton", what="this curvature",
                              settings={})
    shift = 0.0 if decay is None or decay.zero else (
        float(decay.value) if decay.uniform else float(decay.values.min()))
    o = get_options()
    return Operator(NearMinimum(H.expr.op, H.expr, G.expr, H_inv.expr, G_inv.expr,
                                float(o.hessian_negative_ratio), int(o.hessian_probe_iterations), shift,
                                hessian_damped=H_inv.expr.op))


@method('Influence function ∇L(q)ᵀ(H + λI)⁻¹∇L(z); H: Gauss-Newton, empirical Fisher, Hessian, K-FAC, '
        'EK-FAC, DataInf; solvers: direct, CG, LiSSA, Arnoldi (Koh & Liang 2017)', cli=True)
def influence(task: Task, train, queries, *, curvature="auto", solver: str = "direct",
              damping: float | None = None, layers=None, projector: Projector | None = None,
              weight_decay: float | None = None, optimizer=None, curvature_data=None, data_weight: float = 1.0,
              query_gradient_rank: int | None = None, **curvature_options) -> Scores:
    """Influence-function scores ``P(Q) @ (H + λI + wd)⁻¹ @ P(G).T``.

    curvature : "auto" (default): up to ``ga.options(dense_curvature_dim)`` (projected) coordinates
        with the direct solver the formed Hessian where the model is near a minimum of its
        objective, else the dense Gauss-Newton (``"near_minimum"``, decided from the data when it
        runs; the plan's ``CURVATURE`` decision shows the numbers), EK-FAC above (a real-size LM), the
        Gauss-Newton through products with an iterative solver; or one of the table's names;
        or an :class:`~gradalg.api.Operator` H that carries its own knobs, e.g.
        ``ga.ekfac(ga.grads(task, train, objective="sampled"), covariance_max_examples=m)``,
        ``ga.fisher(G, structure="block")``, ``ga.gauss_newton(task, data)`` (with
        ``solver="cg"``), ``ga.arnoldi(H, rank)``: damped and inverted by its structure
        (:func:`curvature_operator`). It must live in the space of the (projected) gradients.
    solver : "direct" (default), "cg", "lissa", "arnoldi" (the table's pairs).
    damping : an absolute λ; default (None) ``relative_damping`` × H's mean eigenvalue for an
        explicit dense / block H (factor 1 for the Gauss-Newton / Fisher, :data:`RELATIVE_DAMPING`),
        for K-FAC / EK-FAC λ_b per Kronecker block from its own spectrum
        (:data:`DEFAULT_KRONECKER_DAMPING`; ``relative_damping=0.1`` gives the earlier 0.1 ×
        mean eigenvalue), :data:`ABSOLUTE_DAMPING` for products-only solvers and DataInf.
        Chosen across the nine fidelity settings (issue 31; ``benchmarks/defaults_suite.py``,
        docs/fidelity.md "How the defaults were chosen"), LDS of ``influence`` at its defaults:

        ======================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====
        damping (Kronecker H)   logreg  mlp    lm     lm2    text   instruct  llama  conv   seqcls  worst  mean
        ======================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====
        0.1 × mean (earlier)    0.922   0.829  0.355  0.420  0.334  0.474     0.474  0.468  0.370   0.334  0.516
        per Kronecker block     0.922   0.829  0.362  0.426  0.353  0.475     0.476  0.468  0.361   0.353  0.519
        "auto", dense H too     0.943   0.827  0.362  0.426  0.353  0.475     0.476  0.357  0.361   0.353  0.509
        ======================  ======  =====  =====  =====  =====  ========  =====  =====  ======  =====  =====

        (logreg, mlp and conv: the dense Gauss-Newton then, the others EK-FAC; the dense choice is now
        the near-minimum rule of the table below.)
        ``curvature="dense_hessian"`` (the Hessian formed from its products) is always shifted to
        PSD, the damping on top, by default 0.3 × its mean eigenvalue (:data:`DENSE_HESSIAN_DAMPING`;
        issue 31, LDS logreg 0.940, mlp 0.859 against 0.922 / 0.829 for the dense Gauss-Newton, but
        conv 0.170 against 0.468: for a model trained to a minimum of a weight-decayed objective).
        The LM columns are at the block-only layers. Since the language tasks' default layers
        include a small vocabulary's embedding/head (``ga.options(vocabulary_layers_max)``),
        ``text`` / ``instruct`` / ``llama`` at these defaults: 0.664 / 0.714 / 0.480
        (docs/fidelity.md, "The vocabulary layers in the LM default").
        ``curvature="auto"``'s dense choice since issue 31 (2026-12-06), LDS against the previous
        default (the dense Gauss-Newton at 1 × mean), r = 1 fixed before the last three settings were
        scored (docs/fidelity.md, "The formed Hessian where the model is near a minimum"):

        ===========================  ======  =====  =====  ========  ========  =======  =====  =====
        dense curvature              logreg  mlp    conv   mlp_gelu  mlp_adam  conv_wd  worst  mean
        ===========================  ======  =====  =====  ========  ========  =======  =====  =====
        Gauss-Newton (previous)      0.922   0.829  0.468  0.668     0.564     0.756    0.468  0.701
        formed Hessian everywhere    0.940   0.859  0.170  0.685     0.547     0.780    0.170  0.664
        near a minimum (the default) 0.940   0.859  0.468  0.685     0.564     0.780    0.468  0.716
        ===========================  ======  =====  =====  ========  ========  =======  =====  =====

        (conv's 0.170: the earlier run of the same recipe. The rule took the Hessian on logreg, mlp,
        mlp_gelu, conv_wd: −μ_min / mean 0, 0.51, 0.29, 0.43; the Gauss-Newton on conv and mlp_adam:
        25 and ≥ 1.6, proved by the Lanczos bound.)
        ``"auto"``: λ_b for each block from its own eigenvalues (:data:`AUTO_DAMPING`,
        :mod:`gradalg.linalg.autodamp`; explicit H only), or a ``ga.linalg.DampingRule(kind,
        value)`` to pick the rule.
    curvature_data : examples a named H is estimated on (default: ``train``).
    weight_decay : the training objective's L2 coefficient (its Hessian is wd·I).
    optimizer : the optimizer that trained the model (torch SGD / Adam / AdamW, or a
        transformers Trainer): its weight decay is read per parameter (module docs).
    data_weight : c (default 1): the model was trained with every example at weight c in a
        sum-normalised objective (e.g. at c = α, the mean of retraining on α-subsets; the same
        training with weight decay wd/c): scores ``(1/c) P(Q) @ (H + λI + wd/c)⁻¹ @ P(G).T``,
        −n ∂f/∂ε_i at ε = c·1 (module docs, "Data weight").
    query_gradient_rank : None (default) exact; r: each preconditioned query's (out, in) blocks
        replaced by their best rank-r approximation (Kronfluence's ``query_gradient_low_rank``),
        ``(Q @ H⁻¹).low_rank(r) @ G.T``: the held query side keeps r·(out + in) numbers per
        block instead of out·in (:mod:`gradalg.expr.lowrank`; the plan shows both sizes).
    **curvature_options : the knobs of a *named* curvature, kept as keywords for compatibility
        (:data:`CURVATURE_OPTIONS`; an Operator carries its own, and only ``relative_damping`` /
        ``solver_settings`` apply to it):

        * ``structure`` : "dense" (default), "block" or "diag": the formed Fisher's structure.
        * ``rank`` (default 32) / ``seed`` (default 0): Arnoldi's kept eigenvectors and its
          start; ``seed`` also draws the sampled labels of a Gauss-Newton.
        * ``solver_settings`` : CG / LiSSA settings (``max_iter``, ``rtol``, ``scale``, ...).
        * ``relative_damping`` : the factor of the default damping.
        * ``covariance_max_examples`` : K-FAC / EK-FAC only: the Kronecker covariances from the
          first m examples of the curvature data (Kronfluence's option of the same name; None:
          all, exact; m ≥ n: all). A clear ``ValueError`` for other curvatures.
        * ``lambda_max_examples`` : EK-FAC only: the eigenvalue correction from the first m examples.
    """
    G = grads(task, train, layers)
    Q = grads(task, queries, layers)
    if projector is not None:
        G, Q = check_projector(projector)(G), projector(Q)
    if isinstance(curvature, Operator) and curvature_data is not None:
        raise OptionError("curvature_data= is the data of a named curvature; an Operator given as curvature= "
                          "is already built from its data: drop curvature_data=")
    Hinv = curvature_operator(task, train if curvature_data is None else curvature_data, layers=layers,
                              projector=projector, curvature=curvature, solver=solver, damping=damping,
                              train_grads=G if curvature_data is None else None, weight_decay=weight_decay,
                              optimizer=optimizer, data_weight=data_weight, **curvature_options)
    S = (Q @ Hinv).low_rank(query_gradient_rank) @ G.T if query_gradient_rank is not None else Q @ Hinv @ G.T
    c = check_data_weight(data_weight)
    return S if c == 1.0 else S / c
