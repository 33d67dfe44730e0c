"""A pass's batch size and whether the resident set is trimmed after its batches are the
plan's (the size stage: ``Pass.batch_size``, ``Pass.trim_after_batches``, a ``BATCH_SIZE``
and a ``TRIM`` decision per pass over data), shown per pass by ``explain()``, and the runner
reads only them: a plan run under other options batches and trims as planned."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import gradalg as ga
import gradalg.exec.runner as runner_module
from gradalg.exec import Executor
from gradalg.plan import DecisionKind, estimates
from gradalg.plan.decisions import DecisionSource
from gradalg.plan.planner import plan

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread, reference_rows  # noqa: E402,F401 - an autouse fixture

LAYERS = ["0", "2"]
N = 12


@pytest.fixture(scope="module")
def task():
    return ga.tasks.classification(models.mlp())


def _queries(task):
    return ga.grads(task, models.classification_data(3, seed=2), LAYERS)


def _data_passes(p):
    return [q for q in p.passes if q.reads_data]


def _check_decisions(p) -> None:
    """Every pass over data carries an int batch size and a trim flag, each its decision's (the
    working set of its largest batch: at most its examples)."""
    for q in _data_passes(p):
        assert isinstance(q.batch_size, int) and q.batch_size >= 1
        sized = p.decisions.of(DecisionKind.BATCH_SIZE, subject=q.key)
        trims = p.decisions.of(DecisionKind.TRIM, subject=q.key)
        assert sized and {d.chosen for d in sized} == {str(q.batch_size)}
        assert trims and {d.chosen for d in trims} == {"after each batch" if q.trim_after_batches else "never"}
        assert q.trim_after_batches == (q.per_example_bytes * min(q.batch_size, q.key.n) >= p.options.release_memory_above)


@pytest.mark.parametrize("loader", ["batch_size", "batch_sampler"])
def test_a_dataloader_fixes_the_batch_the_plan_shows(task, loader):
    ds = TensorDataset(*models.classification_data(N, seed=1))
    source = DataLoader(ds, batch_size=5) if loader == "batch_size" else \
        DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 5, False))
    G = ga.grads(task, source, LAYERS)
    p = plan((_queries(task) @ G.T).expr)
    train = next(q for q in p.passes if q.reads_data and q.key.n == N)
    assert train.batch_size == 5          # the sampler's largest batch: never None for a pass over data
    _check_decisions(p)
    # the schedule stage's estimate of reading the data again prices the same batches
    unsized = estimates.capture_cost(G.expr, p.options, torch.float64)
    assert unsized == estimates.capture_cost(G.expr, p.options, torch.float64, batch=5)
    assert unsized != estimates.capture_cost(G.expr, p.options, torch.float64, batch=N)


def test_the_budget_shrinks_the_batch_and_the_plan_keeps_it(task):
    G = ga.grads(task, models.classification_data(N, seed=1), LAYERS)
    S = _queries(task) @ G.T
    free = plan(S.expr)
    big = max(_data_passes(free), key=lambda q: q.key.n)
    budget = int(big.fixed_bytes + 3.5 * big.per_example_bytes)    # three examples beside what it holds
    with ga.options(memory_budget=budget):
        p = plan(S.expr)
    train = max(_data_passes(p), key=lambda q: q.key.n)
    assert train.batch_size == 3 < p.options.batch_size
    assert train.trim_after_batches is False       # 3 examples' bytes are under release_memory_above (1 MiB)
    _check_decisions(p)
    with ga.options(memory_budget=budget, release_memory_above=3 * big.per_example_bytes):
        assert max(_data_passes(plan(S.expr)), key=lambda q: q.key.n).trim_after_batches is True


def test_a_pass_over_rows_in_memory_has_no_batch_and_no_trim(task):
    G = ga.grads(task, models.classification_data(N, seed=1), LAYERS)
    p = plan((_queries(task) @ ga.ekfac(G).damp(0.1).inv() @ G.T).expr)
    memory = [q for q in p.passes if not q.reads_data]
    assert memory, [q.label for q in p.passes]
    keys = {d.subject for d in p.decisions.of(DecisionKind.TRIM)}
    assert keys == {q.key for q in _data_passes(p)}
    for q in memory:
        assert q.batch_size is None and q.trim_after_batches is False and q.key not in keys
    _check_decisions(p)


class _Counting:
    """A stand-in for :class:`~gradalg.exec.allocator.ResidentGuard` that counts its batches."""

    made = []

    def __init__(self, growth):
        self.growth, self.batches = growth, 0
        _Counting.made.append(self)

    def after_batch(self):
        self.batches += 1


def test_release_memory_above_flips_the_trim_and_the_runner_follows_the_plan(task, monkeypatch):
    G = ga.grads(task, models.classification_data(N, seed=1), LAYERS)
    S = _queries(task) @ G.T
    with ga.options(batch_size=4, progress=False):
        work = max(q.per_example_bytes * min(q.batch_size, q.key.n) for q in _data_passes(plan(S.expr)))
    flags = {}
    for above in (work, 2 * work + 1):
        with ga.options(batch_size=4, progress=False, release_memory_above=above):
            ex = Executor()
            p = ex.plan(S.expr)
        flags[above] = {q.key.n: q.trim_after_batches for q in _data_passes(p)}
        _check_decisions(p)
        assert {d.source for d in p.decisions.of(DecisionKind.TRIM)} == {DecisionSource.PLANNER}
        # the runner reads the plan, not the options: run under options that say the opposite
        monkeypatch.setattr(runner_module, "ResidentGuard", _Counting)
        _Counting.made = []
        ex.options = dataclasses.replace(ex.options, release_memory_above=0.0 if above > work else float("inf"),
                                         batch_size=1)
        ex.run(p)
        want = [-(-q.key.n // q.batch_size) for q in p.passes if q.reads_data and q.trim_after_batches]
        assert (N // 4 in want) == (above == work)     # the 12 examples in the plan's batches of 4, not of 1
        assert sorted(g.batches for g in _Counting.made) == sorted(want)
    assert flags[work][N] is True and flags[2 * work + 1][N] is False


def test_explain_shows_the_batch_and_trim_per_pass(task):
    G = ga.grads(task, models.classification_data(N, seed=1), LAYERS)
    with ga.options(release_memory_above=0):
        p = plan((_queries(task) @ ga.ekfac(G).damp(0.1).inv() @ G.T).expr)
    from gradalg.plan.explain import Explain
    shown = Explain(p)
    rows = shown.passes()
    assert [r["batch_size"] for r in rows] == [q.batch_size for q in p.passes]
    assert [r["trim_after_batches"] for r in rows] == [q.trim_after_batches for q in p.passes]
    assert all(r["trim_after_batches"] for r in rows if r["reads_data"])     # forced by release_memory_above=0
    forced = p.decisions.of(DecisionKind.TRIM)
    assert forced and all(d.source is DecisionSource.OPTIONS and d.setting == "release_memory_above=0"
                          for d in forced)
    table = next(part for part in shown._physical().parts if hasattr(part, "columns"))
    trim = [c.name for c in table.columns].index("trim")
    assert [row[trim] for row in table.rows] == ["yes" if q.reads_data else "-" for q in p.passes]
    html = shown._repr_html_()
    assert "<th title=" in html and ">trim</th>" in html


def test_an_unbatched_dataloader_is_read_in_the_batches_the_budget_allows(task, monkeypatch):
    """``DataLoader(batch_size=None)`` yields single examples that gradalg groups: the plan
    sizes its batch like a Dataset's (before: None, and the runner grouped
    ``ga.options().batch_size`` whatever the budget), and the scores are the reference's."""
    X, y = models.classification_data(N, seed=1)
    queries = models.classification_data(3, seed=2)
    G = ga.grads(task, DataLoader(TensorDataset(X, y), batch_size=None), LAYERS)
    S = ga.grads(task, queries, LAYERS) @ G.T
    big = max(_data_passes(plan(S.expr)), key=lambda q: q.key.n)
    monkeypatch.setattr(runner_module, "ResidentGuard", _Counting)
    _Counting.made = []
    with ga.options(memory_budget=int(big.fixed_bytes + 3.5 * big.per_example_bytes), release_memory_above=0,
                    progress=False):
        ex = Executor()
        scores = ex.scores(S.expr)
    train = max(_data_passes(ex.last_plan), key=lambda q: q.key.n)
    assert train.batch_size == 3 and train.trim_after_batches is True
    _check_decisions(ex.last_plan)
    assert N // 3 in [g.batches for g in _Counting.made]      # 12 examples read in 4 batches of 3
    ref = reference_rows(task, queries, LAYERS) @ reference_rows(task, (X, y), LAYERS).T
    torch.testing.assert_close(torch.as_tensor(scores), ref)


def test_a_pass_over_a_store_reads_its_chunks_untrimmed(task, tmp_path, monkeypatch):
    """Rows captured earlier (a store) are read in the chunks they were written in: the
    pass has no batch size and no trim, no ``TRIM`` decision, and the runner guards no batch
    of it even where ``release_memory_above=0`` trims every pass over data."""
    pytest.importorskip("zarr")
    P = ga.proj.gaussian(k=6, seed=0)
    G = ga.grads(task, models.classification_data(N, seed=1), LAYERS)
    stored = ga.store.write(P(G), tmp_path / "g.zarr", chunk_rows=5)
    S = P(_queries(task)) @ stored.T
    monkeypatch.setattr(runner_module, "ResidentGuard", _Counting)
    _Counting.made = []
    with ga.options(release_memory_above=0, progress=False):
        ex = Executor()
        scores = ex.scores(S.expr)
    p = ex.last_plan
    store = [q for q in p.passes if q.key.rows is not None]
    assert store and all(q.batch_size is None and q.trim_after_batches is False for q in store)
    assert {d.subject for d in p.decisions.of(DecisionKind.TRIM)} == {q.key for q in _data_passes(p)}
    assert all(q.trim_after_batches for q in _data_passes(p))           # forced: release_memory_above=0
    assert len(_Counting.made) == len(_data_passes(p))                  # one guard per pass over data, none for the store
    torch.testing.assert_close(torch.as_tensor(scores), torch.as_tensor((P(_queries(task)) @ P(G).T).compute().values))
