"""``ga.store.index``: a faiss index of a projected gradient store returns, per query, rows
whose scores are exact (re-scored from the stored rows) with high recall of the exact
top-k (``S.topk``), for inner product and cosine, flat / IVF / HNSW; it refuses
unprojected stores and queries projected or captured differently from the store."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gradalg as ga

pytest.importorskip("faiss")

D, N, NQ = 24, 2400, 10


def linear_task(seed=0):
    """A bias-free Linear(D → 1) with loss = its output: each example's gradient is its input x."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(D, 1, bias=False).double()
    return ga.Task(model, lambda m, b: m(b[0]).sum())


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    centers = 3 * torch.randn(25, D, generator=g, dtype=torch.float64)
    X = centers[torch.randint(0, 25, (N,), generator=g)] + torch.randn(N, D, generator=g, dtype=torch.float64)
    Xq = centers[torch.randint(0, 25, (NQ,), generator=g)] + torch.randn(NQ, D, generator=g, dtype=torch.float64)
    task = linear_task()
    P = ga.proj.gaussian(16, seed=1)
    G = ga.grads(task, (X,), ids=[f"r{i}" for i in range(N)])
    Q = ga.grads(task, (Xq,))
    path = tmp_path_factory.mktemp("index") / "g.zarr"
    with ga.options(progress=False):
        ga.store.write(P(G), path, chunk_rows=500)
    return {"task": task, "P": P, "G": G, "Q": Q, "X": X, "path": path}


def exact_scores(s, metric):
    P, G, Q = s["P"], s["G"], s["Q"]
    S = (P(Q).normalize() @ P(G).normalize().T) if metric == "cos" else (P(Q) @ P(G).T)
    return S


@pytest.mark.parametrize("metric", ["ip", "cos"])
@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_search_returns_exact_scores_with_high_recall(setting, metric, kind):
    s = setting
    idx = ga.store.index(s["path"], metric=metric, kind=kind, overwrite=True)
    S = exact_scores(s, metric)
    full = S.compute()
    for largest in (True, False):
        got = idx.search(s["P"](s["Q"]), 10, largest=largest)
        assert got.dims == ("query", "rank") and got.shape == (NQ, 10)
        # every returned score is the exact score of the returned row
        exact = np.array([[full.sel(query=q, train=t).item() for t in row]
                          for q, row in zip(got["query"].values, got["train"].values)])
        np.testing.assert_allclose(got.values, exact, rtol=1e-12, atol=1e-12)
        assert np.all(np.diff(got.values, axis=1) <= 0) if largest else np.all(np.diff(got.values, axis=1) >= 0)
        truth = S.topk(10, largest=largest)
        recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got["train"].values, truth["train"].values)])
        if kind == "flat":
            np.testing.assert_array_equal(got["train"].values, truth["train"].values)
            np.testing.assert_allclose(got.values, truth.values, rtol=1e-12, atol=1e-12)
        else:
            assert recall >= 0.95, (metric, kind, largest, recall)


def test_index_is_saved_atomically_and_reopened(setting, tmp_path):
    s = setting
    idx = ga.store.index(s["path"], metric="ip", kind="ivf", path=tmp_path / "i.index", nlist=16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i.index"]            # no partial sibling left
    assert idx.meta["params"] == {"nlist": 16} and idx.disk_bytes() > N * 16 * 8
    with pytest.raises(FileExistsError):
        ga.store.index(s["path"], metric="ip", kind="ivf", path=tmp_path / "i.index")
    again = ga.store.open_index(tmp_path / "i.index")
    q = s["P"](s["Q"])
    a, b = idx.search(q, 5), again.search(q, 5)
    np.testing.assert_array_equal(a["train"].values, b["train"].values)
    # the store rewritten from other examples: the saved index no longer describes it
    with ga.options(progress=False):
        ga.store.write(s["P"](ga.grads(s["task"], (s["X"][:600],))), tmp_path / "g.zarr", chunk_rows=300)
    ga.store.index(tmp_path / "g.zarr", kind="flat", path=tmp_path / "f.index")
    with ga.options(progress=False):
        ga.store.write(s["P"](ga.grads(s["task"], (s["X"][600:1200],))), tmp_path / "g.zarr", chunk_rows=300,
                       overwrite=True)
    with pytest.raises(ga.StoreMismatchError, match="rebuild the index"):
        ga.store.open_index(tmp_path / "f.index")


def test_refuses_unprojected_stores_and_foreign_queries(setting, tmp_path):
    s = setting
    with ga.options(progress=False), pytest.warns(UserWarning):
        ga.store.write(s["G"], tmp_path / "wide.zarr", chunk_rows=800)
    with pytest.raises(ga.errors.OptionError, match="unprojected"):
        ga.store.index(tmp_path / "wide.zarr")
    idx = ga.store.index(s["path"], metric="cos", kind="flat", path=tmp_path / "c.index")
    other_projector = ga.proj.gaussian(16, seed=2)
    with pytest.raises(ga.StoreMismatchError, match="projector"):
        idx.search(other_projector(s["Q"]), 5)
    other_model = ga.grads(linear_task(seed=7), (s["X"][:4],))
    with pytest.raises(ga.StoreMismatchError, match="model_fingerprint"):
        idx.search(s["P"](other_model), 5)
    with pytest.raises(ga.errors.OptionError, match="k must be"):
        idx.search(s["P"](s["Q"]), N + 1)
