"""Rows read outside a pass are *windows* of rows, each planned and run like any gradient
node (``Executor.window`` / ``Executor.windows``): a store's chunk, and the training rows
of DataInf applied on its own. Each window is a plan the runner runs (recorded here by
counting ``PassRunner.run``), its rows count derived from the memory budget
(``store_fraction`` of it), a window over the budget is refused by its plan with a fix that
works as written, and the numbers are the float64 references' on an MLP and a 2-layer GPT-2.
"""
import os
import sys

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.errors import MemoryBudgetError
from gradalg.exec import LocalExecutor
from gradalg.exec.runner import PassRunner

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread, reference_rows  # noqa: E402,F401
from test_plan_pull_path import _datainf_reference  # noqa: E402


def _mlp():
    task = ga.tasks.classification(models.mlp())
    X, y = models.classification_data(n=22)
    return task, (X, y), (X[:3], y[:3]), ["0", "2"]


def _gpt2():
    task = models.lm_task(models.gpt2(n_layer=2, n_embd=32))
    ids, mask = models.padded_token_data(n=8, max_len=6)
    return task, (ids, mask), (ids[:2], mask[:2]), ["transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_proj"]


CASES = {"mlp": _mlp, "gpt2": _gpt2}


def _recorded(monkeypatch) -> list:
    """Every plan the pass runner runs, in order."""
    plans, real = [], PassRunner.run

    def run(self, p):
        plans.append(p)
        return real(self, p)
    monkeypatch.setattr(PassRunner, "run", run)
    return plans


def _window(p) -> int:
    """The rows of a window's plan: one pass over data whose one job collects them."""
    [step] = p.passes
    [job] = step.jobs
    assert job.kind == "collect" and step.reads_data and step.seconds > 0
    return job.target.n


@pytest.mark.filterwarnings("ignore:blocks .* are factored")
@pytest.mark.parametrize("case,chunk_rows,windows", [("mlp", 8, [8, 8, 6]), ("gpt2", 3, [3, 3, 2])])
def test_a_store_is_written_from_planned_windows_of_its_chunks(case, chunk_rows, windows, tmp_path, monkeypatch):
    task, train, _, layers = CASES[case]()
    G = ga.grads(task, train, layers)
    plans = _recorded(monkeypatch)
    with ga.options(progress=False):
        stored = ga.store.write(G, tmp_path / "g.zarr", chunk_rows=chunk_rows)
    assert [_window(p) for p in plans] == windows          # one plan per chunk
    got = torch.cat([v.flatten(1) for v in stored.to_dense().values()], 1).to(torch.float64)
    torch.testing.assert_close(got, reference_rows(task, train, layers), rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:blocks .* are factored")
def test_a_store_chunk_over_the_budget_is_refused_by_its_plan_and_the_fix_works(tmp_path):
    task, train, _, layers = _mlp()
    G = ga.grads(task, train, layers)
    with ga.options(progress=False, memory_budget=6000):
        with pytest.raises(MemoryBudgetError) as err:
            ga.store.write(G, tmp_path / "g.zarr", chunk_rows=22)
        e = err.value
        assert e.subject == "pass over Sequential (22 examples)" and e.needed > e.budget == 6000
        assert e.fixes[0].startswith("write fewer rows per chunk (ga.store.write(..., chunk_rows=")
        assert "queries" not in str(e)          # a store chunk holds its rows: no queries to have fewer of
        rows = int(e.fixes[0].rsplit("=", 1)[1].rstrip(")"))
        assert 1 <= rows < 22
        stored = ga.store.write(G, tmp_path / "g.zarr", chunk_rows=rows)    # the fix, as written
    got = torch.cat([v.flatten(1) for v in stored.to_dense().values()], 1).to(torch.float64)
    torch.testing.assert_close(got, reference_rows(task, train, layers), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_datainf_applied_on_its_own_reads_its_rows_by_planned_windows(case, monkeypatch):
    """``executor.operator(datainf).apply(q)`` outside any plan: the training rows are read by
    plans of windows of them, each window the most rows whose kept bytes fit
    ``store_fraction`` of the budget; H⁻¹q equals DataInf's float64 reference."""
    task, train, queries, layers = CASES[case]()
    G = ga.grads(task, train, layers)
    budget = 2**26
    with ga.options(progress=False, memory_budget=budget):
        row = LocalExecutor().plan(G.expr).passes[0].fixed_bytes / G.n    # one kept row, as planned
    fraction = 3.5 * row / budget                                          # 3 rows a window
    with ga.options(progress=False, memory_budget=budget, store_fraction=fraction):
        ex = LocalExecutor()
        op = ex.operator(ga.datainf(G, 0.1).expr)
        before = ex.last_plan
        plans = _recorded(monkeypatch)
        R, RQ = reference_rows(task, train, layers), reference_rows(task, queries, layers)
        got = op.apply(RQ)
    sizes = [_window(p) for p in plans]
    assert sizes == [3] * (G.n // 3) + [G.n % 3] * (G.n % 3 > 0)
    assert all(p.passes[0].fixed_bytes <= fraction * budget for p in plans)
    assert ex.last_plan is before                              # the windows did not replace it
    want = _datainf_reference(R, RQ, 0.1, [b.dim for b in G.space.blocks])
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


def test_datainf_inside_a_pass_reads_windows_without_replacing_the_plan_that_runs(monkeypatch):
    """Self-scores apply DataInf in their own pass: the windows it reads are plans of their
    own, measured in ``nested_stats``; ``pass_stats`` keeps one entry per pass of the plan
    that runs (``explain(analyze=True)`` reads them by position), and ``last_plan`` stays
    the self-scores' plan."""
    task, train, queries, layers = _mlp()
    G, Q = ga.grads(task, train, layers), ga.grads(task, queries, layers)
    plans = _recorded(monkeypatch)
    with ga.options(progress=False):
        ex = LocalExecutor()
        got = ex.diagonal((Q @ ga.datainf(G, 0.1) @ Q.T).diag().expr)
    outer = [p for p in plans if any(j.kind == "diag" for s in p.passes for j in s.jobs)]
    windows = [p for p in plans if p not in outer]
    assert len(outer) == 1 and ex.last_plan is outer[0]
    assert [_window(p) for p in windows] == [G.n]             # all 22 rows fit one window
    assert [e["key"] for e in ex.pass_stats] == [p.key for p in outer[0].passes]
    assert [e["key"] for e in ex.nested_stats] == [p.key for w in windows for p in w.passes]
    R, RQ = reference_rows(task, train, layers), reference_rows(task, queries, layers)
    want = (_datainf_reference(R, RQ, 0.1, [b.dim for b in G.space.blocks]) * RQ).sum(1)
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want.numpy(), rtol=1e-8, atol=1e-10)


def test_datainf_over_group_means_reads_them_from_one_planned_window(monkeypatch):
    """Rows that cannot be computed by ranges (group means) are one window: a plan whose
    group job computes the means (not a job run by hand), the numbers of the reference.
    (Rows a plan of the executor kept are read, not computed again: dropped here.)"""
    task, train, queries, layers = _mlp()
    G = ga.grads(task, train, layers)
    groups = [i % 4 for i in range(G.n)]
    with ga.options(progress=False):
        ex = LocalExecutor()
        op = ex.operator(ga.datainf(G.group_mean(groups), 0.1).expr)
        ex.state.rows.clear()
        plans = _recorded(monkeypatch)
        R, RQ = reference_rows(task, train, layers), reference_rows(task, queries, layers)
        got = op.apply(RQ)
    assert [[sorted(j.kind for j in s.jobs) for s in p.passes] for p in plans] == [[["group"], ["collect"]]]
    index = torch.tensor(groups)
    means = torch.stack([R[index == g].mean(0) for g in range(4)])
    want = _datainf_reference(means, RQ, 0.1, [b.dim for b in G.space.blocks])
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


def test_the_operators_of_a_windowed_chain_are_resolved_once(monkeypatch):
    """DataInf over rows normalized by a Fisher metric, read in windows: the Fisher is one
    plan (resolved once, then a leaf of every window), the rows the reference's."""
    task, train, queries, layers = _mlp()
    G = ga.grads(task, train, layers)
    N = G.normalize(metric=ga.fisher(G, structure="block").damp(0.1).inv())
    with ga.options(progress=False, memory_budget=2**26):
        row = LocalExecutor().plan(G.expr).passes[0].fixed_bytes / G.n
    plans = _recorded(monkeypatch)
    with ga.options(progress=False, memory_budget=2**26, store_fraction=5.5 * row / 2**26):
        ex = LocalExecutor()
        op = ex.operator(ga.datainf(N, 0.1).expr)
        R, RQ = reference_rows(task, train, layers), reference_rows(task, queries, layers)
        got, again = op.apply(RQ), op.apply(RQ)
    kinds = [sorted({j.kind for s in p.passes for j in s.jobs}) for p in plans]
    assert kinds[0] == ["fisher"] and kinds[1:] == [["collect"]] * 2 * -(-G.n // 5)   # 5 rows a window
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    blocks = [b.dim for b in G.space.blocks]
    inv = torch.block_diag(*[torch.linalg.inv(b.T @ b / len(b) + 0.1 * torch.eye(b.shape[1], dtype=b.dtype))
                             for b in R.split(blocks, 1)])
    normalized = R / ((R @ inv) * R).sum(1, keepdim=True).sqrt()
    want = _datainf_reference(normalized, RQ, 0.1, blocks)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


def test_datainf_over_gauss_newton_terms_reads_them_in_one_planned_window(monkeypatch):
    """Rows of ``objective="expected"`` (one per Gauss-Newton term, not per example) are
    not cut into windows of examples: one planned window of all of them; the self-scores
    equal the diagonal of the full scores, whose DataInf is the planned apply job."""
    task, train, queries, layers = _mlp()
    G, Q = ga.grads(task, train, layers, objective="expected"), ga.grads(task, queries, layers)
    S = Q @ ga.datainf(G, 0.1) @ Q.T
    with ga.options(progress=False):
        full = np.asarray(S.compute(executor=LocalExecutor()).values)
        plans = _recorded(monkeypatch)
        got = np.asarray(S.diag().compute(executor=LocalExecutor()).values)
    windows = [p for p in plans if not any(j.kind == "diag" for s in p.passes for j in s.jobs)]
    assert [p.passes[0].jobs[0].target.n for p in windows] == [G.n]          # all 22 examples, one window
    np.testing.assert_allclose(got, np.diag(full), rtol=1e-10, atol=1e-12)


def test_analyzed_passes_are_the_plan_s_own_when_windows_run_inside_one():
    """``explain(analyze=True)`` of DataInf self-scores: each measured row is its own pass's
    (the same pass key), not a window's read inside it; the pass's measured time includes
    the window's."""
    task, train, queries, layers = _mlp()
    G, Q = ga.grads(task, train, layers), ga.grads(task, queries, layers)
    with ga.options(progress=False):
        e = (Q @ ga.datainf(G, 0.1) @ Q.T).diag().explain(analyze=True)
    assert [s["key"] for s in e.analyzed] == [p.key for p in e.plan.passes]
    assert [r["measured_seconds"] for r in e.passes()] == [s["seconds"] for s in e.analyzed]


def _applied(use, ex, Q, H, G, RQ):
    """``use``'s DataInf applied by ``ex``: its numbers (float64) and their float64 reference
    as a function of DataInf's H⁻¹RQ (``want(HRQ)``)."""
    if use == "on_its_own":
        return ex.operator(H.expr).apply(RQ), lambda HRQ: HRQ
    if use == "self_scores":
        return torch.as_tensor(ex.diagonal((Q @ H @ Q.T).diag().expr)), lambda HRQ: (HRQ * RQ).sum(1)
    return torch.as_tensor(ex.scores((Q @ (H * 2.0) @ G.T).expr)), None


WINDOWED = {"on_its_own": lambda Q, H, G: H, "self_scores": lambda Q, H, G: (Q @ H @ Q.T).diag(),
            "a_multiple": lambda Q, H, G: Q @ (H * 2.0) @ G.T}


@pytest.mark.parametrize("use", sorted(WINDOWED))
def test_explain_shows_the_windows_datainf_reads_outside_an_apply_job(use, monkeypatch):
    """Where no planned apply job reads DataInf's rows (its operator on its own, self-scores,
    a multiple of it), it reads them at each application in windows, each a plan of its
    own: ``explain()`` shows them as a ``WINDOWS`` decision, with the numbers that run
    (22 rows, 3 a window under ``store_fraction``: 8 windows, the last of 1 row); where an
    apply job reads them (``Q @ H @ G.T``) it shows none. The numbers are the float64
    reference's."""
    task, train, queries, layers = _mlp()
    G, Q = ga.grads(task, train, layers), ga.grads(task, queries, layers)
    H, budget = ga.datainf(G, 0.1), 2**26
    with ga.options(progress=False, memory_budget=budget):
        row = LocalExecutor().plan(G.expr).passes[0].fixed_bytes / G.n    # one kept row, as planned
    with ga.options(progress=False, memory_budget=budget, store_fraction=3.5 * row / budget):   # 3 rows a window
        explained, applied = WINDOWED[use](Q, H, G).explain(), str((Q @ H @ G.T).explain())
        text = str(explained)
        plans, ex = _recorded(monkeypatch), LocalExecutor()
        R, RQ = reference_rows(task, train, layers), reference_rows(task, queries, layers)
        got, want = _applied(use, ex, Q, H, G, RQ)
    assert "- windows of the rows datainf⁻¹(λ=0.1) reads when applied: chose 8 windows of 3 rows  [" in text
    assert "[one window of all rows: 7.92 kB kept; " in text and "(360 B a row) fit the store cap" in text
    assert "windows of the rows" not in applied
    decision = explained.plan.decisions.one("windows")
    assert decision.subject == H.expr.token and decision.chosen == "8 windows of 3 rows"
    assert [_window(p) for p in plans if p is not ex.last_plan] == [3] * 7 + [1]     # what ran: one application
    HRQ = _datainf_reference(R, RQ, 0.1, [b.dim for b in G.space.blocks])
    want = want(HRQ) if want is not None else 2.0 * HRQ @ R.T
    torch.testing.assert_close(got.to(torch.float64), want, rtol=1e-8, atol=1e-10)
