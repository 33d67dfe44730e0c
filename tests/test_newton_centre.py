"""``ga.methods.newton_centre``: Newton steps from the trained model to the minimiser of the
objective at data weight c, J(θ; c) = (c/n) Σ ℓ_i + (wd/2)‖θ‖² — against the minimiser found
by Newton's method on the dense torch.func Hessian (multinomial logistic regression: convex,
so the steps land on it), and the first step against the closed-form Newton step."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, hessian

import gradalg as ga
from gradalg.errors import ObjectiveError, OptionError

from models import classification_data
from references import one_thread  # noqa: F401 - autouse fixture

WD, C = 0.05, 0.5


def _flat(model):
    return torch.cat([model.weight.detach().reshape(-1), model.bias.detach()])


@pytest.fixture(scope="module")
def setting():
    X, y = classification_data(n=40, d_in=5, classes=3)
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()

    def objective(theta, c):
        W, b = theta[:15].reshape(3, 5), theta[15:]
        return c * F.cross_entropy(X @ W.T + b, y) + WD / 2 * (theta ** 2).sum()

    def minimise(c, theta):
        for _ in range(100):
            g = grad(objective)(theta, c)
            if g.abs().max() < 1e-13:
                return theta
            theta = theta - torch.linalg.solve(hessian(objective)(theta, c), g)
        raise RuntimeError("Newton's method did not converge")

    theta_full = minimise(1.0, _flat(model))
    with torch.no_grad():
        model.weight.copy_(theta_full[:15].reshape(3, 5))
        model.bias.copy_(theta_full[15:])
    return dict(task=ga.tasks.classification(model), train=(X, y), objective=objective, theta_full=theta_full,
                theta_c=minimise(C, theta_full), model=model)


def test_steps_land_on_the_minimiser_at_the_data_weight(setting):
    moved = ga.methods.newton_centre(setting["task"], setting["train"], data_weight=C, weight_decay=WD, steps=6)
    np.testing.assert_allclose(_flat(moved.model).numpy(), setting["theta_c"].numpy(), rtol=1e-9, atol=1e-11)
    # the given model is not touched
    np.testing.assert_array_equal(_flat(setting["model"]).numpy(), setting["theta_full"].numpy())
    assert float((setting["theta_c"] - setting["theta_full"]).norm()) > 0.05     # a real move


def test_one_step_is_the_newton_step(setting):
    """θ* − (c H + wd I)⁻¹ (c ḡ + wd θ*) with the exact Hessian (a full step decreases J here)."""
    theta, obj = setting["theta_full"], setting["objective"]
    want = theta - torch.linalg.solve(hessian(obj)(theta, C), grad(obj)(theta, C))
    moved = ga.methods.newton_centre(setting["task"], setting["train"], data_weight=C, weight_decay=WD)
    np.testing.assert_allclose(_flat(moved.model).numpy(), want.numpy(), rtol=1e-10, atol=1e-12)


def test_the_centred_task_scores_as_one_trained_there(setting):
    """influence on the moved model = influence on the exact minimiser (both at data_weight=c)."""
    X, y = setting["train"]
    moved = ga.methods.newton_centre(setting["task"], setting["train"], data_weight=C, weight_decay=WD, steps=6)
    exact = nn.Linear(5, 3).double()
    with torch.no_grad():
        exact.weight.copy_(setting["theta_c"][:15].reshape(3, 5))
        exact.bias.copy_(setting["theta_c"][15:])
    kw = dict(curvature="dense_hessian", damping=0.0, weight_decay=WD, data_weight=C)
    a = ga.methods.influence(moved, (X[:30], y[:30]), (X[30:], y[30:]), **kw).compute().values
    b = ga.methods.influence(ga.tasks.classification(exact), (X[:30], y[:30]), (X[30:], y[30:]), **kw).compute().values
    np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-10)


def test_without_weight_decay_it_is_refused_by_name(setting):
    with pytest.raises(ObjectiveError, match="weight decay"):
        ga.methods.newton_centre(setting["task"], setting["train"], data_weight=C)
    with pytest.raises(ObjectiveError, match="zero"):
        ga.methods.newton_centre(setting["task"], setting["train"], data_weight=C, weight_decay=0.0)


def test_bad_arguments_are_refused(setting):
    with pytest.raises(OptionError, match="data_weight must be"):
        ga.methods.newton_centre(setting["task"], setting["train"], data_weight=0, weight_decay=WD)
    with pytest.raises(OptionError, match="steps must be"):
        ga.methods.newton_centre(setting["task"], setting["train"], data_weight=C, weight_decay=WD, steps=0)


def test_a_model_far_from_its_minimum_is_refused(setting):
    """Far from a minimum (random weights, c > 1), c H + wd I need not be positive definite;
    an MLP at its initialisation with c = 3 has negative curvature beyond wd: refused."""
    X, y = classification_data(n=40, d_in=5, classes=3)
    torch.manual_seed(3)
    mlp = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        for p in mlp.parameters():
            p.mul_(4.0)
    task = ga.tasks.classification(mlp)
    with pytest.raises(ObjectiveError, match="not positive definite"):
        ga.methods.newton_centre(task, (X, y), data_weight=3.0, weight_decay=1e-4)
