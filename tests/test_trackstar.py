"""TrackStar against a plain-torch reference of the same math: a loop of autograd for the
per-example gradients, Adam's bias-corrected v̂ read from the optimizer's state by hand, the
same projection matrix, R^{-1/2} by eigendecomposition, unit rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradalg as ga
from gradalg.methods.trackstar import mixing_coefficient
from gradalg.proj.matrices import dense_matrix

from models import classification_data, mlp
from references import one_thread  # noqa: F401 - autouse fixture

LAYERS = ["0", "2"]


@pytest.fixture(scope="module")
def setting():
    X, y = classification_data(n=40, d_in=5, classes=3)
    model = mlp(d_in=5, hidden=4, classes=3, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), eps=1e-5, weight_decay=0.01)
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()
        opt.step()
    return {"model": model, "opt": opt, "task": ga.tasks.classification(model),
            "train": (X[:24], y[:24]), "query": (X[24:30], y[24:30]), "task_data": (X[30:], y[30:])}


def layout(model, tensors: dict) -> torch.Tensor:
    """{param: tensor} in gradalg's block layout: per Linear [W | b], row-major."""
    mods = dict(model.named_modules())
    return torch.cat([torch.cat([tensors[mods[n].weight], tensors[mods[n].bias].unsqueeze(-1)], 1).flatten()
                      for n in LAYERS]).double()


def loop_grads(model, X, y) -> torch.Tensor:
    rows = []
    params = [p for n in LAYERS for p in dict(model.named_modules())[n].parameters()]
    for i in range(len(X)):
        loss = F.cross_entropy(model(X[i:i + 1]), y[i:i + 1], reduction="sum")
        g = torch.autograd.grad(loss, params)
        rows.append(layout(model, dict(zip(params, g))))
    return torch.stack(rows)                                               # (n, dim)


def reference_mix(R_train, R_task, components) -> float:
    """λ of Chang et al. §A.1.3 by hand: the c-th largest eigenvalues, λσ_task = (1 − λ)σ_train."""
    s_train = sorted(torch.linalg.eigvalsh(R_train).tolist(), reverse=True)[components - 1]
    s_task = sorted(torch.linalg.eigvalsh(R_task).tolist(), reverse=True)[components - 1]
    return s_train / (s_train + s_task)


def mass_lambda(R, q=0.95) -> float:
    """λ of damping='auto' on a dense R by hand: the k-th largest eigenvalue, k the smallest
    with the top k holding q of the trace."""
    mu = sorted(torch.linalg.eigvalsh(R).clamp_min(0).tolist(), reverse=True)
    total, run = sum(mu), 0.0
    for value in mu:
        run += value
        if run >= q * total * (1 - 1e-12):
            return value
    return mu[-1]


def reference(s, P, *, rel="auto", mix=None, correction=True, components=None, blocks=None) -> np.ndarray:
    """rel: "auto" (the default: per block b of ``blocks`` (sizes; None: one block), λ_b =
    :func:`mass_lambda` of R's diagonal block) or c (λ = c × R's mean eigenvalue)."""
    m, opt = s["model"], s["opt"]
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    v_hat = layout(m, {p: opt.state[p]["exp_avg_sq"] / (1 - beta2 ** float(opt.state[p]["step"]))
                       for p in m.parameters()})
    scale = 1 / (v_hat.sqrt() + eps) if correction else torch.ones_like(v_hat)
    Phi = [loop_grads(m, *s[side]) * scale @ P.T for side in ("train", "query", "task_data")]   # (n, k)
    R = Phi[0].T @ Phi[0] / len(Phi[0])
    if mix is not None:
        R_task = Phi[2].T @ Phi[2] / len(Phi[2])
        mix = reference_mix(R, R_task, components) if mix == "auto" else mix
        R = (1 - mix) * R + mix * R_task
    if rel == "auto":
        edges = np.cumsum([0] + list(blocks or [R.shape[0]]))
        lam = torch.cat([torch.full((b - a,), mass_lambda(R[a:b, a:b]), dtype=R.dtype)
                         for a, b in zip(edges[:-1], edges[1:])])
    else:
        lam = torch.full((R.shape[0],), rel * float(torch.trace(R)) / R.shape[0], dtype=R.dtype)
    R = R + torch.diag(lam)
    w, V = torch.linalg.eigh(R)
    W = V @ torch.diag(w ** -0.5) @ V.T                                     # R^{-1/2}
    Gz, Gq = Phi[0] @ W, Phi[1] @ W
    Gz, Gq = Gz / Gz.norm(dim=1, keepdim=True), Gq / Gq.norm(dim=1, keepdim=True)
    return (Gq @ Gz.T).numpy()


def projection_matrix(projector, G) -> torch.Tensor:
    return torch.cat([dense_matrix(projector, b.name, b.dim, dtype=torch.float64) for b in G.space.blocks], 1)


@pytest.mark.parametrize("variant", ["train R", "task-mixed R", "auto-mixed R", "no correction"])
def test_trackstar_equals_plain_torch_reference(setting, variant):
    s = setting
    k = 12
    P = ga.proj.gaussian(k, seed=3)
    kwargs = {"train R": {}, "task-mixed R": {"task_data": s["task_data"], "mix": 0.7},
              "auto-mixed R": {"task_data": s["task_data"], "mix": "auto", "downweight_components": 4},
              "no correction": {"correction": False}}[variant]
    S = ga.methods.trackstar(s["task"], s["train"], s["query"], optimizer=s["opt"], layers=LAYERS, projector=P,
                             **kwargs)
    matrix = projection_matrix(P, ga.grads(s["task"], s["train"], LAYERS))
    want = reference(s, matrix, mix=kwargs.get("mix"), correction=kwargs.get("correction", True),
                     components=kwargs.get("downweight_components"))
    got = np.asarray(S.compute().values)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)
    assert np.all(np.abs(got) <= 1 + 1e-12)                                # cosines
    text = repr(S)
    assert ("1/(√v̂ + ε) from AdamW state (ε=1e-05)" in text) == (variant != "no correction")
    assert "[default: λ_b = the eigenvalue where the top ones hold 0.95 of the mass, one λ for all blocks" in text
    assert "pow(-0.5)" in text


@pytest.mark.parametrize("kwargs", [{"relative_damping": 0.1}, {"damping": None}])
def test_trackstar_previous_default_is_one_argument_away(setting, kwargs):
    """relative_damping=0.1 (or damping=None) is the rule before issue 31: 0.1 × R's mean eigenvalue."""
    s, P = setting, ga.proj.gaussian(12, seed=3)
    S = ga.methods.trackstar(s["task"], s["train"], s["query"], optimizer=s["opt"], layers=LAYERS, projector=P,
                             **kwargs)
    want = reference(s, projection_matrix(P, ga.grads(s["task"], s["train"], LAYERS)), rel=0.1)
    np.testing.assert_allclose(np.asarray(S.compute().values), want, rtol=1e-9, atol=1e-10)
    assert "0.1 × mean eigenvalue" in repr(S)


def test_trackstar_with_k_above_the_dimension_projects_nothing(setting):
    """The default projection is none when k ≥ dim (TRAK's rule): the reference with P = I. R then
    spans the two layers' blocks and couples them; the default damps it by one λ from its pooled
    spectrum (issue 31), a given damping='auto' per block (λ_b from R's diagonal blocks)."""
    s = setting
    dim = ga.grads(s["task"], s["train"], LAYERS).space.dim                # 39 coordinates
    sizes = [b.dim for b in ga.grads(s["task"], s["train"], LAYERS).space.blocks]   # (24, 15)
    S = ga.methods.trackstar(s["task"], s["train"], s["query"], optimizer=s["opt"], layers=LAYERS, k=4096)
    want = reference(s, torch.eye(dim, dtype=torch.float64))                 # one λ: R's own spectrum
    np.testing.assert_allclose(np.asarray(S.compute().values), want, rtol=1e-8, atol=1e-10)
    assert "project" not in repr(S).lower()
    assert "[default: λ_b = the eigenvalue where the top ones hold 0.95 of the mass, one λ for all blocks" in repr(S)
    per_block = ga.methods.trackstar(s["task"], s["train"], s["query"], optimizer=s["opt"], layers=LAYERS, k=4096,
                                     damping="auto")
    want_blocks = reference(s, torch.eye(dim, dtype=torch.float64), blocks=sizes)
    np.testing.assert_allclose(np.asarray(per_block.compute().values), want_blocks, rtol=1e-8, atol=1e-10)
    assert not np.allclose(want, want_blocks)                                # the two rules differ here
    assert "[damping='auto': λ_b = the eigenvalue where the top ones hold 0.95 of the mass, per block" in repr(per_block)


def test_mixing_coefficient_places_the_crossing_at_the_cth_component():
    train = torch.tensor([8.0, 1.0, 4.0, 0.5])          # sorted: 8, 4, 1, 0.5
    task = torch.tensor([0.25, 9.0, 3.0, -1e-12])       # sorted: 9, 3, 0.25, 0 (a rounding error clipped)
    lam = mixing_coefficient(train, task, 2)
    assert lam == pytest.approx(4.0 / 7.0)              # λ·3 = (1 − λ)·4
    assert lam * 3.0 == pytest.approx((1 - lam) * 4.0)
    assert mixing_coefficient(train, task, 4) == 1.0    # σ_task[4] = 0: R_task alone there
    with pytest.raises(ValueError, match="both 0"):
        mixing_coefficient(torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0]), 2)
    for bad in (0, 5, 1.5, True):
        with pytest.raises(ValueError, match="downweight_components"):
            mixing_coefficient(train, task, bad)


def test_trackstar_refuses_what_it_cannot_compute(setting):
    s = setting
    with pytest.raises(ValueError, match="optimizer="):
        ga.methods.trackstar(s["task"], s["train"], s["query"], optimizer=None)
    with pytest.raises(ValueError, match="mix="):
        ga.methods.trackstar(s["task"], s["train"], s["query"], optimizer=s["opt"], task_data=s["task_data"])
    with pytest.raises(ValueError, match="mix must be"):
        ga.methods.trackstar(s["task"], s["train"], s["query"], optimizer=s["opt"], task_data=s["task_data"],
                             mix="paper")
    with pytest.raises(ValueError, match="downweight_components"):     # c above k = 12
        ga.methods.trackstar(s["task"], s["train"], s["query"], optimizer=s["opt"], layers=LAYERS,
                             projector=ga.proj.gaussian(12, seed=3), task_data=s["task_data"], mix="auto")
    sgd = torch.optim.SGD(s["model"].parameters(), lr=0.1)
    with pytest.raises(ga.GradalgError, match="second moment"):
        ga.methods.trackstar(s["task"], s["train"], s["query"], optimizer=sgd)
