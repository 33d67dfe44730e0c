"""Identity everywhere (issue 29, item 5): stored operators, stored rows, compiled
expressions and ``kron`` projections keep the model and data identity the in-memory
path keeps (content fingerprints, :mod:`gradalg.fingerprint`).

* a store records the ``model_digest`` of the models it was written from: its rows or
  operator next to another model's gradients are refused as in memory
  (``SpaceMismatchError``), in this process and in another; ``check_models=False`` allows it;
* ``open(like=)`` and resuming a write compare the data by its ids and the values of
  its first and last examples (another last example: refused);
* ``ga.compile``: a training or query tensor edited in place recompiles (equal to a fresh
  computation) or raises, and the suggested fix works;
* ``kron(k)`` with k above a layer's size keeps the layer exact (not a random square map).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import gradalg as ga

pytest.importorskip("zarr")
sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread  # noqa: F401,E402 - autouse fixture
from reliability_datasets import ListDataset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-9 * float(np.abs(b).max()))


@pytest.fixture()
def two_models():
    X, y = models.classification_data(n=12)
    tA, tB = ga.tasks.classification(models.mlp(seed=0)), ga.tasks.classification(models.mlp(seed=1))
    return X, y, tA, tB


# ---------------------------------------------------------------------------- stored operators and rows
def test_a_stored_operator_of_model_a_is_refused_on_model_b(two_models, tmp_path):
    X, y, tA, tB = two_models
    GA, GB = ga.grads(tA, (X, y)), ga.grads(tB, (X, y))
    with pytest.raises(ga.SpaceMismatchError, match="different models"):   # in memory
        GB @ ga.fisher(GA).damp(1e-3).inv() @ GB.T
    H = ga.store.write_operator(ga.fisher(GA).damp(1e-3), tmp_path / "a.zarr")
    with pytest.raises(ga.SpaceMismatchError, match="a store"):             # stored: the same refusal
        GB @ H.inv() @ GB.T
    with pytest.raises(ga.SpaceMismatchError, match="a store"):
        H.inv() @ GB.T
    _close((GA @ H.inv() @ GA.T).compute().values, (GA @ ga.fisher(GA).damp(1e-3).inv() @ GA.T).compute().values)
    with ga.options(check_models=False):     # the fix the message names, on purpose
        _close((GB @ H.inv() @ GB.T).compute().values,
               (GB @ ga.fisher(GA).damp(1e-3).inv() @ GB.T).compute().values)


def test_stored_rows_of_model_a_are_refused_next_to_model_b(two_models, tmp_path):
    X, y, tA, tB = two_models
    P = ga.proj.gaussian(k=8, seed=0)
    GA, GB = P(ga.grads(tA, (X, y))), P(ga.grads(tB, (X, y)))
    stored = ga.store.write(GA, tmp_path / "rows.zarr", chunk_rows=5)
    with pytest.raises(ga.SpaceMismatchError, match="two sides of a score"):
        GB @ stored.T
    with pytest.raises(ga.SpaceMismatchError, match="two sides of a score"):
        stored @ GB.T
    with pytest.raises(ga.SpaceMismatchError, match="the operator and the gradients"):
        GB @ ga.fisher(stored).damp(1e-3).inv() @ GB.T
    _close((GA @ stored.T).compute().values, (GA @ GA.T).compute().values)
    with pytest.raises(ga.StoreMismatchError, match="model_digest"):
        ga.store.open(tmp_path / "rows.zarr", like=GB)


def test_a_store_is_refused_after_its_model_was_trained(tmp_path):
    X, y = models.classification_data(n=12)
    model = models.mlp()
    task = ga.tasks.classification(model)
    P = ga.proj.gaussian(k=8, seed=0)
    stored = ga.store.write(P(ga.grads(task, (X, y))), tmp_path / "rows.zarr", chunk_rows=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(model(X), y).backward()
    opt.step()                                 # the rows are of the weights before the step
    with pytest.raises(ga.SpaceMismatchError, match="different models"):
        P(ga.grads(task, (X[:2], y[:2]))) @ stored.T


_OTHER_PROCESS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import gradalg as ga, models
    X, y = models.classification_data(n=12)
    G = ga.grads(ga.tasks.classification(models.mlp(seed=0)), (X, y))
    ga.store.write_operator(ga.kfac(G).damp(1e-3), {path!r})
""")


def test_a_store_written_by_another_process_is_checked_by_content(two_models, tmp_path):
    X, y, tA, tB = two_models
    path = str(tmp_path / "kfac.zarr")
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONHASHSEED="random", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS.format(tests=os.path.dirname(__file__), path=path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    H = ga.store.open_operator(path)
    GA, GB = ga.grads(tA, (X, y)), ga.grads(tB, (X, y))
    _close((GA @ H.inv() @ GA.T).compute().values, (GA @ ga.kfac(GA).damp(1e-3).inv() @ GA.T).compute().values)
    with pytest.raises(ga.SpaceMismatchError, match="different models"):
        GB @ H.inv() @ GB.T


def test_stores_compare_the_data_by_content(two_models, tmp_path):
    X, y, tA, _ = two_models
    P = ga.proj.gaussian(k=8, seed=0)
    path = tmp_path / "rows.zarr"
    ga.store.write(P(ga.grads(tA, (X, y))), path, chunk_rows=5)
    Y = X.clone()
    Y[11] += 1.0                               # same ids, same first example, another last one
    GY = P(ga.grads(tA, (Y, y)))
    with pytest.raises(ga.StoreMismatchError, match="expression differs"):
        ga.store.open(path, like=GY)
    with pytest.raises(ga.StoreMismatchError, match="expression differs"):
        ga.store.write(GY, path, chunk_rows=5)
    ga.store.open(path, like=P(ga.grads(tA, (X.clone(), y))))        # equal content: the same data
    rewritten = ga.store.write(GY, path, chunk_rows=5, overwrite=True)   # the fix
    _close((GY @ rewritten.T).compute().values, (GY @ GY.T).compute().values)


@pytest.mark.parametrize("where", [0, 5, 11])
def test_stores_see_an_edit_of_any_example(two_models, tmp_path, where):
    """Not only the first or last example: an edit in the middle of the data is refused too
    (the store records a digest of every example's values)."""
    X, y, tA, _ = two_models
    P = ga.proj.gaussian(k=8, seed=0)
    path = tmp_path / "rows.zarr"
    ga.store.write(P(ga.grads(tA, (X, y))), path, chunk_rows=5)
    Y = X.clone()
    Y[where, 0] += 1e-3
    GY = P(ga.grads(tA, (Y, y)))
    with pytest.raises(ga.StoreMismatchError, match="expression differs"):
        ga.store.open(path, like=GY)
    with pytest.raises(ga.StoreMismatchError, match="expression differs"):
        ga.store.write(GY, path, chunk_rows=5)        # complete store: not silently returned
    labels = y.clone()
    labels[where] = (labels[where] + 1) % 3
    with pytest.raises(ga.StoreMismatchError, match="expression differs"):
        ga.store.write(P(ga.grads(tA, (X, labels))), path, chunk_rows=5)


def test_a_list_and_a_dataset_of_the_same_records_name_the_same_data(tmp_path):
    """The content digest reads values, not containers: the same records as a list or as a
    Dataset resume the same store."""
    X, y = models.classification_data(n=12)
    task = ga.tasks.classification(models.mlp(seed=0))
    P = ga.proj.gaussian(k=8, seed=0)
    records = [(X[i], y[i]) for i in range(12)]
    path = tmp_path / "rows.zarr"
    ga.store.write(P(ga.grads(task, records)), path, chunk_rows=5)
    reopened = ga.store.open(path, like=P(ga.grads(task, ListDataset(X, y))))
    assert reopened.n == 12


# ---------------------------------------------------------------------------- ga.capture rows
def test_captured_rows_are_refused_beside_another_models_gradients(two_models):
    X, y, tA, tB = two_models
    with ga.capture(tA.model, reduction="sum") as cap:
        torch.nn.functional.cross_entropy(tA.model(X), y, reduction="sum").backward()
    rows = cap.grads
    with pytest.raises(ga.SpaceMismatchError, match="different models.*captured rows"):
        ga.grads(tB, (X[:2], y[:2])) @ rows.T
    with pytest.raises(ga.SpaceMismatchError, match="different models"):
        rows @ ga.fisher(ga.grads(tB, (X, y))).damp(1e-3).inv() @ rows.T
    same = (ga.grads(tA, (X[:2], y[:2])) @ rows.T).compute().values     # the same model: allowed
    ref = (ga.grads(tA, (X[:2], y[:2])) @ ga.grads(tA, (X, y)).T).compute().values
    _close(same, ref)
    with ga.options(check_models=False):                                # the fix the message names
        (ga.grads(tB, (X[:2], y[:2])) @ rows.T).compute()


# ---------------------------------------------------------------------------- ga.compile
@pytest.mark.parametrize("hold", ["auto", False])
@pytest.mark.parametrize("edit", ["train", "query", "list dataset"])
def test_compile_sees_data_edited_in_place(edit, hold):
    X, y = models.classification_data(n=16)
    Xq, yq = models.classification_data(n=3, seed=5)
    task = ga.tasks.classification(models.mlp())
    train = ListDataset(X, y) if edit == "list dataset" else (X, y)
    G, Q = ga.grads(task, train), ga.grads(task, (Xq, yq))
    S = Q @ ga.fisher(G).damp(1e-2).inv() @ G.T
    C = ga.compile(S, hold=hold)
    before = C.compute().values
    with torch.no_grad():
        (Xq if edit == "query" else X)[2] += 1.0      # in place (ListDataset items are views of X)
    fresh_G, fresh_Q = ga.grads(task, (X.clone(), y)), ga.grads(task, (Xq.clone(), yq))
    reference = (fresh_Q @ ga.fisher(fresh_G).damp(1e-2).inv() @ fresh_G.T).compute().values
    assert not np.allclose(before, reference)
    _close(C.compute().values, reference)
    assert C.compilations == 2
    _close(C.scores(ga.grads(task, (Xq.clone(), yq))).values, reference)


def test_compile_with_on_change_raise_refuses_edited_data_and_invalidate_fixes_it():
    X, y = models.classification_data(n=16)
    task = ga.tasks.classification(models.mlp())
    G = ga.grads(task, (X, y))
    ex = ga.LocalExecutor()                          # a user executor: its memo must not serve old data
    Q = ga.grads(task, (X[:3].clone(), y[:3]))
    C = ga.compile(Q @ ga.kfac(G).damp(1e-2).inv() @ G.T, on_change="raise", executor=ex)
    C.compute()
    X[5] *= 2.0
    with pytest.raises(ga.StaleCompiledError, match="the data"):
        C.compute()
    C.invalidate()
    fresh = ga.grads(task, (X.clone(), y))
    _close(C.compute().values, (Q @ ga.kfac(fresh).damp(1e-2).inv() @ fresh.T).compute().values)


# ---------------------------------------------------------------------------- kron above a layer's size
def test_kron_above_a_layers_size_keeps_it_exact():
    X, y = models.classification_data(n=6)
    G = ga.grads(ga.tasks.classification(models.mlp()), (X, y))     # blocks (16, 9) and (3, 17)
    dense = G.to_dense()
    PG = ga.proj.kron(k=256, seed=0)(G)
    assert [b.shape for b in PG.space.blocks] == [(16, 9), (3, 17)]
    projected = PG.to_dense()
    for name in ("0", "2"):                                        # the identity: no random map
        torch.testing.assert_close(projected[name].reshape(6, -1), dense[name].reshape(6, -1))
    _close((PG @ PG.T).compute().values, (G @ G.T).compute().values)
    # one side reduced, the other kept: (3, 17) at k=16 is 2 × 8, (16, 9) at k=64 is 8 × 8
    Po, Pi = ga.proj.kron_matrices(ga.proj.kron(k=51, seed=0), "2", 3, 17, dtype=torch.float64)
    assert Po.shape == (3, 3) and torch.equal(Po, torch.eye(3, dtype=torch.float64)) and Pi.shape == (17, 17)
    Po, Pi = ga.proj.kron_matrices(ga.proj.kron(k=48, seed=0), "2", 3, 17, dtype=torch.float64)
    assert torch.equal(Po, torch.eye(3, dtype=torch.float64)) and Pi.shape == (16, 17)
    assert not torch.equal(Pi[:, :16], torch.eye(16, dtype=torch.float64))
