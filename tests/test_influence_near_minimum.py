"""``curvature="near_minimum"`` (issue 31): the formed Hessian where the model is near a minimum
of its objective, −μ_min(H̄ + decay) ≤ r × tr(G)/dim (``ga.options(hessian_negative_ratio)``),
else the dense Gauss-Newton; decided when it runs, by a Lanczos bound first and the formed
Hessian's eigenvalues after. Every number the decision reads is checked against
``torch.func.hessian`` + ``torch.linalg.eigvalsh`` and a Gauss-Newton built from
``torch.func.jacrev``; the scores against a dense solve of the same matrix."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, hessian, jacrev, vmap

import gradalg as ga
from gradalg.errors import OptionError
from gradalg.expr import curvature as curvature_nodes
from gradalg.expr.curvature import PROBES
from gradalg.plan.decisions import DecisionKind
from gradalg.testing import assert_close
from models import classification_data, mlp

WD = 1e-2


class Flat:
    """A model's parameters as one flat vector θ (named_parameters order) and the dense references."""

    def __init__(self, model, train, queries):
        self.model, (self.X, self.y), (self.Xq, self.yq) = model, train, queries
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.theta = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])

    def params(self, theta):
        out, i = {}, 0
        for name, shape in zip(self.names, self.shapes):
            k = math.prod(shape)
            out[name] = theta[i:i + k].reshape(shape)
            i += k
        return out

    def logits(self, theta, X):
        return functional_call(self.model, self.params(theta), (X,))

    def mean_loss(self, theta):                          # H̄ = ∇² of (1/n) Σ ℓ_i
        return F.cross_entropy(self.logits(theta, self.X), self.y)

    def hessian(self):                                   # (d, d)
        return hessian(self.mean_loss)(self.theta)

    def gauss_newton(self):                              # (d, d): (1/n) Σ J_iᵀ (diag p − p pᵀ) J_i
        J = vmap(lambda x: jacrev(lambda t: self.logits(t, x[None])[0])(self.theta))(self.X)   # (n, C, d)
        p = torch.softmax(self.logits(self.theta, self.X), 1)                                  # (n, C)
        A = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]                                 # (n, C, C)
        return torch.einsum("ncd,nce,nef->df", J, A, J) / len(self.X)

    def grads(self, X, y):                               # (n, d) per-example loss gradients
        one = lambda t, x, c: F.cross_entropy(self.logits(t, x[None]), c[None])
        return vmap(torch.func.grad(one), in_dims=(None, 0, 0))(self.theta, X, y)

    def scores(self, M):                                 # (n_query, n_train): Q M⁻¹ Gᵀ
        Q, G = self.grads(self.Xq, self.yq), self.grads(self.X, self.y)
        return Q @ torch.linalg.solve(M, G.T)


def hessian_reference(H, decay=0.0, factor=0.3):
    """The formed Hessian's default damping: H + decay shifted to PSD + 0.3 × its mean (negatives as 0)."""
    A = H + decay * torch.eye(len(H), dtype=H.dtype)
    mu = torch.linalg.eigvalsh(A)
    return A + (max(0.0, -float(mu.min())) + factor * float(mu.clamp_min(0).mean())) * torch.eye(len(H), dtype=H.dtype)


def logreg_at_its_minimum():
    """Multinomial logistic regression trained by Newton's method to max |∇J| < 1e-12 on
    J = (1/n) Σ CE + (wd/2)‖θ‖²: an exact minimiser, H̄ + wd ≻ 0."""
    torch.manual_seed(0)
    model = nn.Linear(8, 3).double()
    X, y = classification_data(n=24)
    flat = Flat(model, (X[:20], y[:20]), (X[20:], y[20:]))
    J = lambda t: flat.mean_loss(t) + WD / 2 * (t ** 2).sum()
    theta = flat.theta.clone()
    for _ in range(50):
        g = torch.func.grad(J)(theta)
        if g.abs().max() < 1e-12:
            break
        theta = theta - torch.linalg.solve(hessian(J)(theta), g)
    assert torch.func.grad(J)(theta).abs().max() < 1e-12
    with torch.no_grad():
        for (_, p), v in zip(model.named_parameters(), flat.params(theta).values()):
            p.copy_(v)
    return Flat(model, (X[:20], y[:20]), (X[20:], y[20:]))


def far_from_a_minimum():
    """An 8 → 64 → 3 tanh MLP at its random initialisation: H̄ strongly indefinite (771
    coordinates: forming the Hessian takes 4 calls of 256 products, so the probe may take 4 steps)."""
    X, y = classification_data(n=24)
    return Flat(mlp(hidden=64), (X[:20], y[:20]), (X[20:], y[20:]))


def run(flat, **kwargs):
    """(scores (n_query, n_train), the probe, the plan's CURVATURE decision before and after the run)."""
    PROBES.clear()
    S = ga.methods.influence(ga.tasks.classification(flat.model), (flat.X, flat.y), (flat.Xq, flat.yq),
                             curvature="near_minimum", **kwargs)
    before = S.explain().plan.decisions.one(DecisionKind.CURVATURE)
    values = torch.as_tensor(S.compute().transpose("query", "train").values)
    (probe,) = PROBES.values()
    after = S.explain().plan.decisions.one(DecisionKind.CURVATURE)
    return values, probe, before, after


def test_at_an_exact_minimiser_the_hessian_is_chosen_from_its_own_numbers():
    flat = logreg_at_its_minimum()
    H, Gn = flat.hessian(), flat.gauss_newton()
    values, probe, before, after = run(flat, weight_decay=WD)
    mu = torch.linalg.eigvalsh(H + WD * torch.eye(len(H), dtype=H.dtype))
    assert probe.chosen == "dense_hessian" and probe.exact               # a Ritz value cannot rule it out
    assert probe.mu_min == pytest.approx(float(mu.min()), abs=1e-12)     # = wd + μ_min(H̄) > 0
    assert probe.mu_min > 0.99 * WD
    assert probe.scale == pytest.approx(float(torch.trace(Gn)) / len(H), rel=1e-10)
    assert probe.hessian_mean == pytest.approx(float(mu.mean()), rel=1e-10)
    assert probe.ratio == pytest.approx(-probe.mu_min / probe.scale, rel=1e-12) and probe.ratio < 0
    assert_close(values, flat.scores(hessian_reference(H, WD)), rtol=1e-8, atol=1e-12)
    # the plan: the rule before the run, the measured numbers after it
    assert before.chosen == "decided when run" and "hessian_negative_ratio=1" in before.reason
    # ... and that the Gauss-Newton is taken where the Hessian's damped, PSD-shifted matrix is singular
    assert "the Gauss-Newton too where the rule picks the Hessian but the Hessian damped and shifted to PSD" \
        in before.reason and "is singular (smallest eigenvalue ≤ 1e-15 × the largest" in before.reason, before.reason
    assert after.chosen == "dense_hessian"
    assert f"−μ_min / mean = {probe.ratio:.3g} ≤ r = 1" in after.reason


def test_far_from_a_minimum_a_lanczos_bound_picks_the_gauss_newton_without_forming_the_hessian(monkeypatch):
    flat = far_from_a_minimum()
    H, Gn = flat.hessian(), flat.gauss_newton()
    formed = []
    resolve = curvature_nodes.Formed.resolve
    monkeypatch.setattr(curvature_nodes.Formed, "resolve", lambda self, ctx: formed.append(1) or resolve(self, ctx))
    values, probe, _, after = run(flat)
    assert probe.chosen == "gauss_newton" and not probe.exact and formed == []
    mu_min = float(torch.linalg.eigvalsh(H).min())
    scale = float(torch.trace(Gn)) / len(H)
    assert probe.scale == pytest.approx(scale, rel=1e-10)
    assert mu_min - 1e-10 <= probe.mu_min < -scale                      # a Ritz value: never below μ_min
    M = Gn + scale * torch.eye(len(H), dtype=H.dtype)                   # the Gauss-Newton at 1 × mean
    assert_close(values, flat.scores(M), rtol=1e-8, atol=1e-12)
    assert after.chosen == "gauss_newton" and "Lanczos, " in after.reason and "of up to 4 products" in after.reason
    # no probe: the formed Hessian's exact μ_min decides, the same way
    with ga.options(hessian_probe_iterations=0):
        values0, probe0, _, _ = run(flat)
    assert probe0.exact and probe0.chosen == "gauss_newton" and formed
    assert probe0.mu_min == pytest.approx(mu_min, rel=1e-10)
    assert probe0.hessian_mean == pytest.approx(float(torch.trace(H)) / len(H), rel=1e-10)
    assert_close(values0, values, rtol=1e-12, atol=0)


def test_the_ratio_is_an_option_and_curvature_overrides_the_rule():
    flat = far_from_a_minimum()
    H = flat.hessian()
    with ga.options(hessian_negative_ratio=float("inf")):               # always the Hessian
        values, probe, _, after = run(flat)
    assert probe.chosen == "dense_hessian" and "r = inf" in after.reason
    assert_close(values, flat.scores(hessian_reference(H)), rtol=1e-8, atol=1e-12)
    # at the ratio the data measured, the decision flips exactly there
    with ga.options(hessian_probe_iterations=0):
        _, exact, _, _ = run(flat)
    with ga.options(hessian_probe_iterations=0, hessian_negative_ratio=exact.ratio * 1.001):
        assert run(flat)[1].chosen == "dense_hessian"
    with ga.options(hessian_probe_iterations=0, hessian_negative_ratio=exact.ratio * 0.999):
        assert run(flat)[1].chosen == "gauss_newton"
    # a curvature by name is never decided
    task, train, queries = ga.tasks.classification(flat.model), (flat.X, flat.y), (flat.Xq, flat.yq)
    named = ga.methods.influence(task, train, queries, curvature="dense_hessian").compute()
    assert_close(torch.as_tensor(named.transpose("query", "train").values), values, rtol=1e-10, atol=0)
    assert not ga.methods.influence(task, train, queries, curvature="gauss_newton").explain().plan.decisions.of(
        DecisionKind.CURVATURE)


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(OptionError, match="hessian_negative_ratio must be a number >= 0"):
        ga.options(hessian_negative_ratio=-1.0)
    with pytest.raises(OptionError, match="hessian_probe_iterations must be an int >= 0"):
        ga.options(hessian_probe_iterations=1.5)
    flat = far_from_a_minimum()
    task, train, queries = ga.tasks.classification(flat.model), (flat.X, flat.y), (flat.Xq, flat.yq)
    with pytest.raises(OptionError, match="projector .* Use curvature='gauss_newton'"):
        ga.methods.influence(task, train, queries, curvature="near_minimum", projector=ga.proj.gaussian(12, seed=0))
    with pytest.raises(OptionError, match="solver='cg'"):
        ga.methods.influence(task, train, queries, curvature="near_minimum", solver="cg")


def test_lanczos_min_is_a_ritz_bound_that_reaches_the_smallest_eigenvalue():
    from gradalg.linalg.solvers import lanczos_min
    g = torch.Generator().manual_seed(0)
    A = torch.randn(40, 40, generator=g, dtype=torch.float64)
    H = (A + A.T) / 2                                               # (40, 40), indefinite
    mu = float(torch.linalg.eigvalsh(H).min())
    calls = []
    matvec = lambda V: calls.append(len(V)) or V @ H
    thetas = [lanczos_min(matvec, 40, k)[0] for k in (1, 5, 10, 40)]
    assert all(t >= mu - 1e-10 for t in thetas) and thetas == sorted(thetas, reverse=True)
    assert thetas[-1] == pytest.approx(mu, abs=1e-9)                # the full Krylov space: exact
    calls.clear()
    theta, steps = lanczos_min(matvec, 40, 40, stop_below=thetas[1])  # stops once the bound is proved
    assert theta < thetas[1] and steps == len(calls) < 40


class _TanhNoJvp(torch.autograd.Function):
    """tanh as a custom Function with a backward and no jvp: torch.func.jvp cannot pass it."""

    @staticmethod
    def forward(x):
        return x.tanh()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class _NoJvp(nn.Module):
    def forward(self, x):
        return _TanhNoJvp.apply(x)


def test_a_model_without_forward_ad_gets_the_gauss_newton_and_the_plan_says_why():
    """The Hessian's products need forward-mode AD; a model running an op without a rule for it
    (here a custom autograd.Function with no jvp) gets the Gauss-Newton under ``"auto"`` — the
    scores of ``curvature="gauss_newton"``, exactly — and the decision names the cause. Asked for
    by name, the Hessian raises the typed :class:`~gradalg.NoForwardADError` whose fix works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), _NoJvp(), nn.Linear(8, 3)).double()
    X, y = torch.randn(40, 6, dtype=torch.float64), torch.randint(0, 3, (40,))
    task = ga.tasks.classification(model)
    train, queries = (X, y), (X[:3], y[:3])
    S = ga.methods.influence(task, train, queries)
    auto = torch.as_tensor(S.compute().values)
    gn = torch.as_tensor(ga.methods.influence(task, train, queries, curvature="gauss_newton").compute().values)
    assert_close(auto, gn, rtol=1e-12, atol=1e-12)
    d = S.explain().plan.decisions.one(DecisionKind.CURVATURE)
    assert d.chosen == "gauss_newton" and "forward-mode AD" in d.reason and "autograd.Function" in d.reason
    with pytest.raises(ga.NoForwardADError, match="curvature='gauss_newton'"):
        ga.methods.influence(task, train, queries, curvature="hessian").compute()
