"""``influence(..., data_weight=c)``: the derivative of a query's loss in the data weights at
ε = c·1, for a model trained there — against implicit differentiation with the dense
torch.func Hessian of the weighted objective and against finite differences of retraining
with one example's weight moved."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian

import gradalg as ga

from models import classification_data, mlp
from references import one_thread  # noqa: F401 - autouse fixture

WD, C = 0.05, 0.5


@pytest.fixture(scope="module")
def setting():
    X, y = classification_data(n=36, d_in=4, classes=3)
    model = mlp(d_in=4, hidden=3, classes=3, seed=0)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]

    def unflat(theta):
        return {n: t.reshape(s) for n, t, s in zip(names, theta.split(sizes), shapes)}

    def losses(theta, X_, y_):
        return F.cross_entropy(functional_call(model, unflat(theta), (X_,)), y_, reduction="none")

    train, query = (X[:30], y[:30]), (X[30:], y[30:])
    n = len(train[0])

    def objective(theta, eps):
        """J(θ; ε) = (1/n) Σ ε_i ℓ_i + (wd/2)‖θ‖²."""
        return (eps * losses(theta, *train)).sum() / n + WD / 2 * (theta ** 2).sum()

    def fit(eps, theta, lbfgs=False):
        """Newton's method on J(·; ε) from ``theta`` (after L-BFGS from afar) to |∇J| < 1e-12."""
        if lbfgs:
            theta = theta.clone().requires_grad_(True)
            opt = torch.optim.LBFGS([theta], lr=1, max_iter=2000, tolerance_grad=1e-9, tolerance_change=0,
                                    history_size=50, line_search_fn="strong_wolfe")

            def closure():
                opt.zero_grad()
                value = objective(theta, eps)
                value.backward()
                return value

            opt.step(closure)
            theta = theta.detach()
        for _ in range(50):
            g = grad(objective)(theta, eps)
            if g.abs().max() < 1e-12:
                return theta
            step = torch.linalg.solve(hessian(objective)(theta, eps), g)
            t = 1.0
            while objective(theta - t * step, eps) > objective(theta, eps) + 1e-15 and t > 1e-8:
                t /= 2
            theta = theta - t * step
        raise RuntimeError("Newton's method did not converge")

    theta0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    theta_full = fit(torch.ones(n, dtype=X.dtype), theta0, lbfgs=True)
    theta_c = fit(torch.full((n,), C, dtype=X.dtype), theta_full, lbfgs=True)
    at_c = mlp(d_in=4, hidden=3, classes=3, seed=0)
    torch.nn.utils.vector_to_parameters(theta_c, at_c.parameters())
    return dict(train=train, query=query, n=n, losses=losses, objective=objective, fit=fit,
                theta_c=theta_c, model=at_c, task=ga.tasks.classification(at_c))


def reference(s) -> np.ndarray:
    """S_qz = ∇f_qᵀ (∇²J(θ_c; c·1))⁻¹ ∇ℓ_z = −n ∂f_q/∂ε_z (implicit function theorem)."""
    theta, eps = s["theta_c"], torch.full((s["n"],), C, dtype=torch.float64)
    H = hessian(s["objective"])(theta, eps)
    G = torch.func.jacrev(s["losses"])(theta, *s["train"])            # (n_train, dim)
    Q = torch.func.jacrev(s["losses"])(theta, *s["query"])            # (n_query, dim)
    return (Q @ torch.linalg.solve(H, G.T)).numpy()


def values(S) -> np.ndarray:
    return np.asarray(S.compute().values)


def test_scores_are_the_derivative_at_the_weighted_optimum(setting):
    S = ga.methods.influence(setting["task"], setting["train"], setting["query"], curvature="hessian",
                             solver="cg", damping=0.0, weight_decay=WD, data_weight=C,
                             solver_settings=dict(rtol=1e-9))
    want = reference(setting)
    np.testing.assert_allclose(values(S), want, rtol=1e-6, atol=1e-8 * np.abs(want).max())
    # without the data weight the same model gets other numbers (wd is not divided, no 1/c)
    plain = ga.methods.influence(setting["task"], setting["train"], setting["query"], curvature="hessian",
                                 solver="cg", damping=0.0, weight_decay=WD, solver_settings=dict(rtol=1e-9))
    assert np.abs(values(plain) - want).max() > 0.1 * np.abs(want).max()


def test_scores_match_finite_differences_of_retraining(setting):
    """−n (f(θ(c·1 + h e_z)) − f(θ(c·1 − h e_z))) / 2h for two training examples."""
    S = values(ga.methods.influence(setting["task"], setting["train"], setting["query"], curvature="hessian",
                                    solver="cg", damping=0.0, weight_decay=WD, data_weight=C,
                                    solver_settings=dict(rtol=1e-9)))
    n, h = setting["n"], 1e-4
    for z in (0, 17):
        moved = []
        for sign in (1.0, -1.0):
            eps = torch.full((n,), C, dtype=torch.float64)
            eps[z] += sign * h
            theta = setting["fit"](eps, setting["theta_c"])
            moved.append(setting["losses"](theta, *setting["query"]).detach().numpy())
        fd = -n * (moved[0] - moved[1]) / (2 * h)
        np.testing.assert_allclose(S[:, z], fd, rtol=1e-5, atol=1e-7 * np.abs(fd).max())


def test_data_weight_divides_the_decay_and_the_scores(setting):
    args = (setting["task"], setting["train"], setting["query"])
    weighted = ga.methods.influence(*args, damping=0.01, weight_decay=WD, data_weight=C)
    by_hand = ga.methods.influence(*args, damping=0.01, weight_decay=WD / C) / C
    np.testing.assert_allclose(values(weighted), values(by_hand), rtol=1e-12)
    assert f"weight_decay={WD:g} (given) / data weight {C:g}" in str(weighted.explain(stage="simplified"))
    # read from the optimizer: the same term, divided the same way
    opt = torch.optim.SGD(setting["model"].parameters(), lr=0.1, weight_decay=WD)
    from_opt = ga.methods.influence(*args, damping=0.01, optimizer=opt, data_weight=C)
    np.testing.assert_allclose(values(from_opt), values(weighted), rtol=1e-12)
    assert "/ data weight 0.5" in str(from_opt.explain(stage="simplified"))
    # c = 1 is the default expression
    assert ga.methods.influence(*args, weight_decay=WD, data_weight=1).expr == \
        ga.methods.influence(*args, weight_decay=WD).expr


@pytest.mark.parametrize("bad", [0, -0.5, float("inf"), float("nan"), "half"])
def test_bad_data_weight_is_refused_by_name(setting, bad):
    with pytest.raises(ValueError, match="data_weight must be"):
        ga.methods.influence(setting["task"], setting["train"], setting["query"], data_weight=bad)


@pytest.mark.parametrize("variant", ["ekfac", "datainf", "projected gauss_newton", "cg gauss_newton"])
def test_every_curvature_takes_the_data_weight_the_same_way(setting, variant):
    """K-FAC/EK-FAC, DataInf, a projected space and a products-only solver: the decay is
    divided and the scores scaled by the same rule as the dense Gauss-Newton."""
    kwargs = {"ekfac": dict(curvature="ekfac"), "datainf": dict(curvature="datainf"),
              "projected gauss_newton": dict(projector=ga.proj.gaussian(8, seed=0)),
              "cg gauss_newton": dict(solver="cg", solver_settings=dict(rtol=1e-10))}[variant]
    args = (setting["task"], setting["train"], setting["query"])
    weighted = values(ga.methods.influence(*args, damping=0.01, weight_decay=WD, data_weight=C, **kwargs))
    by_hand = values(ga.methods.influence(*args, damping=0.01, weight_decay=WD / C, **kwargs)) / C
    np.testing.assert_allclose(weighted, by_hand, rtol=1e-8, atol=1e-12 * np.abs(by_hand).max())


def test_a_per_coordinate_decay_stays_refused_where_it_has_no_exact_form(setting):
    """Divided by c, AdamW's wd·diag(√v̂ + ε) is still per coordinate: K-FAC refuses it."""
    model = setting["model"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    opt.zero_grad()
    F.cross_entropy(model(setting["train"][0]), setting["train"][1]).backward()
    opt.step()
    try:
        with pytest.raises(ga.objective.ObjectiveError, match="differs between coordinates"):
            ga.methods.influence(setting["task"], setting["train"], setting["query"], curvature="kfac",
                                 optimizer=opt, data_weight=C)
    finally:
        torch.nn.utils.vector_to_parameters(setting["theta_c"], model.parameters())   # the fixture's model
