"""RelatIF under the near-minimum rule (issue 31, session 43): ``curvature="near_minimum"``
damps its two sides separately (``curvature_operator(gauss_newton_damping=...)``): influence
keeps one damping for both (its numbers unchanged), RelatIF's default takes the formed
Hessian shifted to PSD + 0.3 × its mean eigenvalue (``DENSE_HESSIAN_DAMPING``) near a
minimum and the dense Gauss-Newton + λ of the mass-0.95 rule on its pooled spectrum
(``DENSE_DAMPING``) off one. Every score is checked against a dense ``torch.func``
reference: ``torch.func.hessian``, a Gauss-Newton from ``torch.func.jacrev``,
``torch.linalg.eigvalsh`` for λ and ``torch.linalg.solve``."""
from __future__ import annotations

import importlib

import pytest
import torch

import gradalg as ga
from gradalg.errors import OptionError
from gradalg.expr.curvature import PROBES
from gradalg.methods.influence import curvature_operator
from gradalg.testing import assert_close
from models import classification_data, mlp
from test_influence_near_minimum import WD, Flat, far_from_a_minimum, hessian_reference

relatif_module = importlib.import_module("gradalg.methods.relatif")   # the name is shadowed by the method


def mlp_near_its_minimum():
    """An 8 → 6 → 3 tanh MLP (75 coordinates) trained by Newton steps on
    J = (1/n) Σ CE + (wd/2)‖θ‖² to max |∇J| < 1e-10: near a minimum, H̄ + wd ≻ 0."""
    X, y = classification_data(n=24)
    flat = Flat(mlp(hidden=6), (X[:20], y[:20]), (X[20:], y[20:]))
    J = lambda t: flat.mean_loss(t) + WD / 2 * (t ** 2).sum()
    theta, mu, eye = flat.theta.clone(), 1.0, torch.eye(len(flat.theta), dtype=flat.theta.dtype)
    for _ in range(500):                          # Levenberg-Marquardt: a step only where J decreases
        g = torch.func.grad(J)(theta)
        if g.abs().max() < 1e-10:
            break
        Hj = torch.func.hessian(J)(theta)
        shift = max(0.0, -float(torch.linalg.eigvalsh(Hj).min()))
        step = theta - torch.linalg.solve(Hj + (shift + mu) * eye, g)
        if J(step) < J(theta):
            theta, mu = step, mu / 10
        else:
            mu *= 10
    assert torch.func.grad(J)(theta).abs().max() < 1e-10
    with torch.no_grad():
        for (_, p), v in zip(flat.model.named_parameters(), flat.params(theta).values()):
            p.copy_(v)
    return Flat(flat.model, (flat.X, flat.y), (flat.Xq, flat.yq))


def mass_lambda(M, q=0.95):
    """The mass rule on M's pooled spectrum: μ_(k), k the fewest largest eigenvalues holding q of Σμ⁺."""
    mu = torch.linalg.eigvalsh(M).clamp_min(0).sort(descending=True).values
    total, running = float(mu.sum()), 0.0
    for value in mu.tolist():
        running += value
        if running >= q * total * (1 - 1e-12):
            return value
    return float(mu[-1])


def relatif_reference(flat, M):
    """(n_query, n_train): ⟨q, M⁻¹ g⟩ / √⟨g, M⁻¹ g⟩."""
    Q, G = flat.grads(flat.Xq, flat.yq), flat.grads(flat.X, flat.y)
    MiG = torch.linalg.solve(M, G.T)                                   # (d, n_train)
    return (Q @ MiG) / torch.sqrt((G.T * MiG).sum(0))[None, :]


def _values(S):
    return torch.as_tensor(S.compute().transpose("query", "train").values)


def _call(method, flat, **kwargs):
    PROBES.clear()
    S = getattr(ga.methods, method)(ga.tasks.classification(flat.model), (flat.X, flat.y), (flat.Xq, flat.yq),
                                    **kwargs)
    values = _values(S)
    (probe,) = PROBES.values()
    return values, probe


@pytest.mark.parametrize("where", ["near", "far"])
def test_influence_keeps_its_numbers_with_one_damping_on_both_sides(where):
    """Influence passes its damping to both sides: its near-minimum scores are those of the side the rule
    takes asked for by name and of the torch.func reference; the two-sided knob given the same damping
    twice is, bit for bit, the one-damping call. (Against the code before the knob, main at 25cf6f2, the
    scores of both cases were compared bit for bit by a script run in both trees: equal.)"""
    flat, kw = (mlp_near_its_minimum(), {"weight_decay": WD}) if where == "near" else (far_from_a_minimum(), {})
    values, probe = _call("influence", flat, curvature="near_minimum", **kw)
    assert probe.chosen == ("dense_hessian" if where == "near" else "gauss_newton")
    task, train, queries = ga.tasks.classification(flat.model), (flat.X, flat.y), (flat.Xq, flat.yq)
    named = _values(ga.methods.influence(task, train, queries, curvature=probe.chosen, **kw))
    assert_close(values, named, rtol=1e-10, atol=0)
    G, Q = ga.grads(task, train), ga.grads(task, queries)
    one = _values(ga.methods.influence(task, train, queries, curvature="near_minimum", damping=0.05, **kw))
    both = _values(Q @ curvature_operator(task, train, curvature="near_minimum", damping=0.05,
                                          gauss_newton_damping=0.05, weight_decay=kw.get("weight_decay")) @ G.T)
    assert torch.equal(one, both)
    H, Gn = flat.hessian(), flat.gauss_newton()
    M = (hessian_reference(H, WD) if where == "near" else
         Gn + float(torch.trace(Gn)) / len(Gn) * torch.eye(len(Gn), dtype=Gn.dtype))    # Gauss-Newton, 1 × mean
    assert_close(values, flat.scores(M), rtol=1e-8, atol=1e-12)
    # given explicitly, the Gauss-Newton side's damping is that side's alone: the Hessian side keeps its default
    Hinv = curvature_operator(task, train, curvature="near_minimum", gauss_newton_damping=0.5,
                              weight_decay=kw.get("weight_decay"))
    PROBES.clear()
    side = _values(Q @ Hinv @ G.T)
    (p,) = PROBES.values()
    assert p.chosen == probe.chosen
    M = (hessian_reference(H, WD) if where == "near" else Gn + 0.5 * torch.eye(len(Gn), dtype=Gn.dtype))
    assert_close(side, flat.scores(M), rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("where", ["near", "far"])
def test_relatif_near_minimum_damps_each_side_by_its_own_default(where):
    """RelatIF's default damping under the rule: the Hessian (+ wd) shifted to PSD + 0.3 × mean near a
    minimum; the Gauss-Newton + λ(mass 0.95, pooled) + wd off one — against torch.func."""
    flat = mlp_near_its_minimum() if where == "near" else far_from_a_minimum()
    values, probe = _call("relatif", flat, curvature="near_minimum", weight_decay=WD)
    H, Gn = flat.hessian(), flat.gauss_newton()
    eye = torch.eye(len(H), dtype=H.dtype)
    if where == "near":
        assert probe.chosen == "dense_hessian"
        M = hessian_reference(H, WD)
    else:
        assert probe.chosen == "gauss_newton"
        M = Gn + (mass_lambda(Gn) + WD) * eye           # λ from the Gauss-Newton's own spectrum, decay on top
    assert_close(values, relatif_reference(flat, M), rtol=1e-8, atol=1e-12)
    # the Gauss-Newton side is RelatIF's, not influence's 1 × mean: the two differ here
    if where == "far":
        other = Gn + (float(torch.trace(Gn)) / len(Gn) + WD) * eye
        assert (values - relatif_reference(flat, other)).abs().max() > 1e-3 * values.abs().max()


def test_relatif_default_curvature_is_the_chosen_dense_rule():
    """``curvature="auto"`` on a small model: RelatIF's :data:`DENSE_AUTO` with its default damping,
    the scores of that curvature by name."""
    flat = mlp_near_its_minimum()
    task, train, queries = ga.tasks.classification(flat.model), (flat.X, flat.y), (flat.Xq, flat.yq)
    auto = _values(ga.methods.relatif(task, train, queries, weight_decay=WD))
    named = _values(ga.methods.relatif(task, train, queries, weight_decay=WD,
                                       curvature=relatif_module.DENSE_AUTO))
    assert torch.equal(auto, named)
    H, Gn = flat.hessian(), flat.gauss_newton()
    M = (hessian_reference(H, WD) if relatif_module.DENSE_AUTO == "near_minimum" else
         Gn + (mass_lambda(Gn) + WD) * torch.eye(len(Gn), dtype=Gn.dtype))
    assert_close(auto, relatif_reference(flat, M), rtol=1e-8, atol=1e-12)


def test_an_absolute_damping_under_the_rule_keeps_the_decay_a_term():
    """RelatIF with a given λ: the Hessian + wd shifted to PSD, then + λ (the decay is not folded into λ,
    which would shift H̄ alone and test −μ_min(H̄) instead of −μ_min(H̄ + wd))."""
    flat = mlp_near_its_minimum()
    values, probe = _call("relatif", flat, curvature="near_minimum", weight_decay=WD, damping=1e-2)
    assert probe.chosen == "dense_hessian" and probe.mu_min > 0
    H = flat.hessian()
    A = H + WD * torch.eye(len(H), dtype=H.dtype)
    shift = max(0.0, -float(torch.linalg.eigvalsh(A).min()))
    assert_close(values, relatif_reference(flat, A + (shift + 1e-2) * torch.eye(len(H), dtype=H.dtype)),
                 rtol=1e-8, atol=1e-12)


def test_gauss_newton_damping_with_another_curvature_is_refused():
    flat = far_from_a_minimum()
    with pytest.raises(OptionError, match="gauss_newton_damping= .* curvature is 'gauss_newton'"):
        curvature_operator(ga.tasks.classification(flat.model), (flat.X, flat.y), curvature="gauss_newton",
                           gauss_newton_damping=0.5)
