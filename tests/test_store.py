"""ga.store: gradient, operator and score stores (Zarr through xarray).

Round trips (rows, scores and operators read back are what was written, and give the
scores of the in-memory expression), resuming after an exception and after a SIGKILL
of the writing process (the finished store equals one written in one run), refusal of
stores written from another model, projector or layer list, and of unfinished stores.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import gradalg as ga
import gradalg.store.gradients as store_gradients
import gradalg.store.scores as store_scores
from gradalg.store import layout
from gradalg.testing import assert_close

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

pytest.importorskip("zarr")
pytest.importorskip("dask")

SCRIPT = Path(__file__).parent / "store_scripts" / "write_store.py"
LAYERS = ["0", "2"]


@pytest.fixture(scope="module")
def setting():
    model = models.mlp(d_in=8, hidden=16, classes=3, seed=0)   # float64
    X, y = models.classification_data(n=30, d_in=8, classes=3, seed=1)
    Xq, yq = models.classification_data(n=5, d_in=8, classes=3, seed=2)
    task = ga.tasks.classification(model)
    G = ga.grads(task, (X, y), layers=LAYERS)
    Q = ga.grads(task, (Xq, yq), layers=LAYERS)
    return task, G, Q, (X, y)


def _flat(rows: dict) -> torch.Tensor:
    return torch.cat([v.flatten(1) for v in rows.values()], dim=1)


def _raw(path) -> dict:
    """Every variable of a store, read with zarr directly (no gradalg code)."""
    import zarr

    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(arr[...]) for name, arr in group.arrays()}


def _assert_same_store(a, b, exact=True):
    ra, rb = _raw(a), _raw(b)
    assert sorted(ra) == sorted(rb)
    for name in ra:
        assert ra[name].dtype == rb[name].dtype, name
        if exact or ra[name].dtype.kind not in "fc":
            assert np.array_equal(ra[name], rb[name]), f"variable {name!r} differs"
        else:
            np.testing.assert_allclose(ra[name], rb[name], rtol=1e-12, atol=1e-14, err_msg=name)
    assert layout.read_attrs(a) == layout.read_attrs(b)


# ------------------------------------------------------------------------ round trips
def test_kron_roundtrip_rows_and_scores(setting, tmp_path):
    _, G, Q, _ = setting
    P = ga.proj.kron(k=4, seed=0)
    stored = ga.store.write(P(G), tmp_path / "g.zarr", chunk_rows=7)   # 5 chunks, the last short
    assert isinstance(stored, ga.GradientSet)
    assert stored.ids == G.ids and stored.space == P(G).space
    assert stored.representation == {"0": "projected", "2": "projected"}

    # what is on disk is the rows of P(G), and reading gives back exactly those bytes
    raw = _raw(tmp_path / "g.zarr")
    expected = P(G).to_dense()
    for name in LAYERS:
        assert_close(torch.from_numpy(raw[name]), expected[name].flatten(1), rtol=1e-12, atol=1e-14, what=name)
    back = stored.to_dense()
    for name in LAYERS:
        assert torch.equal(back[name].flatten(1), torch.from_numpy(raw[name]))
    assert raw["done"].tolist() == [1] * 5

    attrs = ga.store.dataset(tmp_path / "g.zarr").attrs
    assert attrs["projector"] == [{"kind": "kron", "k": 4, "seed": 0, "per_block": True, "k_out": None,
                                   "k_in": None, "s": 1, "mask_k": None}]
    assert attrs["layers"] == [LAYERS] and attrs["objective"] == ["loss"] and attrs["n"] == 30
    assert attrs["model_fingerprint"] == [ga.store.model_fingerprint(G.expr.task.model)]
    assert attrs["dtype"] == "float64" and attrs["chunk_rows"] == 7
    assert [b["shape"] for b in attrs["blocks"]] == [[2, 2], [2, 2]]

    # the store is used in expressions like any gradient set
    S_mem = (P(Q) @ ga.fisher(P(G)).damp(1e-3).inv() @ P(G).T).compute()
    S_st = (P(Q) @ ga.fisher(stored).damp(1e-3).inv() @ stored.T).compute()
    assert_close(torch.from_numpy(S_st.values), torch.from_numpy(S_mem.values), rtol=1e-9, atol=1e-11,
                 what="influence from the store")
    assert list(S_st.train.values) == list(G.ids)
    cos_mem = (P(Q).normalize() @ P(G).normalize().T).compute()
    cos_st = (P(Q).normalize() @ stored.normalize().T).compute()
    assert_close(torch.from_numpy(cos_st.values), torch.from_numpy(cos_mem.values), rtol=1e-10, atol=1e-12,
                 what="cosine")
    # two openings are one node (computed once when both appear)
    assert ga.store.open(tmp_path / "g.zarr", like=P(G)).expr == stored.expr


def test_gaussian_roundtrip_string_ids(setting, tmp_path):
    task, _, Q, (X, y) = setting
    G = ga.grads(task, (X, y), layers=LAYERS, ids=[f"train-{i}" for i in range(len(y))])
    P = ga.proj.gaussian(k=16, seed=5)
    stored = ga.store.write(P(G), tmp_path / "g.zarr", chunk_rows=8)
    assert stored.ids == G.ids and stored.space.names == ("projected",)
    assert_close(_flat(stored.to_dense()), _flat(P(G).to_dense()), rtol=1e-12, atol=1e-14, what="rows")
    S = (P(Q) @ stored.T).compute()
    assert list(S.train.values) == list(G.ids)
    assert_close(torch.from_numpy(S.values), torch.from_numpy((P(Q) @ P(G).T).compute().values),
                 rtol=1e-10, atol=1e-12, what="scores")


def test_chunks_keep_operators_over_all_rows(setting, tmp_path):
    # rows preconditioned by the Fisher of the same training set: each chunk restricts the
    # rows only, never the data of the Fisher (computed once, over all 30 rows)
    _, G, _, _ = setting
    P = ga.proj.kron(k=4, seed=0)
    pre = P(G) @ ga.fisher(P(G)).damp(1e-3).inv()
    stored = ga.store.write(pre, tmp_path / "g.zarr", chunk_rows=7)
    assert_close(_flat(stored.to_dense()), _flat(pre.to_dense()), rtol=1e-9, atol=1e-11, what="rows")


def test_complete_store_is_not_recomputed(setting, tmp_path, monkeypatch):
    _, G, _, _ = setting
    P = ga.proj.kron(k=4, seed=0)
    ga.store.write(P(G), tmp_path / "g.zarr", chunk_rows=10)

    def boom(*args, **kwargs):
        raise AssertionError("a finished store was recomputed")

    monkeypatch.setattr(store_gradients, "rows_of", boom)
    assert ga.store.write(P(G), tmp_path / "g.zarr", chunk_rows=10).n == 30


def test_factored_blocks_warn(setting, tmp_path):
    _, G, _, _ = setting
    with pytest.warns(UserWarning, match="factored"):
        stored = ga.store.write(G, tmp_path / "g.zarr", chunk_rows=16)
    assert stored.representation == {"0": "dense", "2": "dense"}
    assert_close(_flat(stored.to_dense()), _flat(G.to_dense()), rtol=1e-12, atol=1e-14, what="rows")


def test_dask_executor_writes_the_same_store(setting, tmp_path):
    distributed = pytest.importorskip("distributed")
    _, G, Q, _ = setting
    P = ga.proj.kron(k=4, seed=0)
    ga.store.write(P(G), tmp_path / "local.zarr", chunk_rows=8)
    S = P(Q) @ ga.fisher(P(G)).damp(1e-3).inv() @ P(G).T
    # in-process workers start in a second; the processes of DaskExecutor() are
    # exercised by notebooks/04_scale_out.ipynb
    # one in-process worker thread: workers that are threads of this process share its
    # Python objects, which real (process) workers never do
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                       dashboard_address=":0")
    client = distributed.Client(cluster)
    try:
        ex = ga.exec.DaskExecutor(client=client, min_shard_examples=1)
        stored = ga.store.write(P(G), tmp_path / "dask.zarr", chunk_rows=8, executor=ex)
        # same rows up to the last bits (BLAS kernels may pick other paths in a worker)
        _assert_same_store(tmp_path / "dask.zarr", tmp_path / "local.zarr", exact=False)
        scores = ga.store.write_scores(S, tmp_path / "scores.zarr", chunk_rows=8, executor=ex)
        on_dask = (P(Q) @ stored.T).compute(executor=ex)
    finally:
        client.close()
        cluster.close()
    assert_close(torch.from_numpy(scores.values), torch.from_numpy(S.compute().values), rtol=1e-9, atol=1e-11,
                 what="scores written by Dask tasks")
    assert_close(torch.from_numpy(np.asarray(on_dask.values)),
                 torch.from_numpy((P(Q) @ P(G).T).compute().values), rtol=1e-10, atol=1e-12,
                 what="stored rows on the Dask executor")


# ------------------------------------------------------------------------ resuming
def test_resume_after_exception_recomputes_only_unfinished_chunks(setting, tmp_path, monkeypatch):
    _, G, _, _ = setting
    P = ga.proj.kron(k=4, seed=0)
    ga.store.write(P(G), tmp_path / "once.zarr", chunk_rows=4)   # 8 chunks

    real = store_gradients.rows_of
    calls = []

    def failing(ex, node, a, b):
        if a == 12:                       # chunk 3
            raise RuntimeError("worker lost")
        calls.append(a)
        return real(ex, node, a, b)

    monkeypatch.setattr(store_gradients, "rows_of", failing)
    with pytest.raises(RuntimeError, match="worker lost"):
        ga.store.write(P(G), tmp_path / "g.zarr", chunk_rows=4)
    assert layout.done_flags(tmp_path / "g.zarr").tolist() == [True] * 3 + [False] * 5
    with pytest.raises(ga.StoreIncompleteError, match="5 of 8 chunks"):
        ga.store.open(tmp_path / "g.zarr")

    calls.clear()
    monkeypatch.setattr(store_gradients, "rows_of", lambda ex, node, a, b: calls.append(a) or real(ex, node, a, b))
    ga.store.write(P(G), tmp_path / "g.zarr", chunk_rows=4)
    assert calls == [12, 16, 20, 24, 28]
    _assert_same_store(tmp_path / "g.zarr", tmp_path / "once.zarr")


def _done_count(path) -> int:
    try:
        return int(layout.done_flags(path).sum())
    except Exception:  # noqa: BLE001 - the template is not there yet
        return 0


@pytest.mark.slow
def test_sigkill_mid_write_then_rerun_equals_one_run(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("write_store", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = tmp_path / "killed.zarr"
    n_chunks = layout.n_chunks(script.N, script.CHUNK_ROWS)
    env = dict(os.environ, **{layout.DELAY_ENV: "0.4", "OMP_NUM_THREADS": "1"})
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while _done_count(path) < 1:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the writer finished no chunk in 60 s"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = _done_count(path)
    assert 1 <= done < n_chunks, f"killed after {done} of {n_chunks} chunks"
    with pytest.raises(ga.StoreIncompleteError):
        ga.store.open(path)

    env[layout.DELAY_ENV] = "0"
    rerun = subprocess.run([sys.executable, str(SCRIPT), str(path)], env=env, capture_output=True, timeout=120,
                           check=False)
    assert rerun.returncode == 0, rerun.stderr.decode()
    assert not list(path.rglob("*.partial"))

    reference = ga.store.write(script.build(), tmp_path / "once.zarr", chunk_rows=script.CHUNK_ROWS)
    _assert_same_store(path, tmp_path / "once.zarr")
    assert ga.store.open(path, like=script.build()).ids == reference.ids


# ------------------------------------------------------------------------ refusals
def test_mismatched_stores_are_refused(setting, tmp_path):
    task, G, _, (X, y) = setting
    P = ga.proj.kron(k=4, seed=0)
    path = tmp_path / "g.zarr"
    ga.store.write(P(G), path, chunk_rows=10)

    other_seed = ga.proj.kron(k=4, seed=1)(G)
    with pytest.raises(ga.StoreMismatchError, match="projector") as info:
        ga.store.write(other_seed, path, chunk_rows=10)
    assert "overwrite=True" in str(info.value)
    with pytest.raises(ga.StoreMismatchError, match="projector"):
        ga.store.open(path, like=other_seed)

    model2 = models.mlp(d_in=8, hidden=16, classes=3, seed=0)
    with torch.no_grad():
        model2[0].weight[0, 0] += 1e-3
    G2 = ga.grads(ga.tasks.classification(model2), (X, y), layers=LAYERS)
    with pytest.raises(ga.StoreMismatchError, match="model_fingerprint"):
        ga.store.write(P(G2), path, chunk_rows=10)
    with pytest.raises(ga.StoreMismatchError, match="model_fingerprint"):
        ga.store.open(path, like=P(G2))

    G3 = ga.grads(task, (X, y), layers=["2"])
    with pytest.raises(ga.StoreMismatchError, match="layers"):
        ga.store.write(P(G3), path, chunk_rows=10)
    with pytest.raises(ga.StoreMismatchError, match="layers"):
        ga.store.open(path, like=P(G3))

    with pytest.raises(ga.StoreMismatchError, match="chunk_rows"):
        ga.store.write(P(G), path, chunk_rows=5)
    other_data = ga.grads(task, (X.flip(0), y.flip(0)), layers=LAYERS)      # same ids 0..29
    with pytest.raises(ga.StoreMismatchError, match="expression differs"):
        ga.store.write(P(other_data), path, chunk_rows=10)
    G4 = ga.grads(task, (X, y), layers=LAYERS, ids=[f"x{i}" for i in range(len(y))])
    with pytest.raises(ga.StoreMismatchError, match="ids"):
        ga.store.open(path, like=P(G4))

    ga.store.write(other_seed, path, chunk_rows=10, overwrite=True)
    assert ga.store.open(path, like=other_seed).n == 30


def test_fingerprint_sees_values_dtypes_and_meta_shapes():
    a = models.mlp(seed=0)
    assert ga.store.model_fingerprint(a) == ga.store.model_fingerprint(models.mlp(seed=0))
    assert ga.store.model_fingerprint(a) != ga.store.model_fingerprint(models.mlp(seed=1))
    assert ga.store.model_fingerprint(a) != ga.store.model_fingerprint(models.mlp(seed=0, dtype=torch.float32))
    big = torch.nn.Linear(1000, 300)      # 300k weights: a strided sample
    fp = ga.store.model_fingerprint(big)
    with torch.no_grad():
        big.weight.view(-1)[0] += 1.0     # inside the sample (stride starts at 0)
    assert ga.store.model_fingerprint(big) != fp
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 3)
    assert ga.store.model_fingerprint(meta).startswith("model-")


def test_unfinished_or_foreign_paths_refuse_to_open(setting, tmp_path):
    _, G, _, _ = setting
    with pytest.raises(FileNotFoundError):
        ga.store.open(tmp_path / "missing.zarr")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("not a store")
    with pytest.raises(ga.StoreMismatchError, match="not a gradalg store"):
        ga.store.write(ga.proj.kron(k=4)(G), tmp_path / "foreign")


# ------------------------------------------------------------------------ operators and scores
@pytest.mark.parametrize("make", [
    lambda G, P: ga.fisher(P(G)).damp(1e-3),
    lambda G, P: ga.fisher(P(G), "block"),
    lambda G, P: ga.fisher(P(G), "diag"),
    lambda G, P: ga.kfac(G).damp(1e-2),
    lambda G, P: ga.arnoldi(ga.fisher(P(G)), rank=3),
], ids=["dense", "block", "diag", "kron", "lowrank"])
def test_operator_roundtrip(setting, tmp_path, make):
    _, G, Q, _ = setting
    P = ga.proj.kron(k=4, seed=0)
    H = make(G, P)
    H2 = ga.store.write_operator(H, tmp_path / "op.zarr")
    assert isinstance(H2, ga.Operator) and H2.space == H.space
    assert torch.equal(H2.to_dense(), ga.LocalExecutor().operator(H.expr).dense())   # the numbers written
    assert_close(H2.to_dense(), H.to_dense(), rtol=1e-10, atol=1e-12, what="operator")
    side = Q if H.space == G.space else P(Q)
    train = G if H.space == G.space else P(G)
    if H.structure != "lowrank":
        inv = (side @ H.damp(1e-3).inv() @ train.T).compute()
        inv2 = (side @ H2.damp(1e-3).inv() @ train.T).compute()
        # (rewrites may merge H's damping with this one in memory: equal up to rounding)
        assert_close(torch.from_numpy(inv2.values), torch.from_numpy(inv.values), rtol=1e-10, atol=1e-12,
                     what="scores through the stored operator")
    assert ga.store.write_operator(H, tmp_path / "op.zarr").expr == H2.expr   # already there


def test_operator_store_refusals(setting, tmp_path):
    task, G, _, (X, y) = setting
    P = ga.proj.kron(k=4, seed=0)
    ga.store.write_operator(ga.fisher(P(G)), tmp_path / "op.zarr")
    with pytest.raises(ga.StoreMismatchError, match="expression"):
        ga.store.write_operator(ga.fisher(P(G), "diag"), tmp_path / "op.zarr")
    with pytest.raises(ga.GradalgError, match="products"):
        ga.store.write_operator(ga.hessian(task, (X, y), layers=LAYERS), tmp_path / "h.zarr")
    assert not (tmp_path / "h.zarr").exists()


def test_scores_roundtrip_and_resume(setting, tmp_path, monkeypatch):
    _, G, Q, _ = setting
    P = ga.proj.kron(k=4, seed=0)
    S = P(Q) @ ga.fisher(P(G)).damp(1e-3).inv() @ P(G).T
    full = ga.store.write_scores(S, tmp_path / "once.zarr", chunk_rows=8)
    assert full.dims == ("query", "train") and full.shape == (5, 30)
    assert full.chunks == ((5,), (8, 8, 8, 6))                # Dask-backed, one block per chunk
    assert list(full.train.values) == list(G.ids)
    assert_close(torch.from_numpy(full.values), torch.from_numpy(S.compute().values), rtol=1e-9, atol=1e-11,
                 what="stored scores")
    # the TracIn-like sum of two terms, and the self-scores of the training set
    S2 = P(Q) @ P(G).T - 0.5 * (Q @ G.T)
    both = ga.store.write_scores(S2, tmp_path / "sum.zarr", chunk_rows=16)
    assert_close(torch.from_numpy(both.values), torch.from_numpy(S2.compute().values), rtol=1e-9,
                 atol=1e-11, what="sum of scores")

    real = store_scores._compute
    calls = []

    def failing(terms, a, b, *args):
        if a == 16:
            raise RuntimeError("interrupted")
        calls.append(a)
        return real(terms, a, b, *args)

    monkeypatch.setattr(store_scores, "_compute", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        ga.store.write_scores(S, tmp_path / "s.zarr", chunk_rows=8)
    with pytest.raises(ga.StoreIncompleteError):
        ga.store.open_scores(tmp_path / "s.zarr")
    calls.clear()
    monkeypatch.setattr(store_scores, "_compute", lambda terms, a, b, *args: calls.append(a) or real(terms, a, b, *args))
    ga.store.write_scores(S, tmp_path / "s.zarr", chunk_rows=8)
    assert calls == [16, 24]
    _assert_same_store(tmp_path / "s.zarr", tmp_path / "once.zarr")
    with pytest.raises(ga.StoreMismatchError, match="expression"):
        ga.store.write_scores(P(Q) @ P(G).T, tmp_path / "s.zarr", chunk_rows=8)
