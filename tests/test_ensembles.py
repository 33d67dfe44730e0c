"""Ensembles as algebra: ga.mean over members' scores, ga.methods.ensemble, TracIn with
per-checkpoint curvature — against the members computed one by one and a dense torch.func
reference; and the plan reads each distinct (task, data) once."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.plan.planner import plan

from models import classification_data, mlp
from references import one_thread, reference_rows  # noqa: F401 - one_thread is an autouse fixture

LAYERS = ["0", "2"]


@pytest.fixture(scope="module")
def setting():
    X, y = classification_data(n=36, d_in=6, classes=3)
    models = [mlp(d_in=6, hidden=5, classes=3, seed=s) for s in range(3)]
    return {"models": models, "tasks": [ga.tasks.classification(m) for m in models],
            "train": (X[:28], y[:28]), "query": (X[28:], y[28:])}


def values(scores) -> np.ndarray:
    return np.asarray(scores.compute().values)


class CountExamples:
    """Examples each model's forward saw (a forward hook), to count reads of the data."""

    def __init__(self, models):
        self.models, self.seen, self.handles = models, {id(m): 0 for m in models}, []

    def __enter__(self):
        for m in self.models:
            self.handles.append(m.register_forward_hook(
                lambda mod, args, out, key=id(m): self.seen.__setitem__(key, self.seen[key] + args[0].shape[0])))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def test_ensemble_equals_mean_of_members_computed_alone(setting):
    t, train, query = setting["tasks"], setting["train"], setting["query"]
    for curvature in ("ekfac", "gauss_newton"):
        S = ga.methods.ensemble(ga.methods.influence, t, train, query, layers=LAYERS, curvature=curvature)
        alone = [values(ga.methods.influence(task, train, query, layers=LAYERS, curvature=curvature)) for task in t]
        np.testing.assert_allclose(values(S), np.mean(alone, axis=0), rtol=1e-10, atol=1e-10 * np.abs(alone).max())


def test_weighted_mean_and_call_forms(setting):
    t, train, query = setting["tasks"], setting["train"], setting["query"]
    members = [ga.methods.grad_dot(task, train, query, layers=LAYERS) for task in t]
    alone = np.stack([values(S) for S in members])
    w = np.array([3.0, 1.0, 0.0])
    want = np.tensordot(w / w.sum(), alone, axes=1)
    np.testing.assert_allclose(values(ga.mean(members, weights=w)), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(values(ga.methods.ensemble(ga.methods.grad_dot, t, train, query, layers=LAYERS,
                                                          weights=w)), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(values(ga.mean(*members)), alone.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(values(ga.sum(members, [1.0, 2.0, -1.0])), alone[0] + 2 * alone[1] - alone[2],
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="non-negative"):
        ga.mean(members, weights=[1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="3 scores"):
        ga.mean(members, weights=[1.0, 1.0])
    with pytest.raises(TypeError, match="expected Scores"):
        ga.mean([members[0], 1.0])


def test_ensemble_against_dense_torch_func_reference(setting):
    """(1/M) Σ_m w_m Q_m (F_m + λI)⁻¹ G_mᵀ with F_m the empirical Fisher of model m's rows."""
    t, train, query = setting["tasks"], setting["train"], setting["query"]
    lam, w = 0.05, [1.0, 2.0, 1.0]
    S = ga.methods.ensemble(ga.methods.influence, t, train, query, layers=LAYERS, curvature="empirical",
                            damping=lam, weights=w)
    want = 0.0
    for task, wm in zip(t, w):
        G, Q = reference_rows(task, train, LAYERS), reference_rows(task, query, LAYERS)
        H = G.T @ G / G.shape[0] + lam * torch.eye(G.shape[1], dtype=G.dtype)
        want = want + wm / sum(w) * (Q @ torch.linalg.solve(H, G.T)).numpy()
    np.testing.assert_allclose(values(S), want, rtol=1e-10, atol=1e-10 * np.abs(want).max())


def test_trak_m_is_the_mean_of_single_model_traks(setting):
    t, train, query = setting["tasks"], setting["train"], setting["query"]
    together = values(ga.methods.trak(t, train, query, layers=LAYERS, k=16))
    as_ensemble = values(ga.methods.ensemble(ga.methods.trak, t, train, query, layers=LAYERS, k=16))
    np.testing.assert_allclose(together, as_ensemble, rtol=1e-10, atol=1e-10 * np.abs(together).max())


def test_plan_reads_each_distinct_task_and_data_once(setting):
    """Members on the same model (two dampings, two methods) share its passes; each model's
    queries and training set are read once for every job of every member."""
    m, t, train, query = setting["models"], setting["tasks"], setting["train"], setting["query"]
    members = [ga.methods.influence(t[0], train, query, layers=LAYERS, curvature="empirical", damping=0.1),
               ga.methods.influence(t[0], train, query, layers=LAYERS, curvature="empirical", damping=0.01),
               ga.methods.grad_dot(t[0], train, query, layers=LAYERS),
               ga.methods.influence(t[1], train, query, layers=LAYERS, curvature="empirical", damping=0.1)]
    S = ga.mean(members)
    p = plan(S.expr)
    reads = [(q.key.task_token, q.key.data_token) for q in p.passes if q.reads_data]
    assert len(reads) == len(set(reads)) == 4            # (model, data) pairs: 2 models × (queries, train)
    assert p.data_passes == 4 and "4 pass(es) over data" in str(S.explain())
    with ga.options(check_reduction=False), CountExamples(m[:2]) as count:
        got = values(S)
    n = len(train[0]) + len(query[0])
    assert count.seen == {id(m[0]): n, id(m[1]): n}      # each model's data read once, not once per member
    np.testing.assert_allclose(got, np.mean([values(s) for s in members], axis=0), rtol=1e-10, atol=1e-10)


def test_tracin_with_per_checkpoint_curvature(setting):
    """Σ_c η_c Q_c (F_c + λ_c I)⁻¹ G_cᵀ, λ_c relative to each checkpoint's own spectrum."""
    t, train, query = setting["tasks"], setting["train"], setting["query"]
    lrs, rel = [0.5, 0.25, 0.125], 0.1
    S = ga.methods.tracin(t, lrs, train, query, layers=LAYERS, curvature="empirical", relative_damping=rel)
    want = 0.0
    for task, lr in zip(t, lrs):
        G, Q = reference_rows(task, train, LAYERS), reference_rows(task, query, LAYERS)
        F = G.T @ G / G.shape[0]
        H = F + rel * torch.trace(F) / F.shape[0] * torch.eye(F.shape[0], dtype=F.dtype)
        want = want + lr * (Q @ torch.linalg.solve(H, G.T)).numpy()
    np.testing.assert_allclose(values(S), want, rtol=1e-10, atol=1e-10 * np.abs(want).max())
    plain = ga.methods.tracin(t, lrs, train, query, layers=LAYERS)
    assert "inverse" not in repr(plain) and "inverse" in repr(S)
    with pytest.raises(ValueError, match="normalize"):
        ga.methods.tracin(t, lrs, train, query, curvature="ekfac", normalize=True)
