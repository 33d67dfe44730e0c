"""Products with the loss curvature (Hessian / Gauss-Newton, known only through them) are a
planned pass (:class:`~gradalg.plan.jobs.products.ProductsJob`): the plan lists it with its
estimate and its iteration bound (CG ``max_iter``, LiSSA ``depth``, Arnoldi ``iters``),
``explain(analyze=True)`` measures it over every call, and the solver's products run
through it with the numbers of the products computed outside a plan (bit-identical), on an
MLP and a small GPT-2, and against the dense reference."""
import math
import os
import sys
import warnings

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.exec import LocalExecutor
from gradalg.expr.curvature import CurvatureProducts
from gradalg.plan.jobs import ProductPass, ProductsJob

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402


@pytest.fixture(scope="module")
def setting():
    model = models.mlp()
    X, y = models.classification_data(n=40)
    return ga.tasks.classification(model), (X, y), (X[:3], y[:3])


def _products_passes(plan):
    return [p for p in plan.passes if p.per_call]


def _unplanned(monkeypatch):
    """Products computed as before they were planned: one pass per call outside any plan
    (:func:`~gradalg.curvature.hvp.dataset_matvec` at the options' batch size)."""
    from gradalg.curvature.hvp import dataset_matvec
    from gradalg.linalg import ImplicitOp

    def resolve(self, ctx):
        matvec = dataset_matvec(self.task, self.data, self.layers, kind=self.kind, batch_size=ctx.options.batch_size)
        return ImplicitOp(self.space, matvec, tags=frozenset({"psd"}) if self.kind != "hessian" else frozenset())
    monkeypatch.setattr(CurvatureProducts, "resolve", resolve)


CASES = [("cg", dict(curvature="gauss_newton", solver_settings={"max_iter": 7}), 7, 3, "CG max_iter=7"),
         ("cg", dict(curvature="gauss_newton"), None, 3, "CG max_iter=min(2·dim+10, 1000)"),
         ("lissa", dict(curvature="gauss_newton", solver_settings={"depth": 50, "scale": 20.0}), 50, 3,
          "LiSSA depth=50"),
         ("arnoldi", dict(curvature="hessian", rank=4), None, 1, "Arnoldi iters=min(dim, 2·rank+10)")]


@pytest.mark.parametrize("solver,kw,calls,vectors,why", CASES)
def test_the_plan_lists_the_products_pass_with_its_estimate_and_iteration_bound(setting, solver, kw, calls,
                                                                                 vectors, why):
    task, train, queries = setting
    S = ga.methods.influence(task, train, queries, solver=solver, damping=0.1, **kw)
    plan = LocalExecutor().plan(S.expr)
    [step] = _products_passes(plan)
    [job] = step.jobs
    dim = job.target.space.dim
    expected = calls or (min(2 * dim + 10, 1000) if solver == "cg" else min(dim, 2 * 4 + 10))
    assert isinstance(job, ProductsJob) and job.calls == expected and job.vectors == vectors
    assert job.calls_why == why and job.batch == ga.get_options().batch_size
    assert math.isfinite(step.seconds) and step.seconds > 0 and step.cost.flops > 0
    assert step.cost.passes == expected and not step.reads_data
    # one call's GEMMs are priced from the model's layers: primal + tangent·m forward-equivalents
    one = job.call_cost(torch.float64)
    torch.testing.assert_close(step.cost.flops, one.flops * expected)
    text = str(S.explain())
    assert f"up to {expected:,} calls ({why})" in text and f"up to {expected:,} passes over" in text


def test_the_products_pass_runs_through_the_job_with_the_numbers_outside_a_plan(setting, monkeypatch):
    task, train, queries = setting
    S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver="cg", damping=0.1)
    ex = LocalExecutor()
    planned = np.asarray(S.compute(executor=ex))
    assert isinstance(ex.state.results[("products", _products_passes(ex.last_plan)[0].jobs[0].target.token)],
                      ProductPass)
    _unplanned(monkeypatch)
    before = np.asarray(S.compute(executor=LocalExecutor()))
    np.testing.assert_array_equal(planned, before)
    # and the dense reference: ∇f_qᵀ (H + λI)⁻¹ ∇ℓ_z with H the dense Gauss-Newton
    flat = lambda R: torch.cat([v.flatten(1) for v in R.to_dense().values()], 1)   # noqa: E731
    Q, G = flat(ga.grads(task, queries)), flat(ga.grads(task, train))
    H = ga.gauss_newton(task, train).to_dense()
    ref = (Q @ torch.linalg.solve(H + 0.1 * torch.eye(len(H), dtype=H.dtype), G.T)).numpy()
    np.testing.assert_allclose(planned, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))


@pytest.mark.parametrize("solver", ["lissa", "arnoldi"])
def test_lissa_and_arnoldi_through_the_pass_equal_the_products_outside_a_plan(setting, monkeypatch, solver):
    task, train, queries = setting
    kw = dict(solver_settings={"depth": 60, "scale": 20.0}) if solver == "lissa" else dict(rank=5)
    S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver=solver, damping=0.1, **kw)
    planned = np.asarray(S.compute(executor=LocalExecutor()))
    _unplanned(monkeypatch)
    np.testing.assert_array_equal(planned, np.asarray(S.compute(executor=LocalExecutor())))


def test_analyze_measures_the_products_pass_over_its_calls(setting):
    task, train, queries = setting
    S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver="cg", damping=0.1,
                             solver_settings={"max_iter": 9})
    shown = S.explain(analyze=True)
    rows = [r for r in shown.passes() if "measured_calls" in r]
    assert len(rows) == 1
    [row] = rows
    assert 1 <= row["measured_calls"] <= 9 and row["measured_seconds"] > 0
    assert f"measured: {row['measured_calls']:,} call(s)" in str(shown)
    assert f"measured: {row['measured_calls']:,} call(s)" in shown._repr_html_()   # the HTML pass table too


def test_an_operator_resolved_on_its_own_plans_its_products_pass(setting):
    task, train, _ = setting
    H = ga.gauss_newton(task, train)
    ex = LocalExecutor()
    resolved = ex.resolve(H.expr)
    assert [j.kind for p in ex.last_plan.passes for j in p.jobs] == ["products"]
    V = torch.randn(2, H.expr.space.dim, dtype=torch.float64)
    torch.testing.assert_close(resolved.apply(V), V @ H.to_dense(), rtol=1e-10, atol=1e-12)


def test_gpt2_hessian_products_through_the_pass_equal_the_products_outside_a_plan(monkeypatch):
    model = models.gpt2(n_layer=1, n_embd=32)
    task = models.lm_task(model)
    data = models.padded_token_data(n=5, max_len=6)
    layers = ["transformer.h.0.mlp.c_fc"]
    Q, G = ga.grads(task, data, layers), ga.grads(task, data, layers)
    H = ga.arnoldi(ga.hessian(task, data, layers), rank=3, iters=6)
    S = Q @ H.damp(0.5).inv() @ G.T
    ex = LocalExecutor()
    # SDPA reads the attention mask's values, which the meta probe cannot: the probe on the first
    # example decides vmap; the run follows it, no run-time fallback warns
    decision = ex.plan(S.expr).decisions.one("products_batching")
    assert decision.chosen == "vmap" and "first example" in decision.reason and "item()" in decision.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        planned = np.asarray(S.compute(executor=ex))
    [step] = _products_passes(ex.last_plan)
    assert step.jobs[0].calls == 6 and step.jobs[0].vectors == 1
    assert math.isfinite(step.seconds) and step.seconds > 0 and step.cost.bmms   # attention priced
    _unplanned(monkeypatch)
    np.testing.assert_array_equal(planned, np.asarray(S.compute(executor=LocalExecutor())))


@pytest.mark.slow
def test_on_dask_the_products_pass_is_placed_on_the_client_as_a_typed_decision(setting):
    pytest.importorskip("distributed")
    from gradalg.plan.decisions import DecisionKind
    task, train, queries = setting
    S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver="cg", damping=0.1)
    with ga.options(progress=False):
        local = np.asarray(S.compute(executor=LocalExecutor()))
        dx = ga.exec.DaskExecutor(n_workers=1, threads_per_worker=1, min_shard_examples=1)
        try:
            got = np.asarray(S.compute(executor=dx))
            plan = dx.last_plan
        finally:
            dx.close()
    np.testing.assert_allclose(got, local, rtol=1e-9, atol=1e-12)
    placed = plan.decisions.of(DecisionKind.PLACEMENT)
    [(index, step)] = [(i, p) for i, p in enumerate(plan.passes) if p.per_call]
    [decision] = [d for d in placed if d.subject == (index, step.key)]
    assert decision.chosen == "on the client" and not plan.placement[index].sharded
    assert decision.reason.startswith("a products pass: its solver calls it on the client")
    assert any(plan.placement[i].sharded for i, p in enumerate(plan.passes) if p.reads_data)   # the others shard


# ------------------------------------------------------------------ calibration
def test_a_products_call_is_priced_as_its_work_under_torch_func_plus_its_fixed_costs(setting):
    """One call: every batch's work (GEMMs, elementwise, the rows to parameters and back)
    priced ``product_work`` times over (its FLOPs unchanged), plus per batch the measured
    fixed cost of torch.func's products, ``product_seconds`` = (per batch, per leaf
    module), the Hessian's 1.5× the Gauss-Newton's (its 9 forward-equivalents to 6)."""
    from dataclasses import replace
    from gradalg.devices import DeviceProfile
    from gradalg.plan.jobs.products import FIXED_SCALE, product_work, weighed
    from gradalg.plan.estimates import leaf_modules

    task, train, _ = setting
    prof = DeviceProfile("t", 1e9, 1e9, 1e9, 1e9, elementwise_bandwidth=1e9, product_seconds=(2e-3, 3e-4),
                         product_work=2.5)
    plain = replace(prof, product_work=1.0)
    assert FIXED_SCALE == {"gauss_newton": 1.0, "hessian": 1.5}
    for kind, make in (("gauss_newton", ga.gauss_newton), ("hessian", ga.hessian)):
        H = make(task, train)
        with ga.options(batch_size=16):
            plan = LocalExecutor().plan(H.expr)
        [step] = _products_passes(plan)
        job = step.jobs[0]
        n, dim = 40, H.expr.space.dim
        # float64 model: 8 bytes a number; 40 examples in batches of 16, 16 and the last 8 (at its size)
        work = product_work(task.model, 16, 1, 1, kind, dim, 8).scaled(2) + product_work(task.model, 8, 1, 1, kind,
                                                                                           dim, 8)
        batches = 3
        modules = leaf_modules(task.model)
        assert modules == 3                                           # Linear, Tanh, Linear
        fixed = batches * FIXED_SCALE[kind] * (2e-3 + modules * 3e-4)
        call = job.call_cost(torch.float64, prof)
        assert call.flops == pytest.approx(work.flops)                # the arithmetic shown is unchanged
        assert prof.time_of(call, torch.float64) == pytest.approx(
            2.5 * plain.time_of(work, torch.float64) + fixed, rel=1e-9)
        assert weighed(work, 2.5).flops == work.flops and weighed(work, 2.5).bytes == pytest.approx(2.5 * work.bytes)
        assert n == train[0].shape[0]


def test_the_product_rates_are_measured_with_the_profile_and_shown():
    """The products' fixed costs and work factor are measured by the profile's own functions
    on the package's products (:class:`~gradalg.curvature.hvp.Products`), not set by hand;
    a measured CPU profile carries them, nominal GPU profiles say theirs, and explain()'s
    calibration line shows them (and the TensorSketch rate)."""
    from dataclasses import replace
    from gradalg import devices as D
    from gradalg.devices.measure import _measure_tensorsketch
    from gradalg.plan.jobs import products

    per_batch, per_module = products._measure_products_fixed(seconds=0.01)
    assert per_batch > 0 and per_module > 0
    prof = replace(D.UNMEASURED_CPU, product_seconds=(per_batch, per_module))
    assert products._measure_product_work(prof, seconds=0.01) > 0
    assert _measure_tensorsketch(5e9, seconds=0.01) > 0
    assert {"product_seconds", "product_work", "ts_bytes_per_bin"} <= set(D.CALIBRATION)
    assert D.PRESETS["h100"].product_seconds == (4e-3, 1e-4) and D.PRESETS["h100"].product_work == 2.0
    line = D.DeviceProfile("t", 1e9, 1e9, 1e9, 1e9, product_seconds=(3e-3, 1.2e-4), product_work=1.8,
                           ts_bytes_per_bin=17.5).calibration()
    assert "curvature products 3 ms per batch + 120 µs per module, their work ×1.8" in line
    assert "TensorSketch 17.5 B per position and bin" in line


def test_analyze_compares_one_products_call_with_one_and_counts_its_cpu_time(setting):
    """The products pass's estimate is for the solver's bound on the calls; analyze compares
    one measured call with one estimated call, and the pass's CPU seconds are its calls'."""
    task, train, queries = setting
    S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver="cg", damping=0.1,
                             solver_settings={"max_iter": 9})
    shown = S.explain(analyze=True)
    [row] = [r for r in shown.passes() if "measured_calls" in r]
    calls = row["measured_calls"]
    assert row["estimated_call_seconds"] == pytest.approx(row["seconds"] / 9)
    assert row["measured_call_seconds"] == pytest.approx(row["measured_seconds"] / calls)
    assert row["ratio"] == pytest.approx(row["measured_call_seconds"] / row["estimated_call_seconds"])
    assert 0 < row["measured_cpu_seconds"] <= row["measured_seconds"] * 1.5 + 0.05
    assert "per call against" in str(shown)


def test_analyze_counts_each_second_of_a_cg_influence_in_one_row(setting):
    """The CG solve runs during the scores pass, and its products are timed into the products
    pass's row: the scores pass's row is measured without them, so the rows sum to the run's
    time (before, the solve was in both rows and they summed to about twice the run)."""
    import time

    task, train, queries = setting
    S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver="cg", damping=0.1,
                             solver_settings={"max_iter": 9})
    start = time.perf_counter()
    shown = S.explain(analyze=True)
    run = time.perf_counter() - start
    rows = shown.passes()
    [products] = [r for r in rows if "measured_calls" in r]
    assert products["measured_calls"] >= 1
    total = sum(r["measured_seconds"] for r in rows)
    assert 0.5 * run <= total <= run, (total, run)
    # the scores pass's own time is a small part of the products' (3 queries, 40 rows)
    scores = rows[-1]
    assert "measured_calls" not in scores and 0 <= scores["measured_seconds"] < products["measured_seconds"]
    assert 0 <= scores["measured_cpu_seconds"] < products["measured_cpu_seconds"]


# ------------------------------------------------------------------ vmap chunks
def test_the_estimate_counts_the_vmap_chunks_the_run_makes(monkeypatch):
    """Where ``ga.options(products_vmap_elements)`` splits a batch's vectors into ``vmap`` chunks, each
    chunk repeats the primal sweeps and torch.func's fixed cost: the pass's price counts the chunks
    the run makes (spied on ``torch.func.vmap`` in the products), per batch size (the last batch is
    smaller, so its chunks are larger), and ``explain()`` shows them."""
    from gradalg.curvature import hvp
    from gradalg.plan.jobs.products import FIXED_SCALE, product_work

    torch.manual_seed(0)
    model = models.cnn()
    X, y = models.image_data(n=40)
    task, train, queries = ga.tasks.classification(model), (X, y), (X[:3], y[:3])
    per_example = hvp._activation_elements(model, lambda: task.summed_loss(model, (X[:1], y[:1])))
    seen = []                                               # (examples, vectors, chunk_size, calls of fn)
    real_vmap = hvp.vmap
    monkeypatch.setattr(hvp, "_PROBES", {})                 # the plan probes vmap afresh (on meta)

    def spy(fn, *args, chunk_size=None, **kw):
        def run(V):
            record = [None, next(iter(V.values())).shape[0], chunk_size, 0]
            seen.append(record)

            def counted(v):
                record[3] += 1
                return fn(v)
            return real_vmap(counted, *args, chunk_size=chunk_size, **kw)(V)
        return run
    monkeypatch.setattr(hvp, "vmap", spy)
    real_batch_product = hvp._batch_product
    monkeypatch.setattr(hvp, "_batch_product", lambda task, batch, V, names, kind, chunk=None, batching="vmap": (
        seen.append(("batch", batch[0].shape[0])), real_batch_product(task, batch, V, names, kind, chunk, batching))[1])
    budget = 16 * per_example * 2                           # 2 vectors of a batch of 16, 4 of the last 8
    with ga.options(batch_size=16, products_vmap_elements=budget):
        S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver="cg", damping=0.1,
                                 solver_settings={"max_iter": 2})
        plan = LocalExecutor().plan(S.expr)
        [step] = _products_passes(plan)
        [job] = step.jobs
        text = str(S.explain())
        S.compute()
        estimated, call = job.vmap_calls(), job.call_cost(torch.float64)   # under the options it was planned with
    # the run: per batch, one _batch_product and one vmap whose fn ran once per chunk
    runs, b = [], None
    for r in seen:
        if r[0] == "batch":
            b = r[1]
        else:
            runs.append((b, r[1], r[2], r[3]))
    # the plan's meta probe of vmap (2 vectors, before any batch: PRODUCTS_BATCHING), once (memoised)
    assert runs[0] == (None, 2, None, 1) and all(r[0] is not None for r in runs[1:])
    runs = runs[1:]
    assert runs and len(runs) % 3 == 0                      # 3 batches per products call: 16, 16, 8
    one_call = runs[:3]
    assert one_call == [(16, 3, 2, 2), (16, 3, 2, 2), (8, 3, None, 1)]
    assert runs == one_call * (len(runs) // 3)
    # the estimate: the same batches, chunks and vmap calls
    assert job.example_activations() == per_example
    assert estimated == ((16, 2, ((2, 1), (1, 1))), (8, 1, ((3, 1),)))
    vmap_calls = sum(calls for *_, calls in one_call)
    [(kind, batches, _)] = call.blocks
    assert kind == "products" and batches == pytest.approx(vmap_calls * FIXED_SCALE["gauss_newton"])
    dim = job.target.space.dim
    sizes = [(16, 2), (16, 1), (16, 2), (16, 1), (8, 3)]   # (examples, vectors) of each vmap call
    positions = job.layer_positions()                       # conv1 4×4, conv2 2×2, fc 1 (per example)
    assert call.flops == pytest.approx(sum(product_work(model, b, 1, c, "gauss_newton", dim, 8, positions).flops
                                           for b, c in sizes))
    assert "vmapped in chunks of 2 vectors (2 per batch of 16" in text and "5 vmap calls per call" in text
    # unchunked (E = 0): one vmap call per batch, the last batch at its own size
    with ga.options(batch_size=16, products_vmap_elements=0):
        assert job.vmap_calls() == ((16, 2, ((3, 1),)), (8, 1, ((3, 1),)))
        assert job.call_cost(torch.float64).blocks[0][1] == pytest.approx(3 * FIXED_SCALE["gauss_newton"])


def _forward_flops(model, X) -> float:
    """FLOPs of one real forward of ``model`` on ``X``, as torch counts them (its convolutions
    and matrix products: ``torch.utils.flop_counter``)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(X)
    return float(counter.get_total_flops())


@pytest.mark.parametrize("kind", ["gauss_newton", "hessian"])
def test_the_estimate_of_a_conv_products_call_counts_the_conv_work_at_every_output_position(kind):
    """A convolution multiplies its (in·k², out) weight at each of its output positions: the
    products job prices each weight layer's GEMMs at the positions one example's forward gives
    it (:meth:`~gradalg.plan.jobs.products.ProductsJob.layer_positions`: 4×4 and 2×2 here, 1
    for the Linear), so a call's FLOPs are, per ``vmap`` call of c vectors on a batch of b,
    ``(primal + tangent·c)`` times one real forward's FLOPs on those b examples as torch counts
    them (:data:`~gradalg.plan.jobs.products.PRODUCT_SWEEPS`). Before, every layer was priced
    at one position (the conv's work 16× and 4× under)."""
    from gradalg.plan.jobs.products import PRODUCT_SWEEPS
    model = models.cnn()
    X, y = models.image_data(n=40)
    task = ga.tasks.classification(model)
    make = ga.gauss_newton if kind == "gauss_newton" else ga.hessian
    with ga.options(batch_size=16):
        plan = LocalExecutor().plan(make(task, (X, y)).expr)
        [step] = _products_passes(plan)
        [job] = step.jobs
        call = job.call_cost(torch.float64)
        primal, tangent = PRODUCT_SWEEPS[kind]
        expected = sum(count * k * (primal + tangent * c) * _forward_flops(model, X[:b])
                       for b, count, sizes in job.vmap_calls() for c, k in sizes)
        assert [b for b, _, _ in job.vmap_calls()] == [16, 8]
        assert call.flops == pytest.approx(expected, rel=1e-12)
        assert job.layer_positions() == (16, 4, 1)


def test_an_mlp_products_call_keeps_its_flops_and_prices_each_tangent_gemm_once_for_the_vectors(setting):
    """An MLP's layers are at one position per example (T = 1), so pricing each weight layer at its
    measured positions leaves its work unchanged; ``vmap`` runs each tangent GEMM once for the m
    vectors, so the price lists one (m·B, out, in) GEMM ``tangent`` times per layer, not ``tangent·m``
    GEMMs (B, out, in): the same FLOPs. At one vector (the profile's calibration of
    ``product_work``) the price is bit-identical to the one before."""
    from gradalg.devices import local_profile
    from gradalg.plan.cost import Cost, gemm_cost
    from gradalg.plan.jobs.products import PRODUCT_SWEEPS, product_fixed, product_work, weighed
    from gradalg.plan.shapes import activation_bytes
    task, train, _ = setting
    model = task.model
    with ga.options(batch_size=16):
        plan = LocalExecutor().plan(ga.hessian(task, train).expr)
        [step] = _products_passes(plan)
        [job] = step.jobs
        assert job.layer_positions() == (1, 1)
        prof = local_profile()
        dim = job.target.space.dim
        call = job.call_cost(torch.float64, prof)
    primal, tangent = PRODUCT_SWEEPS["hessian"]
    shapes = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert shapes == [(8, 16), (16, 3)]

    def before(B, m):                                        # the price before: tangent·m GEMMs of B rows
        cost = Cost()
        for n_in, n_out in shapes:
            cost = cost + gemm_cost(B, n_out, n_in, primal, 8) + gemm_cost(B, n_out, n_in, tangent * m, 8)
        cost = cost + Cost(elementwise=activation_bytes(model, 1, 8) * B * (primal + tangent * m))
        return cost + Cost(bytes=5.0 * 8 * m * dim)
    # one vector: bit-identical, field for field, and the job's call (batches 16, 16, 8) with it
    for B in (16, 8):
        assert product_work(model, B, 1, 1, "hessian", dim, 8, job.layer_positions()) == before(B, 1)
    assert call == weighed(before(16, 1).scaled(2) + before(8, 1), prof.product_work) + product_fixed(model, "hessian", 3)
    # m vectors: the same FLOPs and bytes, the tangent GEMMs m·B rows tall
    work = product_work(model, 16, 1, 40, "hessian", dim, 8, job.layer_positions())
    old = before(16, 40)
    assert work.flops == pytest.approx(old.flops, rel=1e-12) and work.elementwise == old.elementwise
    assert sorted(g[:4] for g in work.gemms) == sorted([(16, n_out, n_in, primal) for n_in, n_out in shapes]
                                                      + [(40 * 16, n_out, n_in, tangent) for n_in, n_out in shapes])
