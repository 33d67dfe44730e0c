"""The planner's time estimates (gradalg/plan/estimates.py): exact counts from shapes.

These tests assert numbers from shapes (GEMM shapes and counts, bytes, fixed costs),
never timings: how true the estimates are is measured by benchmarks/estimates.py.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.plan import cost as C
from gradalg.plan import devices, estimates as E
from gradalg.plan.planner import plan

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

A100 = devices.PRESETS["a100"]


def mlp(n=20, nq=4, batch=8):
    model = models.mlp()       # Linear(8, 16), Tanh, Linear(16, 3); float64
    task = ga.tasks.classification(model)
    x, y = models.classification_data(n, seed=1)
    xq, yq = models.classification_data(nq, seed=2)
    return model, task, TensorDataset(x, y), TensorDataset(xq, yq), batch


def test_capture_cost_counts_forward_and_input_gradient_gemms_by_shape():
    """Per batch of B: a forward GEMM (B, out, in) and an input-gradient GEMM (B, in, out)
    per weight layer (no weight-gradient GEMM), 3 leaf modules called forward and
    backward, one captured batch with two recorded layers."""
    model, task, train, _, batch = mlp()
    G = ga.grads(task, train)
    with ga.options(batch_size=batch) as opts:
        c = E.capture_cost(G.expr, opts, torch.float64)
    batches = 3                                      # 20 examples in batches of 8
    # and the loss's sum/mean check: two forwards of 4 examples, once per pass
    assert c.gemms == ((8, 16, 8, batches, 8), (8, 8, 16, batches, 8), (8, 3, 16, batches, 8),
                       (8, 16, 3, batches, 8), (4, 16, 8, 2, 8), (4, 3, 16, 2, 8))
    assert c.flops == 2.0 * 8 * (16 * 8 + 3 * 16) * 2 * batches + 2.0 * 4 * (16 * 8 + 3 * 16) * 2
    assert (c.calls, c.batches, c.layer_batches, c.passes) == (3 * 3 * 2, 3, 6, 1)
    # the layers' activations swept forward and backward, and the factors written (A, D)
    act = C.activation_bytes(model, 1, 8) * 20
    factors = 2.0 * 20 * 8 * ((9 + 16) + (17 + 3))
    sweeps = E.ELEMENTWISE_SWEEPS["forward"] + E.ELEMENTWISE_SWEEPS["backward"]
    assert c.elementwise == pytest.approx(act * sweeps) and c.bytes == pytest.approx(factors)
    # a second source sharing the forward costs its backward only
    shared = E.capture_cost(G.expr, opts, torch.float64, forward=False)
    assert len(shared.gemms) == 2 + 2 and shared.calls == 3 * 3


def test_expected_objective_runs_one_backward_per_class():
    _, task, train, _, batch = mlp()
    G = ga.grads(task, train, objective="expected")
    with ga.options(batch_size=batch) as opts:
        c = E.capture_cost(G.expr, opts, torch.float64)
    assert c.batches == 3 * 3 and c.layer_batches == 3 * 3 * 2          # 3 classes: 3 backwards per batch
    assert c.gemms[1] == (8, 8, 16, 3 * 3, 8)                          # input gradients, once per class


def test_job_costs_follow_the_rows_layout_and_kind():
    _, task, train, query, batch = mlp()
    G = ga.grads(task, train)
    K = ga.kfac(G)
    with ga.options(batch_size=batch):
        p = plan((ga.grads(task, query) @ K.damp(0.1).inv() @ G.T).expr, device=A100)
    kfac = next(j for s in p.passes for j in s.jobs if j.kind == "kfac")
    layout = {"0": "factors", "2": "factors"}
    c = E.job_cost(kfac, 20, layout, 8, torch.float64)
    # per chunk of 8 rows (3 chunks): Grams of A (8, 9), D (8, 16), A (8, 17), D (8, 3);
    # once, both factors' eigendecompositions
    assert c.gemms == ((9, 9, 8, 3, 8), (16, 16, 8, 3, 8), (17, 17, 8, 3, 8), (3, 3, 8, 3, 8))
    assert c.eighs == ((9, 1), (16, 1), (17, 1), (3, 1))
    assert c.ops == 3 * 2 * E.OPS_PER_BLOCK["kfac"]                   # 3 chunks × 2 blocks
    # EK-FAC's correction: from factors, two rotations and one per-example product; from
    # flat rows, two per-example GEMMs (the row rotated from both sides)
    eig = ga.ekfac(G)
    with ga.options(batch_size=batch):
        p = plan((ga.grads(task, query) @ eig.damp(0.1).inv() @ G.T).expr, device=A100)
    ekfac = next(j for s in p.passes for j in s.jobs if j.kind == "ekfac")
    from_factors = E.job_cost(ekfac, 20, layout, 8, torch.float64)
    assert from_factors.gemms[:3] == ((8, 9, 9, 3, 8), (8, 16, 16, 3, 8), (16, 9, 1, 24, 8))
    flat = E.job_cost(ekfac, 20, {"0": "flat", "2": "flat"}, 8, torch.float64)
    assert flat.gemms[:2] == ((16, 9, 16, 24, 8), (16, 9, 9, 24, 8))


def test_dense_projection_draws_its_matrix_once_and_casts_it_per_chunk():
    _, task, train, _, _ = mlp()
    P = ga.proj.gaussian(4, seed=0)
    node = P(ga.grads(task, train)).expr
    c = E.project_cost(node, 20, 1, elem=8, chunk=8)
    dims = [b.dim for b in node.grads.space.blocks]                   # 16·9 and 3·17
    matrix = sum(4 * d * (E.RANDOM_BYTES + 3 * (8 + 8)) for d in dims)   # drawn once, cast for 3 chunks
    materialized = sum(8.0 * 20 * d for d in dims)
    rows_read = sum(8.0 * 4 * d for d in dims)
    assert c.bytes == pytest.approx(matrix + materialized + rows_read)
    assert (20, 4, dims[0], 1, 8) in c.gemms
    # the rows of every Gauss-Newton term are projected
    expected = P(ga.grads(task, train, objective="expected")).expr
    assert E.project_cost(expected, 20, 1, elem=8, chunk=8).flops == pytest.approx(3 * c.flops)


def test_resolving_a_dense_inverse_is_costed_where_it_is_applied():
    """The eigendecomposition of a dense Fisher belongs to the pass that applies its
    inverse (the scores pass), not to the pass that accumulates it."""
    _, task, train, query, batch = mlp()
    P = ga.proj.kron(4, seed=0)
    G, Q = P(ga.grads(task, train)), P(ga.grads(task, query))
    with ga.options(batch_size=batch):
        p = plan((Q @ ga.fisher(G).damp(0.1).inv() @ G.T).expr, device=A100)
    d = G.space.dim
    by_kind = {j.kind: s for s in p.passes for j in s.jobs}
    assert (d, 1) in by_kind["scores"].cost.eighs
    assert not by_kind["fisher"].cost.eighs
    assert E.resolve_cost(ga.fisher(G).expr) == C.Cost()                # no inverse: nothing to resolve


def test_pass_seconds_are_the_profile_price_of_the_pass_cost():
    _, task, train, query, batch = mlp()
    with ga.options(batch_size=batch):
        p = plan((ga.grads(task, query) @ ga.grads(task, train).T).expr, device=A100)
    for step in p.passes:
        assert step.seconds == pytest.approx(A100.time_of(step.cost, p.dtype))
        assert step.cost.ops >= E.OPS_PER_PASS            # every pass pays its fixed cost


def test_explain_analyze_shows_estimate_and_measured_side_by_side():
    _, task, train, query, batch = mlp()
    S = ga.grads(task, query) @ ga.grads(task, train).T
    with ga.options(batch_size=batch, progress=False):
        e = S.explain(analyze=True)
    rows = e.passes()
    assert len(rows) == 2
    for row in rows:
        assert row["ratio"] == pytest.approx(row["measured_seconds"] / row["seconds"])
        assert row["measured_cpu_seconds"] >= 0
    text = str(e)
    assert "meas/est" in text and f"{rows[1]['ratio']:.2f}×" in text
    html = e._repr_html_()
    assert "measured / est." in html and f"{rows[1]['ratio']:.2f}×" in html
    # without analyze: no measured column, nothing run
    plain = S.explain()
    assert "meas/est" not in str(plain) and "measured / est." not in plain._repr_html_()
