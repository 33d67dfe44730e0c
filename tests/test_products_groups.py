"""A products statistic's calls in groups (:class:`~gradalg.expr.operators.ProductCalls`): the
near-minimum rule's Lanczos probe (one vector a call) and the Hessian's formation (256 vectors a
call) share one products pass, whose job prices each group at its own vectors
(:meth:`~gradalg.plan.jobs.products.ProductsJob.stream_cost`) and whose line in ``explain()`` shows
the groups. Before, every call was priced at the formation's 256 vectors: the pass about 2× high.
Also the job's memory against what a conv net's products really allocate (torch.profiler)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import gradalg as ga
from gradalg.expr.operators import ProductCalls, Statistic
from gradalg.plan.jobs import ProductPass, ProductsJob

WD = 1e-2


def logreg_at_its_minimum():
    """Multinomial logistic regression, 31 → 16 (512 coordinates: forming its Hessian takes 2 calls
    of 256 products, so the probe may take 2 steps), trained by Newton's method (backtracking) to max |∇J| < 1e-10
    on J = (1/n) Σ CE + (wd/2)‖θ‖²: at its minimum, so the rule forms the Hessian after the probe."""
    g = torch.Generator().manual_seed(0)
    model = nn.Linear(31, 16).double()
    X = torch.randn(160, 31, generator=g, dtype=torch.float64)
    y = torch.randint(0, 16, (160,), generator=g)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]

    def J(theta):
        W, b = theta[:31 * 16].reshape(shapes[names.index("weight")]), theta[31 * 16:]
        return torch.nn.functional.cross_entropy(X[:150] @ W.T + b, y[:150]) + WD / 2 * (theta ** 2).sum()
    theta = torch.cat([model.weight.detach().reshape(-1), model.bias.detach()])
    for _ in range(50):
        grad = torch.func.grad(J)(theta)
        if grad.abs().max() < 1e-10:
            break
        step, t = torch.linalg.solve(torch.func.hessian(J)(theta), grad), 1.0
        while J(theta - t * step) > J(theta) and t > 1e-4:     # backtracking: Newton from far away may overshoot
            t /= 2
        theta = theta - t * step
    assert torch.func.grad(J)(theta).abs().max() < 1e-10
    with torch.no_grad():
        model.weight.copy_(theta[:31 * 16].reshape(16, 31))
        model.bias.copy_(theta[31 * 16:])
    return model, (X[:150], y[:150]), (X[150:], y[150:])


def test_a_statistic_composes_its_groups_through_solvers_and_a_probe():
    """``solved`` multiplies each group's calls and sets its vectors; ``preceded`` puts a group
    first; the totals (``calls``, ``calls_why``, ``vectors``) read across the groups."""
    s = Statistic("products", None, None)
    assert s.groups == (ProductCalls(1, None, ""),) and s.calls == 1 and s.vectors is None
    formed = s.solved(3, "formed", vectors=256)
    assert formed.groups == (ProductCalls(3, 256, "formed"),)
    probed = formed.preceded(ProductCalls(2, 1, "probe"))
    assert probed.groups == (ProductCalls(2, 1, "probe"), ProductCalls(3, 256, "formed"))
    assert (probed.calls, probed.vectors, probed.calls_why) == (5, 256, "probe + formed")
    solved = probed.solved(4, "CG")
    assert solved.groups == (ProductCalls(8, 1, "CG × probe"), ProductCalls(12, 256, "CG × formed"))
    parts = s.solved_in(((3, 256), (1, 3)), "formed")                  # a formation's full calls and its rest
    assert parts.groups == (ProductCalls(3, 256, "formed"), ProductCalls(1, 3, "formed")) and parts.calls == 4
    other = Statistic("fisher", None, None)
    assert other.solved(4, "CG") is other and other.preceded(ProductCalls(2, 1, "probe")) is other


def test_the_probe_and_the_formation_are_two_groups_priced_at_their_own_vectors(monkeypatch):
    """Influence at its near-minimum rule on a model at its minimum: the products pass's calls are
    the probe's 2 one-vector calls and the formation's 2 calls of 256; the pass's estimate is the
    sum of each call's price at the vectors the run gave it (its FLOPs and its seconds, within 1.5×,
    here equal), where the estimate before priced all 4 calls at 256 vectors (2× the FLOPs)."""
    model, train, queries = logreg_at_its_minimum()
    seen = []
    call = ProductPass.__call__
    monkeypatch.setattr(ProductPass, "__call__", lambda self, V: (seen.append(int(V.shape[0])), call(self, V))[1])
    S = ga.methods.influence(ga.tasks.classification(model), train, queries, curvature="near_minimum",
                             weight_decay=WD)
    shown = S.explain()
    [step] = [p for p in shown.plan.passes if p.per_call]
    [job] = step.jobs
    assert isinstance(job, ProductsJob)
    assert job.groups == ((2, 1, "2 Lanczos probe products"), (2, 256, "formed: 512 products, 256 per call"))
    assert (job.calls, job.vectors) == (4, 256) and step.cost.passes == 4
    text = str(shown)
    assert "up to 4 calls in 2 groups" in text
    assert "up to 2 calls of 1 vector(s) (2 Lanczos probe products)" in text
    assert "up to 2 calls of 256 vector(s), vmapped whole" in text and "(formed: 512 products, 256 per call)" in text
    S.compute()
    assert seen == [1, 1, 256, 256]                      # the run: the probe's calls, then the formation's
    plan = shown.plan
    dtype, prof = plan.facts.dtype, plan.device
    counted = [job.call_cost(dtype, prof, m) for m in seen]
    flops = sum(c.flops for c in counted)
    seconds = sum(prof.time_of(c, dtype) for c in counted)
    assert 1.0 <= step.cost.flops / flops <= 1.5 and step.cost.flops == pytest.approx(flops, rel=1e-12)
    assert 1.0 <= step.seconds / seconds <= 1.5 and step.seconds == pytest.approx(seconds, rel=1e-9)
    # one group (the formation's, without the probe): priced as that group's call × its calls, as before groups
    with ga.options(hessian_probe_iterations=0):
        plan = ga.methods.influence(ga.tasks.classification(model), train, queries, curvature="near_minimum",
                                    weight_decay=WD).explain().plan
    [one] = [p for p in plan.passes if p.per_call]
    assert one.jobs[0].groups == ((2, 256, "formed: 512 products, 256 per call"),)
    assert one.jobs[0].cost == one.jobs[0].call_cost(dtype, plan.device).scaled(2)


def _peak_bytes(fn) -> float:
    """The most bytes ``fn`` holds at once beyond what was allocated before it, from torch.profiler's
    memory events (each op's own allocations less its frees, in order). ``torch.func`` refuses
    ``saved_tensors_hooks`` under ``grad``/``vjp``, so the allocator's own record is read instead."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = top = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        now += event.self_cpu_memory_usage
        top = max(top, now)
    return float(top)


def conv_wd_net():
    """``benchmarks/fidelity.py``'s ``conv_wd`` net: 1×8×8 → Conv2d(1, 4, 3) → tanh → Conv2d(4, 8, 3)
    → tanh → AvgPool2d(2) → Linear(128, 10) (its activations mostly the conv output maps)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(4, 8, 3, padding=1), nn.Tanh(), nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(128, 10)).double()


@pytest.mark.parametrize("kind", ["hessian", "gauss_newton"])
@pytest.mark.parametrize("vmap_elements", [0, 300_000])
def test_a_conv_products_call_holds_no_more_than_the_job_prices_and_not_a_third_of_it(kind, vmap_elements):
    """The products job's memory (its vectors and sums, and per example what autograd holds for the
    primal and each vector of the largest ``vmap`` chunk, measured on the meta device) is at
    least what one batch's products call on a conv net really allocates (torch.profiler's memory
    events) and at most 3× it, whole or in ``vmap`` chunks. Before, the activations were counted
    from the weight layers at one position each, ×(1 + m): a tenth to a third of the conv maps held."""
    from gradalg.curvature.hvp import Products
    from gradalg.data import as_data
    from gradalg.exec import LocalExecutor
    model = conv_wd_net()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(48, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (48,), generator=g)
    task, m = ga.tasks.classification(model), 64
    make = ga.hessian if kind == "hessian" else ga.gauss_newton
    with ga.options(batch_size=32, products_vmap_elements=vmap_elements):
        plan = LocalExecutor().plan(make(task, (X, y)).expr)
        [step] = [p for p in plan.passes if p.per_call]
        job = replace(step.jobs[0], groups=((1, m, ""),))
        estimate = job.fixed_bytes(plan.facts) + job.per_example_bytes(plan.facts) * job.batch
        products = Products(task, as_data((X, y)), job.target.layers, kind)
        _, batch = next(products.batches(job.batch))
        V = torch.randn(m, job.target.space.dim, generator=g, dtype=torch.float64)
        chunks = job.vmap_calls()[0][2]
        assert chunks == (((m, 1),) if vmap_elements == 0 else ((5, 12), (4, 1)))   # whole, or chunks of 5
        measured = _peak_bytes(lambda: products.batch_rows(batch, V, 0))
    assert measured > 0
    assert measured <= estimate <= 3 * measured, (estimate / measured, chunks)


def test_a_float64_conv_products_call_prices_the_columns_its_im2col_kernel_writes_and_reads():
    """On the CPU, a float64 convolution runs torch's im2col kernel (``Slow2d``): every GEMM of the
    layer (the primal's and each vector's tangent's) first writes each example's columns (C_in·k², P)
    and reads them back. The products job prices those bytes, 2·in·P·elem per example and GEMM, at
    the memory bandwidth, for exactly the conv layers whose kernel unfolds (torch's own choice) and
    no other: the conv_wd net's two convolutions (in = 9 and 36 at P = 64 output pixels) and not its
    Linear. Before, the columns were unpriced and a float64 conv net's dense Hessian calls ran
    1.4-1.9x their estimate (``benchmarks/products_conv.py``)."""
    from gradalg.exec import LocalExecutor
    from gradalg.plan.jobs.products import PRODUCT_SWEEPS, product_work
    model = conv_wd_net()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(40, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (40,), generator=g)
    task = ga.tasks.classification(model)
    for kind, make in (("hessian", ga.hessian), ("gauss_newton", ga.gauss_newton)):
        with ga.options(batch_size=32, products_vmap_elements=0):
            plan = LocalExecutor().plan(make(task, (X, y)).expr)
        [step] = [p for p in plan.passes if p.per_call]
        job = replace(step.jobs[0], groups=((1, 3, ""),))
        assert job.layer_positions() == (64, 64, 1)
        assert job.layer_unfolds(32) == (True, True, False)          # the two float64 convolutions
        assert job.layer_unfolds(8) == (True, True, False)
        primal, tangent = PRODUCT_SWEEPS[kind]
        dim = job.target.space.dim
        for b in (32, 8):                                              # the full batches, the last one
            plain = product_work(model, b, 1, 3, kind, dim, 8, (64, 64, 1))
            unfolded = product_work(model, b, 1, 3, kind, dim, 8, (64, 64, 1), job.layer_unfolds(b))
            columns = 2 * 8 * (9 * 64 + 36 * 64) * b * (primal + tangent * 3)
            assert unfolded.bytes - plain.bytes == pytest.approx(columns, rel=1e-12)
            assert unfolded.flops == plain.flops and unfolded.elementwise == plain.elementwise
        # the job's call prices them: one call over 40 examples, a batch of 32 and one of 8
        call = job.call_cost(torch.float64)
        expected = 2 * 8 * (9 * 64 + 36 * 64) * 40 * (primal + tangent * 3) + 2 * 5 * 8 * 3 * dim   # + the sums
        assert call.bytes == pytest.approx(expected, rel=1e-12)
