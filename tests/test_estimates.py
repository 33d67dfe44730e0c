"""The planner's time estimates (gradalg/plan/estimates.py): exact counts from shapes.

These tests assert numbers from shapes (GEMM shapes and counts, bytes, fixed costs),
never timings: how true the estimates are is measured by benchmarks/estimates.py.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.plan import DecisionKind, DecisionSource
from gradalg.plan import cost as C
from gradalg.plan import shapes as S
from gradalg import devices
from gradalg.devices import measure
from gradalg.plan import estimates as E
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


def test_adding_costs_sums_every_field_and_keeps_the_larger_peak():
    """``Cost.__add__`` (fields set directly, not through ``__init__``): every field of
    the sum is the two summed (tuples joined), but ``peak_bytes``, their maximum; the sum
    is an ordinary Cost (equal, hashable, repr) and ``sum`` of costs is their total."""
    names = [f.name for f in dataclasses.fields(C.Cost)]
    a = C.Cost(**{n: (((n, 1),) if isinstance(getattr(C.Cost(), n), tuple) else 1.0 + i)
                  for i, n in enumerate(names)})
    b = C.Cost(**{n: (((n, 2),) if isinstance(getattr(C.Cost(), n), tuple) else 100.0 - i)
                  for i, n in enumerate(names)})
    both = a + b
    assert type(both) is C.Cost and set(vars(both)) == set(names)
    for n in names:
        x, y = getattr(a, n), getattr(b, n)
        assert getattr(both, n) == (max(x, y) if n == "peak_bytes" else x + y), n
    assert both == C.Cost(**vars(both)) and hash(both) == hash(C.Cost(**vars(both))) and repr(both).startswith("Cost(")
    assert sum([a, b, a], C.Cost()) == (a + b) + a and (a + b).peak_bytes == max(a.peak_bytes, b.peak_bytes)


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
    act = S.activation_bytes(model, 1, 8) * 20
    factors = 2.0 * 20 * 8 * ((9 + 16) + (17 + 3))
    sweeps = sum(devices.UNMEASURED_CPU.elementwise_sweeps)     # the nominal calibration
    assert c.elementwise == pytest.approx(act * sweeps) and c.bytes == pytest.approx(factors)
    # a second source sharing the forward costs its backward only
    shared = E.capture_cost(G.expr, opts, torch.float64, forward=False)
    assert len(shared.gemms) == 2 + 2 and shared.calls == 3 * 3


def test_attention_products_are_one_batched_call_per_layer_and_matmul():
    """GPT-2 (2 layers, width 64, 4 heads, T = 9): per batch and layer, two forward and
    four backward calls, each of B·heads (T, T, d_head) products."""
    task = models.lm_task(models.gpt2())
    train = models.padded_token_data(n=6, min_len=5, max_len=9)
    G = ga.grads(task, train, ["transformer.h.*"])
    with ga.options(batch_size=4) as opts:
        c = E.capture_cost(G.expr, opts, torch.float64)
    batches, layers = 2, 2                                            # 6 sequences in batches of 4
    assert c.bmms == ((4 * 4, 9, 9, 16, batches * layers * (2 + 4), 8),)
    shared = E.capture_cost(G.expr, opts, torch.float64, forward=False)   # the backward's four only
    assert shared.bmms == ((4 * 4, 9, 9, 16, batches * layers * 4, 8),)


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
    c = kfac.stream_cost(20, 8, p.facts, lambda node: layout)
    # per chunk of 8 rows (3 chunks): Grams of A (8, 9), D (8, 16), A (8, 17), D (8, 3);
    # once, both factors' eigendecompositions
    assert c.gemms == ((9, 9, 8, 3, 8), (16, 16, 8, 3, 8), (17, 17, 8, 3, 8), (3, 3, 8, 3, 8))
    assert c.eighs == ((9, 1), (16, 1), (17, 1), (3, 1))
    # the fixed cost of 3 chunks × 2 blocks (measured per block, else the job's ops_per_block ops each)
    assert c.blocks == (("kfac", 6.0, float(kfac.ops_per_block)),) and c.ops == 0
    # the inverse applied to 5 held rows in its eigenbasis (KronOp.apply_blocks): per block
    # Q_Sᵀ · and Q_S · as two batched calls of 5 (out, in, out) products, · Q_A and · Q_Aᵀ
    # as two (5·out, in, in) GEMMs, and the rows read and written
    scores = next(j for s in p.passes for j in s.jobs if j.kind == "scores")
    assert scores.target.op.structure == "kron"
    applied = E.apply_cost(scores.target.op, G.space, 5, 8)
    assert applied.bmms == ((5, 16, 9, 16, 2, 8), (5, 3, 17, 3, 2, 8))
    assert applied.gemms == ((5 * 16, 9, 9, 2, 8), (5 * 3, 17, 17, 2, 8))
    assert applied.flops == 2 * 2.0 * 5 * (16 * 9 * (16 + 9) + 3 * 17 * (3 + 17))
    assert applied.bytes == 4.0 * 8 * 5 * (16 * 9 + 3 * 17)
    # EK-FAC's correction: from factors, two rotations and one per-example product; from
    # flat rows, the row rotated from both sides: a batched call of per-example (out, in,
    # out) products (Q_Sᵀ G_i) and one (c·out, in, in) GEMM (· Q_A)
    eig = ga.ekfac(G)
    with ga.options(batch_size=batch):
        p = plan((ga.grads(task, query) @ eig.damp(0.1).inv() @ G.T).expr, device=A100)
    ekfac = next(j for s in p.passes for j in s.jobs if j.kind == "ekfac")
    from_factors = ekfac.stream_cost(20, 8, p.facts, lambda node: layout)
    assert from_factors.gemms[:2] == ((8, 9, 9, 3, 8), (8, 16, 16, 3, 8))
    # the per-example products: one batched call of 8 (out, in, T) products per chunk and block
    assert from_factors.bmms == ((8, 16, 9, 1, 3, 8), (8, 3, 17, 1, 3, 8))
    flat = ekfac.stream_cost(20, 8, p.facts, lambda node: {"0": "flat", "2": "flat"})
    assert flat.bmms == ((8, 16, 9, 16, 3, 8), (8, 3, 17, 3, 3, 8))
    assert flat.gemms == ((8 * 16, 9, 9, 3, 8), (8 * 3, 17, 17, 3, 8))


def test_datainf_application_counts_its_sums_setup_finish_and_the_held_rows_match():
    """DataInf applied by a planned pass (ApplyJob, issue 28: its passes ran 1.5-3x their
    estimates on OLMoE/OPT widths). Per chunk of c rows and block of d_b coordinates,
    as DataInfSums.update runs it: the rows materialized from factors, their squares into
    a fresh (c, d_b) tensor and summed, q_b g^T (a GEMM (m, c, d_b)) and coef . g (a GEMM
    (m, d_b, c)) into a fresh (m, d_b) tensor added to the sums. Once: the m held rows made
    flat (materialized, concatenated into fresh memory), the sums zeroed, the finish's five
    full-size ops. The scores job that names the apply job (``applied``) reads the applied
    rows by its key: no flattening, no match, only the operator's resolution."""
    from gradalg.plan.estimates import resolve_once
    from gradalg.plan.jobs.apply import FINISH_OPS
    _, task, train, query, batch = mlp()
    G, Q = ga.grads(task, train), ga.grads(task, query)
    with ga.options(batch_size=batch):
        p = plan((Q @ ga.datainf(G, 0.1) @ G.T).expr, device=A100)
    apply = next(j for s in p.passes for j in s.jobs if j.kind == "apply")
    layout = {"0": "factors", "2": "factors"}
    dims = (16 * 9, 3 * 17)                       # Linear(8, 16), Linear(16, 3), bias columns; float64
    m, c, elem = 4, 8, 8
    chunk = apply.chunk_cost(apply.streams[0], c, layout, p.facts)
    assert chunk.bmms == ((c, 16, 9, 1, 1, elem), (c, 3, 17, 1, 1, elem))         # materialized, T = 1
    assert chunk.gemms == ((m, c, dims[0], 1, elem), (m, dims[0], c, 1, elem),
                           (m, c, dims[1], 1, elem), (m, dims[1], c, 1, elem))
    # squares (c, d_b) and coef . g (m, d_b) fresh; bytes: materialized rows written (c),
    # squares read twice and written (3c), summed (c), the sums read twice and written (3m)
    assert chunk.faulted == elem * sum(c * d + m * d for d in dims)
    assert chunk.bytes == elem * sum((c + 3 * c + c + 3 * m) * d for d in dims)
    resolved = set()
    once = apply.once_cost(p.facts, lambda node: layout, None, resolved)
    numbers = m * sum(dims)
    assert once.bmms == ((m, 16, 9, 1, 1, elem), (m, 3, 17, 1, 1, elem))          # the held rows materialized
    # fresh: the materialized held rows, their concatenation, the zeroed sums, the finish's outputs
    assert FINISH_OPS == {"reads": 6, "writes": 5}
    assert once.faulted == elem * numbers * (1 + 1 + 1 + 5)
    assert once.bytes == elem * numbers * (1 + 2 + 1 + 6 + 5)
    scores = next(j for s in p.passes for j in s.jobs if j.kind == "scores")
    assert scores.applied == apply.key
    held = scores.once_cost(p.facts, lambda node: layout, None, resolved)
    assert held == resolve_once(apply.target.op, resolved) and held.bmms == () and held.faulted == 0


def test_dense_projection_draws_and_casts_its_matrix_once_per_plan():
    _, task, train, query, batch = mlp()
    P = ga.proj.gaussian(4, seed=0)
    node = P(ga.grads(task, train)).expr
    drawn = set()
    c = E.project_cost(node, 20, 1, elem=8, chunk=8, drawn=drawn)
    dims = [b.dim for b in node.grads.space.blocks]                   # 16·9 and 3·17
    assert c.randoms == sum(4 * d for d in dims)                     # k·d float64 numbers, once
    cast = sum(4 * d * (8 + 8) for d in dims)                        # read float64, written in the rows' dtype
    materialized = sum(8.0 * 20 * d for d in dims)
    matrix_read = sum(3 * 8.0 * 4 * d for d in dims)                 # every chunk's GEMM reads the matrix
    assert c.bytes == pytest.approx(cast + materialized + matrix_read)
    assert c.faulted == pytest.approx(cast)                           # the draw and the cast: fresh memory
    assert (8, 4, dims[0], 2, 8) in c.gemms and (4, 4, dims[0], 1, 8) in c.gemms   # chunks of 8, 8 and 4 rows
    assert drawn == {(P, b.name, b.dim) for b in node.grads.space.blocks}
    again = E.project_cost(node, 20, 1, elem=8, chunk=8, drawn=drawn)   # drawn before in the plan: kept
    assert again.randoms == 0 and again.bytes == pytest.approx(materialized + matrix_read)
    # the rows of every Gauss-Newton term are projected
    expected = P(ga.grads(task, train, objective="expected")).expr
    assert E.project_cost(expected, 20, 1, elem=8, chunk=8).flops == pytest.approx(3 * c.flops)
    # in a plan, the first pass that projects draws; the second reuses the process's matrix
    with ga.options(batch_size=batch):
        p = plan((P(ga.grads(task, query)) @ P(ga.grads(task, train)).T).expr, device=A100)
    assert [s.cost.randoms for s in p.passes] == [sum(4 * d for d in dims), 0]


def test_sparse_projections_cost_what_their_kernels_do():
    """GraSS gathers its kept coordinates from the factors (n·T·m, no materialized
    gradient) then scatter-adds them; a plain SJLT materializes the factors first."""
    _, task, train, _, _ = mlp()
    G = ga.grads(task, train)
    grass = ga.proj.grass(2, seed=0)                                  # keeps 4k = 8 coordinates per block
    c = E.project_cost(grass(G).expr, 20, 1, elem=8, chunk=8)
    assert c.gemms == ()                                              # nothing materialized
    m = 8 * 2                                                         # two blocks
    assert (c.scatter, c.scatter_rows) == (m * 3, m * 20)              # 3 products of each table, 20 rows
    assert c.elementwise == pytest.approx(4.0 * 8 * 20 * 1 * m)       # two strided gathers, read and written
    assert c.bytes == pytest.approx(3.0 * 8 * 20 * m)                  # product summed
    assert c.sjlt_draws == m and c.randoms == 0                        # the SJLT tables, built once
    assert c.ops == 3 * 2 * E.OPS_PER_SPARSE_BLOCK                     # 3 chunks × 2 blocks
    # priced by the profile's calibration (measured where the profile is): bytes at the elementwise rate, draws
    prof = ga.devices.DeviceProfile("t", 1e9, 1e9, 1e9, 1e9, elementwise_bandwidth=1e9, random_seconds=1e-8,
                                         sjlt_bytes=(2.0, 3.0), sjlt_build_randoms=0.5)
    free = dataclasses.replace(c, scatter=0.0, scatter_rows=0.0, sjlt_draws=0.0)
    assert prof.time_of(c) - prof.time_of(free) == pytest.approx((2.0 * m * 3 + 3.0 * m * 20) / 1e9 + 0.5 * m * 1e-8)
    drawn = set()
    E.project_cost(grass(G).expr, 20, 1, elem=8, chunk=8, drawn=drawn)
    assert E.project_cost(grass(G).expr, 20, 1, elem=8, chunk=8, drawn=drawn).sjlt_draws == 0   # kept by the process
    sjlt = E.project_cost(ga.proj.sparse(2, seed=0)(G).expr, 20, 1, elem=8, chunk=8)
    assert sjlt.bmms == ((20, 16, 9, 1, 1, 8), (20, 3, 17, 1, 1, 8))   # one batched call of (out, in, T) per example


def test_a_tensorsketch_is_costed_per_position_and_bin_at_the_measured_rate():
    """TensorSketch on factors: per position its count sketches (4·elem·(out + in) bytes)
    and k bins of FFTs, a ``"tensorsketch"`` block per position and bin, priced by the
    profile's measured ``ts_bytes_per_bin`` at the elementwise bandwidth (was the hand-set
    ``TS_BYTES_PER_BIN``); on flat rows k/2 bins per output row."""
    _, task, train, _, _ = mlp()
    G = ga.grads(task, train)
    P = ga.proj.tensorsketch(32, 0)
    c = E.project_cost(P(G).expr, 20, 1, elem=8, chunk=8)
    bins = sum(count for kind, count, _ in c.blocks if kind == "tensorsketch")
    assert bins == 20 * 1 * 32 * 2                                     # 20 rows × T = 1 × k, two blocks
    prof = ga.devices.DeviceProfile("t", 1e9, 1e9, 1e9, 1e9, elementwise_bandwidth=2e9, ts_bytes_per_bin=18.0)
    free = dataclasses.replace(c, blocks=tuple(b for b in c.blocks if b[0] != "tensorsketch"))
    assert prof.time_of(c) - prof.time_of(free) == pytest.approx(bins * 18.0 / 2e9)
    assert prof.block_fixed_seconds("tensorsketch") == pytest.approx(18.0 / 2e9)


def test_a_tensorsketch_of_flat_rows_is_costed_per_row_and_bin_and_its_shift_per_call():
    """TensorSketch of flat rows (Adam-preconditioned rows: TrackStar, issue 28; its
    training pass at GPT-2-small width ran 1.7-2.7x its estimate, the kernel 6-10x): per
    row of each example a count sketch of in numbers into fresh zeros of k, one real FFT
    (F = k/2 + 1 complex bins, fresh) and its product with the row's phase shift (fresh), a
    ``"tensorsketch_rows"`` block per row, example and bin; the shift made once per call, a
    ``"tensorsketch_shift"`` block per row and bin, 5 F fresh numbers per row; priced by the
    profile's measured ``ts_flat_bytes`` at the elementwise bandwidth."""
    from gradalg.proj.kinds import Rows
    from gradalg.space import Block
    p = ga.proj.tensorsketch(32, 0)
    b = Block("w", (16, 9), "linear")
    F = 32 // 2 + 1
    c = p.kind_object.work(p, b, Rows(20, 7, 3, 1, False, 16 * 9), E.ProjectionPrices(8))   # 20 rows, float64, 3 calls
    assert c.blocks == (("tensorsketch_rows", 20.0 * 16 * F, 0.0), ("tensorsketch_shift", 3.0 * 16 * F, 0.0))
    assert c.faulted == 8.0 * (20 * 16 * (9 + 32 + 4 * F) + 3 * 5 * 16 * F)
    assert c.elementwise == 20 * 16 * 4.0 * 8 * 9                       # the rows scattered into their sketches
    prof = ga.devices.DeviceProfile("t", 1e9, 1e9, 1e9, 1e9, elementwise_bandwidth=2e9, ts_flat_bytes=(40.0, 10.0))
    assert prof.block_fixed_seconds("tensorsketch_rows") == pytest.approx(40.0 / 2e9)
    assert prof.block_fixed_seconds("tensorsketch_shift") == pytest.approx(10.0 / 2e9)
    free = dataclasses.replace(c, blocks=())
    assert prof.time_of(c) - prof.time_of(free) == pytest.approx((20 * 16 * F * 40.0 + 3 * 16 * F * 10.0) / 2e9)
    # measured with the profile: both rates positive, a row per example above zero work
    per_row, per_shift = measure._measure_tensorsketch_flat(5e9, seconds=0.01)
    assert per_row > 0 and per_shift > 0 and "ts_flat_bytes" in devices.CALIBRATION


def test_adam_preconditioning_and_normalization_are_costed_per_chunk():
    model, task, train, _, batch = mlp()
    G = ga.grads(task, train)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = train.tensors
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    node = G.adam(ga.adam_state(opt, G)).expr
    d = G.space.dim                                                   # 16·9 + 3·17 = 195
    factors = {"0": "factors", "2": "factors"}
    c = E.rowwise_cost(node, 20, 8, factors, elem=8)
    # per chunk of 8 rows (3 chunks): both blocks materialized (one batched call of 8
    # GEMMs (out, in, 1) each), then, block by block, Adam's 8 full-size ops reading 12
    # operands, two of them into fresh memory
    assert c.gemms == () and c.bmms == ((8, 16, 9, 1, 3, 8), (8, 3, 17, 1, 3, 8))
    flat = 8.0 * 8 * (16 * 9 + 3 * 17)                                  # materialized written, block by block
    adam = 8.0 * 8 * d * (E.ADAM_OPS["reads"] + E.ADAM_OPS["writes"])
    assert c.bytes == pytest.approx(3 * (flat + adam))
    assert c.faulted == pytest.approx(3 * 8.0 * 8 * d * E.ADAM_OPS["fresh"])
    # flat rows: nothing to materialize
    assert E.rowwise_cost(node, 20, 8, {"0": "flat", "2": "flat"}, elem=8).gemms == ()
    # a normalization by a metric resolves it once in a plan, then applies it per chunk
    H = ga.fisher(G).damp(0.1).inv()
    norm = G.normalize(H).expr
    resolved = set()
    first = E.rowwise_cost(norm, 20, 8, {"0": "flat", "2": "flat"}, elem=8, resolved=resolved)
    assert first.eighs == ((d, 1),) and (8, d, d, 3, 8) in first.gemms
    second = E.rowwise_cost(norm, 20, 8, {"0": "flat", "2": "flat"}, elem=8, resolved=resolved)
    assert second.eighs == () and second.gemms == ((8, d, d, 3, 8),)


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
        assert step.cost.ops >= devices.UNMEASURED_CPU.ops_per_pass            # every pass over data pays its fixed cost
    # each captured example's working set is touched fresh once: 4 queries in a batch of
    # 8 touch 4 examples' memory, 20 training examples 20 (batches of 8, 8 and 4)
    assert [s.cost.faulted for s in p.passes] == [pytest.approx(4 * p.passes[0].per_example_bytes),
                                                  pytest.approx(20 * p.passes[1].per_example_bytes)]
    # a pass over rows in memory opens its sinks only: no task fingerprint, no hooks
    P = ga.proj.kron(4, seed=0)
    G, Q = P(ga.grads(task, train)), P(ga.grads(task, query))
    with ga.options(batch_size=batch):
        p = plan((Q @ ga.fisher(G).damp(0.1).inv() @ G.T).expr, device=A100)
    memory = [s for s in p.passes if not s.reads_data]
    assert memory and all(s.cost.ops < devices.UNMEASURED_CPU.ops_per_pass for s in memory)
    assert E.pass_overhead(2, reads_data=False).ops == 2 * devices.UNMEASURED_CPU.ops_per_memory_pass


def test_a_pass_over_stored_rows_is_costed_per_chunk_they_were_stored_in():
    """Rows a pass stores batch by batch are read back in those chunks: a later pass over
    them pays its per-chunk GEMMs and per-block fixed costs per stored batch (20 rows in
    batches of 8: 3 chunks), not once over all rows; a Kronecker inverse is resolved
    (its eigenvalues inverted) once per block, and applied with each block's fixed cost."""
    _, task, train, query, batch = mlp()
    G = ga.grads(task, train)
    with ga.options(batch_size=batch):
        p = plan((ga.grads(task, query) @ ga.ekfac(G).damp(0.1).inv() @ G.T).expr, device=A100)
    stored = next(s for s in p.passes if any(j.kind == "store" for j in s.jobs))
    ekfac = next((s, j) for s in p.passes for j in s.jobs if j.kind == "ekfac")
    assert not ekfac[0].reads_data and stored.batch_size == batch
    # 3 chunks × 2 blocks; opening and finishing its accumulator once: 2 steps × 2 blocks
    assert ekfac[1].cost.blocks == (("ekfac", 3.0 * 2, float(ekfac[1].ops_per_block)), ("resolve", 2.0 * 2, 0.0))
    assert ekfac[1].cost == ekfac[1].stream_cost(20, batch, p.facts, lambda node: {"0": "factors", "2": "factors"},
                                                 options=ga.options())
    op = next(j for s in p.passes for j in s.jobs if j.kind == "scores").target.op
    assert E.kron_chain(op) == 3                                  # EK-FAC → damped → inverse
    assert E.resolve_cost(op).blocks == (("resolve", 2.0 * 2, 0.0),)   # 2 operands' Λ scanned × 2 blocks
    applied = E.apply_cost(op, G.space, 5).blocks
    assert ("precondition", 2.0, 0.0) in applied and ("resolve", 2.0, 0.0) in applied   # + Λ made per block
    # float64 sweeps over each block's out·in eigenvalues: scanning EK-FAC's Λ (9) and the
    # damped one (9 + a shift's read and write); making the inverse (shift 1 op + cast,
    # reciprocal, cast 3 ops: a read and a write each); float64 rows: no basis cast
    dims = sum(b.dim for b in op.space.blocks)
    assert E.resolve_cost(op).elementwise == (9 + 11) * 8 * dims
    assert E.apply_cost(op, G.space, 5, elem=8).elementwise == 2 * 4 * 8 * dims


def test_the_kronecker_chains_eigenvalue_work_is_what_its_run_does(monkeypatch):
    """LoGra's last pass (issue 28: 2.5× its estimate on Mistral) resolves EK-FAC → damp →
    inverse and applies it to the held rows. Per block, the run scans the eigenvalues of
    each operand of the chain once (float64 extremes, for tags and the inverse's checks)
    and makes the inverted Λ from its steps once per application: the estimate prices
    exactly as many ``resolve`` block units as the run makes (it priced one per block)."""
    from gradalg.linalg import kron as K
    _, task, train, query, batch = mlp()
    G = ga.grads(task, train)
    S = ga.grads(task, query) @ ga.ekfac(G).damp(0.1).inv() @ G.T
    scans, made = [], []
    extremes, mul_into = K.BlockEigenvalues.extremes, K.BlockEigenvalues.mul_into

    def scanned(self):
        if "_extremes" not in self.__dict__:      # computed, not the cached value
            scans.append(1)
        return extremes(self)
    monkeypatch.setattr(K.BlockEigenvalues, "extremes", scanned)
    monkeypatch.setattr(K.BlockEigenvalues, "mul_into", lambda self, rows: made.append(1) or mul_into(self, rows))
    with ga.options(batch_size=batch):
        S.compute()
        p = plan(S.expr, device=A100)
    job = next(j for s in p.passes for j in s.jobs if j.kind == "scores")
    count = lambda cost: sum(c for kind, c, _ in cost.blocks if kind == "resolve")
    assert len(scans) == count(E.resolve_cost(job.target.op)) == 4
    assert len(made) == count(E.apply_cost(job.target.op, job.held.space, job.held.n)) == 2


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


def test_a_pass_whose_peak_an_earlier_peak_hid_is_reported_as_a_bound(monkeypatch):
    """The process keeps one peak-resident mark. A pass that does not raise it has its own
    peak hidden under an earlier one: its growth is then reported as an upper bound
    (``≤`` in the explanation), never as the 0 bytes the mark's own growth reads.

    The run reads the kernel through ``resident_bytes`` / ``peak_resident_bytes``; here they
    are replaced by a scripted process (a resident set of 100 MB and a mark of 500 MB set
    before the run; the second pass raises the mark to 700 MB), so the numbers shown are
    known exactly. (Reading the real kernel, whether a pass raises the mark depends on
    what the test process did before: the assertion flaked under pytest-xdist.)"""
    import gradalg.exec.runner as runner
    from gradalg.exec.allocator import peak_growth as _peak_growth

    assert _peak_growth(100, 500, 700) == {"peak_rss_growth_bytes": 600, "peak_rss_is_bound": False}
    assert _peak_growth(100, 500, 500) == {"peak_rss_growth_bytes": 400, "peak_rss_is_bound": True}
    assert _peak_growth(None, 500, 700)["peak_rss_growth_bytes"] is None
    MB = 10**6
    marks = iter([500 * MB, 500 * MB, 500 * MB, 700 * MB])     # each pass reads the mark before and after
    monkeypatch.setattr(runner, "resident_bytes", lambda: 100 * MB)
    monkeypatch.setattr(runner, "peak_resident_bytes", lambda: next(marks))
    _, task, train, query, batch = mlp()
    S = ga.grads(task, query) @ ga.grads(task, train).T
    with ga.options(batch_size=batch, progress=False):
        e = S.explain(analyze=True)
    rows = e.passes()
    assert [(r["measured_rss_growth_bytes"], r["measured_rss_is_bound"]) for r in rows] == [
        (400 * MB, True), (600 * MB, False)], rows
    text = str(e)
    assert "≤400MB" in text.replace(" ", "") and "600MB" in text.replace(" ", "")
    assert "measured peak" in e._repr_html_()


def test_measured_peak_growth_of_a_real_run_is_read_from_the_kernel():
    """Unscripted, on Linux: each of the two passes has a measured growth (a number, not
    None: the resident set and the mark are read from the kernel)."""
    from gradalg.exec.allocator import resident_bytes

    if resident_bytes() is None:
        pytest.skip("no resident-set reading on this platform")
    _, task, train, query, batch = mlp()
    S = ga.grads(task, query) @ ga.grads(task, train).T
    with ga.options(batch_size=batch, progress=False):
        rows = S.explain(analyze=True).passes()
    assert len(rows) == 2 and all(r["measured_rss_growth_bytes"] >= 0 for r in rows), rows


#: a measured one-core CPU (this project's 2-core VM, rounded): small GEMMs 60× slower
#: per FLOP than large ones, elementwise work at 1 GB/s
CPU = devices.DeviceProfile(
    "test cpu (1 thread)", 1.3e11, 1.3e11, 1.4e10, 2e10, measured=True, call_seconds=2.5e-5, op_seconds=3e-6,
    batch_seconds=1e-5, layer_seconds=5e-5, elementwise_bandwidth=1e9, fault_bandwidth=2.2e9,
    gemm_rates=((16, 2.1e9), (64, 6.1e10), (256, 1.29e11), (512, 1.29e11)),
    eigh_times=((32, 8e-5), (128, 1.27e-3), (384, 1.5e-2)), random_seconds=3e-8)


def gpt2_scores(min_len, max_len):
    model = models.gpt2()                                 # 2 layers, width 64, float64
    task = models.lm_task(model)
    train = models.padded_token_data(n=6, min_len=min_len, max_len=max_len, seed=3)
    query = models.padded_token_data(n=2, min_len=min_len, max_len=max_len, seed=5)
    G, Q = ga.grads(task, train, ["transformer.h.*"]), ga.grads(task, query, ["transformer.h.*"])
    return Q @ G.T


@pytest.mark.parametrize("device, chosen", [(CPU, "ghost"), (devices.UNMEASURED_CPU, "dense")])
def test_ghost_or_dense_is_the_faster_kernel_by_the_device_profile(device, chosen):
    """Block c_attn (out 192, in 65) between 2 held and 6 streamed sequences of T = 40: by
    FLOPs dense is cheaper, but on the measured CPU its 6 per-example (192, 65, 40)
    GEMMs run far below the rate of the ghost kernel's two Grams; a profile with one
    rate for every GEMM (UNMEASURED_CPU) keeps dense. Each alternative is the profile's
    price of the same costs the scores job is estimated with."""
    from gradalg.capture.factors import dense_flops, ghost_flops
    S = gpt2_scores(36, 40)
    with ga.options(batch_size=8):
        p = plan(S.expr, device=device)
    d = p.decisions.one(DecisionKind.KERNEL, block="transformer.h.0.attn.c_attn")
    costs = E.kernel_costs(2, 6, 8, 40, 40, 65, 192, elem=8)
    assert d.alternatives == {"ghost": pytest.approx(device.time_of(costs["ghost"], torch.float64)),
                              "dense": pytest.approx(device.time_of(costs["dense"], torch.float64))}
    assert d.chosen == chosen == min(d.alternatives, key=d.alternatives.get)
    assert ghost_flops(2, 6, 40, 40, 65, 192) > dense_flops(2, 6, 40, 40, 65, 192)   # the FLOP rule: dense
    # the kernel costs are those of the scores job's estimate
    scores = next(j for s in p.passes for j in s.jobs if j.kind == "scores")
    assert scores.kernels["transformer.h.0.attn.c_attn"] == chosen
    # forcing keeps both prices in the decision
    with ga.options(batch_size=8, ghost="never" if chosen == "ghost" else "always"):
        forced = plan(S.expr, device=device).decisions.one(
            DecisionKind.KERNEL, block="transformer.h.0.attn.c_attn")
    assert forced.chosen != chosen and forced.alternatives == d.alternatives
    mode = "never" if chosen == "ghost" else "always"
    assert (forced.source, forced.setting) == (DecisionSource.OPTIONS, f"ghost={mode!r}")
    assert d.source is DecisionSource.PLANNER


def test_kernel_costs_count_the_held_side_once_and_each_chunk():
    costs = E.kernel_costs(2, 20, 8, 5, 7, 9, 4)               # 20 streamed rows in chunks of 8: 8, 8, 4
    assert costs["ghost"].gemms == ((2 * 5, 8 * 7, 9, 3, 4), (2 * 5, 8 * 7, 4, 3, 4))
    # dense: each chunk's rows materialized ((out, in, T) per example) and one GEMM with
    # the held rows; the held rows materialized once
    assert costs["dense"].gemms == ((2, 8, 36, 3, 4),)
    assert costs["dense"].bmms == ((8, 4, 9, 7, 3, 4), (2, 4, 9, 5, 1, 4))   # one batched call per chunk, held once


def test_the_sparse_jl_rates_are_measured_with_the_profile():
    """The sparse-JL calibration is measured by the profile's own functions (the kernel
    the runs use, the package's table draw), not a constant: positive bytes per non-zero
    per call and per row at the elementwise rate, draws per non-zero; a measured CPU
    profile carries them and explain() shows them."""
    from gradalg import devices as D

    per_call, per_row = measure._measure_sjlt(5e9, seconds=0.01)
    assert per_call > 0 and per_row > 0
    assert measure._measure_sjlt_build(1.6e-8, columns=2**14, seconds=0.01) > 0
    assert {"sjlt_bytes", "sjlt_build_randoms"} <= set(D.CALIBRATION)
    line = D.DeviceProfile("t", 1e9, 1e9, 1e9, 1e9, sjlt_bytes=(12.5, 9.0), sjlt_build_randoms=0.5).calibration()
    assert "sparse JL 12.5/9 B per non-zero and call/row" in line and "0.5 normal draws per non-zero" in line


@pytest.mark.parametrize("module", ["plan/estimates.py", "plan/jobs/kron.py", "plan/jobs/fisher.py"])
def test_the_estimates_and_the_statistics_jobs_import_no_private_name(module):
    """A fact another module needs has a public home, on the type that owns it: the
    sweeps of a scan of Λ (``BlockEigenvalues.SCAN_SWEEPS``), the blocks whose rows arrive
    as factors (``estimates.factored_blocks``, ``materialized_cost``), bytes as gradalg
    writes them (``gradalg.units``): no ``from ..estimates import _SCAN_SWEEPS``."""
    import ast
    path = os.path.join(os.path.dirname(ga.__file__), module)
    with open(path) as f:
        tree = ast.parse(f.read())
    private = [(node.module, a.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == [], private
