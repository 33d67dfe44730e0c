"""``S.topk(k)`` equals a stable sort of ``S.compute()`` (score, then training position)
for several methods, both held sides, stored and recomputed training rows, two batch
sizes and the Dask executor; ties are broken by training position; the (query × train)
matrix is never formed (peak memory flat in n_train, in a fresh process);
``S.compute(store=...)`` writes a resumable score store."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.plan.jobs import TopKAccumulator, select_topk
from gradalg.exec.local import LocalExecutor
from gradalg.plan import Choices
from gradalg.plan.jobs import TopK, TopKJob
from gradalg.plan.planner import PlanError, plan

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread  # noqa: E402,F401 - an autouse fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_topk(full: np.ndarray, k: int, largest: bool):
    """The first k of a stable sort of each row by score, then by training position."""
    pos = np.broadcast_to(np.arange(full.shape[1]), full.shape)
    order = np.lexsort((pos, -full if largest else full), axis=1)[:, :k]
    return np.take_along_axis(full, order, 1), order


def assert_topk_matches(top, computed, k, largest):
    """``top`` against the DataArray ``computed`` = S.compute()."""
    full, train_ids = computed.values, list(computed["train"].values)
    values, order = reference_topk(full, k, largest)
    assert top.dims == ("query", "rank") and top.shape == (full.shape[0], min(k, full.shape[1]))
    np.testing.assert_allclose(top.values, values, rtol=1e-10, atol=1e-12)
    # the returned training rows have the returned scores
    got = np.asarray(top["train"].values)
    position = {i: p for p, i in enumerate(train_ids)}
    rows = np.vectorize(position.__getitem__)(got)
    np.testing.assert_allclose(np.take_along_axis(full, rows, 1), top.values, rtol=1e-10, atol=1e-12)
    # and are the reference's wherever the scores are not (numerically) tied
    gaps = np.abs(np.diff(np.sort(full, axis=1), axis=1)).min()
    if gaps > 1e-9:
        np.testing.assert_array_equal(rows, order)


@pytest.fixture(scope="module")
def setting():
    model = models.mlp()
    task = ga.tasks.classification(model)
    x, y = models.classification_data(45, seed=1)
    xq, yq = models.classification_data(6, seed=2)
    ids = [f"t{i}" for i in range(45)]
    return task, TensorDataset(x, y), TensorDataset(xq, yq), ids


def _methods(task, train, query, ids):
    G = ga.grads(task, train, ids=ids)
    Q = ga.grads(task, query)
    P = ga.proj.gaussian(12, seed=4)
    return {
        "grad_dot": Q @ G.T,
        "influence_projected": P(Q) @ ga.fisher(P(G)).damp(0.01).inv() @ P(G).T,
        "trak": ga.methods.trak(task, train, query, k=12, seed=3),
        "tracin_like_sum": P(Q) @ P(G).T - 0.5 * (Q @ G.normalize().T),
        # terms streaming two nodes after a Fisher of one: read together from the data, never stored
        "influence_plus_grad_dot": P(Q) @ ga.fisher(P(G)).damp(0.01).inv() @ P(G).T + 0.5 * (Q @ G.T),
    }


@pytest.mark.parametrize("store", ["always", "never"])
@pytest.mark.parametrize("batch_size", [7, 16])
def test_topk_equals_the_sorted_full_matrix(setting, store, batch_size):
    task, train, query, ids = setting
    with ga.options(batch_size=batch_size, progress=False):
        for name, S in _methods(task, train, query, ids).items():
            full = S.compute()
            for largest in (True, False):
                top = S.topk(5, largest=largest, executor=LocalExecutor(choices=Choices(store=store)))
                assert_topk_matches(top, full, 5, largest)
                assert list(top["query"].values) == list(range(6)), name


def test_topk_holding_the_training_side(setting):
    """A single term may hold the training rows: each chunk of queries is ranked whole."""
    task, train, query, ids = setting
    S = _methods(task, train, query, ids)["influence_projected"]
    ex = LocalExecutor(choices=Choices(held="right"))
    top = S.topk(4, executor=ex)
    job = next(j for p in ex.last_plan.passes for j in p.jobs if isinstance(j, TopKJob))
    assert job.terms[0][1].transposed
    assert_topk_matches(top, S.compute(), 4, True)


def test_k_beyond_the_training_set_returns_every_row(setting):
    task, train, query, ids = setting
    S = _methods(task, train, query, ids)["grad_dot"]
    top = S.topk(100, largest=False)
    assert top.shape == (6, 45)
    assert_topk_matches(top, S.compute(), 100, False)


def test_ties_rank_by_training_position():
    """Exactly tied scores, in any order of arrival: lower position first (a stable sort)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (9, 60), generator=g).double()      # many ties
    for largest in (True, False):
        ref_v, ref_p = reference_topk(scores.numpy(), 7, largest)
        acc = TopKAccumulator(7, largest)
        for a in range(0, 60, 11):                                  # streamed in blocks
            acc.update(scores[:, a:a + 11], a)
        v, p = acc.finish()
        np.testing.assert_array_equal(p.numpy(), ref_p)
        np.testing.assert_array_equal(v.numpy(), ref_v)
        # shards absorbed in either order give the same ranking
        parts = []
        for a in (30, 0):
            part = TopKAccumulator(7, largest)
            part.update(scores[:, a:a + 30], a)
            parts.append(part.export())
        merged = TopKAccumulator(7, largest)
        for part in parts:
            merged.absorb(part)
        np.testing.assert_array_equal(merged.finish()[1].numpy(), ref_p)
        perm = torch.randperm(60, generator=g)
        v2, p2 = select_topk(scores[:, perm], perm.expand(9, -1), 7, largest)
        np.testing.assert_array_equal(p2.numpy(), ref_p)


def test_a_nan_score_is_refused():
    acc = TopKAccumulator(2, True)
    with pytest.raises(ga.errors.DataError, match="NaN"):
        acc.update(torch.tensor([[1.0, float("nan")]]), 0)


def test_plan_has_one_topk_job_of_n_query_k_bytes(setting):
    task, train, query, ids = setting
    S = _methods(task, train, query, ids)["tracin_like_sum"]
    p = plan(S.expr, topk=TopK(3, largest=False))
    jobs = [j for step in p.passes for j in step.jobs if isinstance(j, TopKJob)]
    assert len(jobs) == 1 and len(jobs[0].terms) == 2
    assert jobs[0].output_bytes(45) == 16 * 6 * 3                 # n_query·k, whatever n_train
    assert all(not t.transposed for _, t in jobs[0].terms)      # a sum's terms hold the queries
    assert "scores" not in {j.kind for step in p.passes for j in step.jobs}
    text = str(S.explain(topk=3, largest=False))
    assert "top-3 (smallest)" in text


def test_refusals(setting):
    task, train, query, ids = setting
    other = ga.tasks.classification(models.mlp(seed=5))
    S = ga.methods.grad_dot(task, train, query) + ga.methods.grad_dot(other, train, query)
    with pytest.raises(PlanError, match="one pass"):
        S.topk(3)
    with pytest.raises(ValueError, match="positive integer"):
        ga.methods.grad_dot(task, train, query).topk(0)


@pytest.mark.slow
def test_dask_merges_the_shards_topk(setting):
    task, train, query, ids = setting
    methods = _methods(task, train, query, ids)
    with ga.options(progress=False, batch_size=8):
        # store="never": the training rows are re-read after the Fisher, so the top-k pass is sharded
        with ga.exec.DaskExecutor(n_workers=2, threads_per_worker=1, min_shard_examples=1,
                                  choices=Choices(store="never")) as dx:
            for name in ("influence_projected", "tracin_like_sum"):
                S = methods[name]
                top = S.topk(6, executor=dx)
                passes = dx.last_plan.passes
                topk_pass = next(p for p in passes if any(isinstance(j, TopKJob) for j in p.jobs))
                # sharded: each shard's top-k merged on the client
                assert dx.describe_pass(topk_pass).startswith("4 shard tasks"), dx.describe_pass(topk_pass)
                assert_topk_matches(top, S.compute(), 6, True)


def test_compute_into_a_store_equals_memory_and_resumes(setting, tmp_path, monkeypatch):
    from gradalg.store import scores as store_scores

    task, train, query, ids = setting
    S = _methods(task, train, query, ids)["influence_projected"]
    full = S.compute()
    stored = S.compute(store=tmp_path / "s.zarr", chunk_rows=10)
    assert stored.chunks == ((6,), (10, 10, 10, 10, 5))          # Dask-backed, a block per chunk
    np.testing.assert_allclose(stored.values, full.values, rtol=1e-10, atol=1e-12)
    assert list(stored["train"].values) == ids

    real, calls = store_scores._compute, []

    def interrupted(terms, a, b, *args):
        if a == 20:
            raise RuntimeError("killed")
        return real(terms, a, b, *args)

    monkeypatch.setattr(store_scores, "_compute", interrupted)
    with pytest.raises(RuntimeError, match="killed"):
        S.compute(store=tmp_path / "r.zarr", chunk_rows=10)
    monkeypatch.setattr(store_scores, "_compute",
                        lambda terms, a, b, *args: calls.append(a) or real(terms, a, b, *args))
    resumed = S.compute(store=tmp_path / "r.zarr", chunk_rows=10)
    assert calls == [20, 30, 40]                                  # only the missing blocks
    np.testing.assert_allclose(resumed.values, full.values, rtol=1e-10, atol=1e-12)


def _peak(n_train: int, n_query: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADALG_PROGRESS": "0",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    script = os.path.join(ROOT, "tests", "budget_scripts", "topk_memory.py")
    out = subprocess.run([sys.executable, script, str(n_train), str(n_query)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_topk_peak_memory_is_flat_in_training_rows():
    """n and 4n training rows, 4,000 queries: the full float32 matrix would be 64 MB at n
    and grow by 192 MB to 4n; the top-k's peak (fresh process, VmHWM) grows by less than
    a tenth of that (allocator noise of a few MB) and stays under half the n-row matrix."""
    n, n_query = 4000, 4000
    small, large = _peak(n, n_query), _peak(4 * n, n_query)
    full_small, full_large = 4.0 * n_query * n, 4.0 * n_query * 4 * n
    assert large["peak_growth"] - small["peak_growth"] <= 0.1 * (full_large - full_small), (small, large)
    assert large["peak_growth"] <= 0.5 * full_small, (small, large)
