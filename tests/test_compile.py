"""ga.compile: operators resolved and the training side preconditioned once; new queries
cost their own pass (plus one read of stored rows); results equal S.compute(); weights
changed in place (optimizer step, writes through .data) recompile or refuse."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gradalg as ga

sys.path.insert(0, str(Path(__file__).parent))
from models import classification_data, mlp  # noqa: E402


class Forwards:
    """Counts the examples the model runs forward."""

    def __init__(self, model):
        self.examples = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        self.examples += inputs[0].shape[0]

    def reset(self):
        self.examples = 0


@pytest.fixture()
def setting():
    model = mlp()
    X, y = classification_data(n=30)
    task = ga.tasks.classification(model)
    return model, task, X, y


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-10 * float(np.abs(b).max()))


CURVATURES = {
    "fisher-block": lambda G: ga.fisher(G, structure="block").damp(1e-2).inv(),
    "kfac": lambda G: ga.kfac(G).damp(1e-2).inv(),
    "ekfac-pow": lambda G: ga.ekfac(G).damp(1e-2).pow(-0.5),
    "projected-dense": lambda G: ga.fisher(ga.proj.gaussian(k=12, seed=0)(G)).damp(0.1, relative=True).inv(),
}


@pytest.mark.parametrize("name", list(CURVATURES))
def test_compiled_scores_equal_compute_and_reuse_the_training_side(setting, name):
    model, task, X, y = setting
    side = ga.proj.gaussian(k=12, seed=0) if name == "projected-dense" else (lambda G: G)
    G = side(ga.grads(task, (X, y)))
    Q = side(ga.grads(task, (X[:4], y[:4])))
    H = CURVATURES[name](ga.grads(task, (X, y)) if name == "projected-dense" else G)
    S = Q @ H @ G.T
    C = ga.compile(S)
    _close(C.compute().values, S.compute().values)
    forwards = Forwards(model)
    Q2 = side(ga.grads(task, (X[10:17], y[10:17])))
    Q2.to_dense()
    query_pass = forwards.examples         # one pass over the queries (with the task's first-batch check)
    forwards.reset()
    got = C.scores(Q2)
    assert forwards.examples == query_pass  # the query pass only: no training pass, no curvature pass
    forwards.reset()
    ref = (Q2 @ H @ G.T).compute()
    assert forwards.examples >= query_pass + 30   # what it costs without compiling
    _close(got.values, ref.values)
    assert list(got.coords["train"].values) == list(ref.coords["train"].values)
    assert list(got.coords["query"].values) == list(ref.coords["query"].values)
    assert C.compilations == 1 and C.held_rows


def test_any_expression_reuses_the_compiled_parts(setting):
    model, task, X, y = setting
    G = ga.grads(task, (X, y))
    H = ga.kfac(G).damp(1e-2).inv()
    C = ga.compile(ga.grads(task, (X[:3], y[:3])) @ H @ G.T)
    Q2 = ga.grads(task, (X[3:8], y[3:8]))
    S2 = 2.0 * (Q2 @ H @ G.T) - Q2 @ ga.fisher(G, structure="diag").damp(0.1).inv() @ G.T
    _close(C(S2).values, S2.compute().values)
    rewritten = C.rewrite(Q2 @ H @ G.T)
    assert "compiled" in repr(rewritten) and "kfac" not in repr(rewritten)
    assert "kronecker.invert_eigenvalues" in repr(C)


def test_a_query_against_a_store_reads_it_once(setting, tmp_path):
    pytest.importorskip("zarr")
    model, task, X, y = setting
    stored = ga.store.write(ga.grads(task, (X, y)), tmp_path / "train.zarr")
    H = ga.fisher(stored).damp(1e-2).inv()
    C = ga.compile(ga.grads(task, (X[:3], y[:3])) @ H @ stored.T)
    assert not C.held_rows                 # a store is read per query, not copied into memory
    store = stored.expr.store
    reads = []
    original = type(store).chunks

    def counting(self, *args, **kwargs):
        reads.append(1)
        return original(self, *args, **kwargs)

    forwards = Forwards(model)
    Q2 = ga.grads(task, (X[5:9], y[5:9]))
    Q2.to_dense()
    query_pass = forwards.examples
    forwards.reset()
    try:
        type(store).chunks = counting
        got = C.scores(Q2)
    finally:
        type(store).chunks = original
    assert forwards.examples == query_pass and len(reads) == 1
    _close(got.values, (Q2 @ H @ stored.T).compute().values)


@pytest.mark.parametrize("change", ["optimizer_step", "write_through_data"])
def test_weights_changed_in_place_recompile(setting, change):
    model, task, X, y = setting
    G = ga.grads(task, (X, y))
    H = ga.fisher(G, structure="block").damp(1e-2).inv()
    C = ga.compile(ga.grads(task, (X[:3], y[:3])) @ H @ G.T)
    Q2 = ga.grads(task, (X[3:8], y[3:8]))
    before = C.scores(Q2).values
    if change == "optimizer_step":
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loss = torch.nn.functional.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(0.3 * torch.randn_like(p))   # bypasses the version counter
    after = C.scores(ga.grads(task, (X[3:8], y[3:8]))).values
    assert C.compilations == 2
    fresh = ga.tasks.classification(model)   # a reference built from scratch on the new weights
    ref = (ga.grads(fresh, (X[3:8], y[3:8])) @ ga.fisher(ga.grads(fresh, (X, y)), structure="block").damp(1e-2).inv()
           @ ga.grads(fresh, (X, y)).T).compute().values
    _close(after, ref)
    assert np.abs(after - before).max() > 1e-3 * np.abs(before).max()   # stale numbers would have passed
    # expressions over the same G and H now name the new weights and reuse the recompiled parts
    forwards = Forwards(model)
    Q3 = ga.grads(task, (X[8:12], y[8:12]))
    Q3.to_dense()
    query_pass = forwards.examples
    forwards.reset()
    again = C(Q3 @ H @ G.T)
    assert forwards.examples == query_pass and C.compilations == 2
    ref3 = (ga.grads(fresh, (X[8:12], y[8:12])) @ ga.fisher(ga.grads(fresh, (X, y)), structure="block").damp(1e-2)
            .inv() @ ga.grads(fresh, (X, y)).T).compute().values
    _close(again.values, ref3)


def test_on_change_raise_and_invalidate(setting):
    model, task, X, y = setting
    G = ga.grads(task, (X, y))
    C = ga.compile(ga.grads(task, (X[:3], y[:3])) @ ga.kfac(G).damp(1e-2).inv() @ G.T, on_change="raise")
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)
    with pytest.raises(ga.StaleCompiledError, match="invalidate"):
        C.scores(ga.grads(task, (X[3:5], y[3:5])))
    C.invalidate()
    assert "invalidated" in repr(C)
    out = C.scores(ga.grads(task, (X[3:5], y[3:5])))
    assert C.compilations == 2 and out.shape == (2, 30)


def test_compile_checks_its_arguments(setting):
    model, task, X, y = setting
    G = ga.grads(task, (X, y))
    with pytest.raises(TypeError, match="Scores"):
        ga.compile(G)
    with pytest.raises(ga.OptionError, match="on_change"):
        ga.compile(G @ G.T, on_change="ignore")
    C = ga.compile(G @ G.T, hold=True)
    with pytest.raises(ga.SpaceMismatchError):
        C.scores(ga.proj.gaussian(k=4)(G))
