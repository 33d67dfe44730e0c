"""A pass over fewer examples than its batch holds only the examples there are: its
largest real batch, ``min(batch, n)`` (``DataRef.largest_batch``; for data with its own
batch size, e.g. ``ga.grads(..., batch_size=32)`` or a batching DataLoader, the same
bound), is the pass's ``BATCH_SIZE`` decision and what its peak memory and per-batch work
are priced at. (The 4-query pass of ``peak_memory.py gpt2_logra`` was priced at a batch
of 16: 16.3 MiB estimated, 3.3 MiB measured.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gradalg as ga
from gradalg.errors import MemoryBudgetError
from gradalg.plan import DecisionKind
from gradalg.plan.planner import plan

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread, reference_rows  # noqa: E402,F401 - an autouse fixture

MiB = 2**20


def _logra(queries):
    """LoGra's expression on a small GPT-2 (2 layers, width 64, 32 tokens), as in
    ``peak_memory.py gpt2_logra``: 40 training sequences, the queries as given."""
    model = models.gpt2(dtype=torch.float32, n_layer=2, n_embd=64)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 101, (44, 32), generator=g)
    task = models.lm_task(model)
    P = ga.proj.kron(k=16, seed=0)
    G = ga.grads(task, (ids[:40], torch.ones_like(ids[:40])))
    return P(queries(task, ids[40:], torch.ones_like(ids[40:]))) @ ga.ekfac(P(G)).damp(1e-3).inv() @ P(G).T


def _query_pass(S):
    p = plan(S.expr)
    return p, next(q for q in p.passes if q.reads_data and q.key.n == 4)


@pytest.mark.parametrize("budget", [1 << 30, 16 * MiB])
def test_a_pass_over_4_queries_is_priced_at_a_batch_of_4(budget):
    """At the default batch of 16 the 4-query pass's batch, peak and seconds are those of the
    same pass read in batches of 4 (``ga.grads(..., batch_size=4)``), and of one read by a
    DataLoader in batches of 16 (one batch of 4); its decision says why."""
    with ga.options(batch_size=16, memory_budget=budget):
        p, small = _query_pass(_logra(lambda task, ids, mask: ga.grads(task, (ids, mask))))
        _, four = _query_pass(_logra(lambda task, ids, mask: ga.grads(task, (ids, mask), batch_size=4)))
        _, loader = _query_pass(_logra(lambda task, ids, mask: ga.grads(
            task, DataLoader(TensorDataset(ids, mask), batch_size=16))))
    assert small.batch_size == four.batch_size == loader.batch_size == 4
    assert small.cost.peak_bytes == four.cost.peak_bytes == loader.cost.peak_bytes
    assert small.cost.peak_bytes == pytest.approx(small.fixed_bytes + 4 * small.per_example_bytes)
    assert small.seconds == four.seconds == loader.seconds
    decision = p.decisions.one(DecisionKind.BATCH_SIZE, subject=small.key)
    assert decision.chosen == "4" and decision.alternatives["ga.options"] == "16"
    assert "the pass has 4 examples: one batch holds them all" in decision.reason
    # the plan's peak is the largest pass's: the 40-example pass's, not a 4-example pass at 16
    assert p.peak_bytes == max(q.cost.peak_bytes for q in p.passes)


def test_a_budget_the_small_pass_fits_at_its_real_batch_is_not_refused():
    """Two queries read with ``batch_size=32``: under a budget that holds them in one batch
    of 2 (and every other pass at a batch of one) but not 32 of them, the plan runs (it was
    refused, priced at 32) and its scores are the dense reference's."""
    task = ga.tasks.classification(models.mlp())
    layers = ["0", "2"]
    train, query = models.classification_data(12, seed=1), models.classification_data(2, seed=2)
    S = ga.grads(task, query, layers, batch_size=32) @ ga.grads(task, train, layers).T
    big = plan(S.expr)
    q = next(p for p in big.passes if p.reads_data and p.key.n == 2)
    budget = 1.01 * max(q.fixed_bytes + 2 * q.per_example_bytes,
                        *(p.fixed_bytes + p.per_example_bytes for p in big.passes))
    assert q.fixed_bytes + 32 * q.per_example_bytes > budget   # priced at 32, the pass is over it
    with ga.options(memory_budget=budget, progress=False):
        sized = plan(S.expr)
        values = S.compute().values
    assert next(p for p in sized.passes if p.key == q.key).batch_size == 2 and sized.peak_bytes <= budget
    expected = reference_rows(task, query, layers) @ reference_rows(task, train, layers).T
    torch.testing.assert_close(torch.as_tensor(values, dtype=torch.float64), expected, rtol=1e-10, atol=1e-12)


def test_a_refusal_prices_a_small_pass_at_its_real_batch():
    """Under a budget below even one batch of the 2 queries, the refusal is still raised."""
    task = ga.tasks.classification(models.mlp())
    query = models.classification_data(2, seed=2)
    S = ga.grads(task, query, ["0", "2"], batch_size=32) @ ga.grads(task, models.classification_data(12), ["0", "2"]).T
    q = next(p for p in plan(S.expr).passes if p.reads_data and p.key.n == 2)
    with ga.options(memory_budget=q.fixed_bytes + 1.5 * q.per_example_bytes), pytest.raises(MemoryBudgetError):
        plan(S.expr)


#: run in a fresh process: the small pass is the first pass over data after a warm-up and a
#: reset of the peak-resident mark, so ``explain(analyze=True)`` reads its own peak
_ANALYZE = r"""
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/budget_scripts"]
import gradalg as ga, models
from peak_memory import reset_peak
torch.set_num_threads(1)
model = models.gpt2(dtype=torch.float32, n_layer=2, n_embd=64)
ids = torch.randint(1, 101, (36, 32), generator=torch.Generator().manual_seed(0))
mask, task, P = torch.ones_like(ids), models.lm_task(model), ga.proj.kron(k=16, seed=0)
scores = lambda m: P(ga.grads(task, (ids[32:], mask[32:]))) @ P(ga.grads(task, (ids[:m], mask[:m]))).T
with ga.options(progress=False):
    scores(8).compute()
reset_peak()
with ga.options(progress=False, batch_size=16):
    rows = scores(32).explain(analyze=True).passes()
print(json.dumps([{k: r.get(k) for k in ("reads", "batch_size", "peak_bytes", "measured_rss_growth_bytes",
                                         "measured_rss_is_bound")} for r in rows]))
"""


@pytest.mark.slow
def test_the_measured_peak_of_a_small_pass_is_within_2x_of_its_estimate():
    """``explain(analyze=True)``: the 4-query pass (batch 16, one batch of 4) grows the
    resident set by 3.7-3.9 MiB (3 runs); estimated at its real batch, 4.1 MiB, within 2×
    (priced at 16 it read 16.3 MiB, over 4×; on main this test fails)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADALG_PROGRESS": "0",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _ANALYZE, os.path.dirname(os.path.abspath(__file__))],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    small = next(r for r in rows if "(4 examples)" in r["reads"])
    if small["measured_rss_is_bound"] or small["measured_rss_growth_bytes"] is None:
        pytest.skip(f"the small pass's own peak was not read here: {rows}")
    measured, estimated = small["measured_rss_growth_bytes"], small["peak_bytes"]
    assert small["batch_size"] == 4 and measured / 2 <= estimated <= 2 * measured, (measured / MiB, rows)


def test_a_products_pass_over_fewer_examples_than_its_batch_is_priced_at_them():
    """CG influence with the Gauss-Newton known through products over 5 training examples
    at ``batch_size=32``: each call reads one batch of 5, its peak is 5 examples' work."""
    task = ga.tasks.classification(models.mlp())
    X, y = models.classification_data(n=8)
    S = ga.methods.influence(task, (X[:5], y[:5]), (X[5:], y[5:]), solver="cg", curvature="gauss_newton",
                             damping=0.1, solver_settings={"max_iter": 3})
    with ga.options(batch_size=32):
        [step] = [p for p in plan(S.expr).passes if p.per_call]
    assert step.batch_size == 5
    assert step.cost.peak_bytes == pytest.approx(step.fixed_bytes + 5 * step.per_example_bytes)


def test_a_products_call_over_a_dataloader_is_priced_in_the_loaders_batches():
    """Products over a DataLoader of batch 2 (5 examples) read batches of 2, 2 and 1 whatever
    ``ga.options(batch_size)``: the call's batches (``vmap_calls``) and the pass's batch say so."""
    task = ga.tasks.classification(models.mlp())
    X, y = models.classification_data(n=8)
    S = ga.methods.influence(task, DataLoader(TensorDataset(X[:5], y[:5]), batch_size=2), (X[5:], y[5:]),
                             solver="cg", curvature="gauss_newton", damping=0.1, solver_settings={"max_iter": 3})
    with ga.options(batch_size=32):
        [step] = [p for p in plan(S.expr).passes if p.per_call]
        assert step.batch_size == 2
        assert [(b, count) for b, count, _ in step.jobs[0].vmap_calls()] == [(2, 2), (1, 1)]
