"""A products statistic's calls in groups (:class:`~gradalg.expr.operators.ProductCalls`): the
near-minimum rule's Lanczos probe (one vector a call) and the Hessian's formation (256 vectors a
call) share one products pass, whose job prices each group at its own vectors
(:meth:`~gradalg.plan.jobs.products.ProductsJob.stream_cost`) and whose line in ``explain()`` shows
the groups. Before, every call was priced at the formation's 256 vectors: the pass about 2× high.
Also the job's memory against what a conv net's products really allocate (torch.profiler), and a
model ``vmap`` cannot run, planned (priced and run) as the loop once a run has shown it."""
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
    primal and each vector of the largest ``vmap`` chunk, from the meta forward's output maps) is at
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


class _Tanh(torch.autograd.Function):
    """tanh as a custom Function with a backward and a jvp but no vmap rule (a custom kernel's
    usual shape): ``grad`` and ``jvp`` run it, ``vmap`` cannot."""

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * (1 - out * out)

    @staticmethod
    def jvp(ctx, t):
        (out,) = ctx.saved_tensors
        return t * (1 - out * out)


class CustomTanhMLP(nn.Module):
    """8 → 16 → 3, its activation a :class:`_Tanh` (``vmap`` cannot run the model)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16).double(), nn.Linear(16, 3).double()

    def forward(self, x):
        return self.fc2(_Tanh.apply(self.fc1(x)))


def test_a_model_vmap_cannot_run_is_priced_and_run_as_a_loop_once_the_plan_knows(monkeypatch):
    """A model with a custom autograd Function without a vmap rule (``vmap`` cannot run it): the first run falls back to a
    loop over the vectors, and the pass records it (:data:`~gradalg.plan.jobs.products.LOOPED`); the
    next plan of the same products makes the loop its decision (``job.loop``, shown in ``explain()``):
    each call priced as m products of one vector (each its primal sweeps and fixed cost, as the loop
    runs them), its memory at one vector's, and the run loops without trying ``vmap`` first, with the
    same numbers (bit-identical). Before, a looping run was priced as one ``vmap`` call of m vectors."""
    import warnings

    import numpy as np

    from gradalg.curvature import hvp
    from gradalg.plan.jobs.products import LOOPED
    model = CustomTanhMLP()
    g = torch.Generator().manual_seed(2)
    X, y = torch.randn(40, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (40,), generator=g)
    task = ga.tasks.classification(model)
    with ga.options(batch_size=16):
        S = ga.methods.influence(task, (X, y), (X[:3], y[:3]), curvature="hessian", solver="cg", damping=0.5,
                                 solver_settings={"max_iter": 3})
        LOOPED.clear()

        def job_of(shown):
            [step] = [p for p in shown.plan.passes if p.per_call]
            return step, step.jobs[0]
        before, job0 = job_of(S.explain())
        assert job0.loop == "" and job0.vectors == 3 and job0.vmap_calls() == ((16, 2, ((3, 1),)), (8, 1, ((3, 1),)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            first = np.asarray(S.compute())
        assert list(LOOPED) == [job0.target.token] and "Error" in LOOPED[job0.target.token]
        shown = S.explain()
        after, job = job_of(shown)
        assert job.loop == LOOPED[job.target.token] and job.vmap_calls() == ((16, 2, ((1, 3),)), (8, 1, ((1, 3),)))
        assert "looped over its vectors, one product each (vmap could not run the model on an earlier run" in str(shown)
        dtype = shown.plan.facts.dtype
        one = replace(job, groups=((1, 1, ""),)).call_cost(dtype)          # one vector: vmap or loop, the same
        looped, vmapped = job.call_cost(dtype), job0.call_cost(dtype)
        assert looped.flops == pytest.approx(3 * one.flops, rel=1e-12)
        assert looped.blocks[0][1] == pytest.approx(3 * one.blocks[0][1])   # the fixed cost: once per vector
        assert vmapped.blocks[0][1] == pytest.approx(one.blocks[0][1])      # vmap's: once per batch
        assert after.seconds > before.seconds
        assert job.per_example_bytes(shown.plan.facts) < job0.per_example_bytes(shown.plan.facts)
        tried = []

        def no_vmap(*args, **kwargs):
            tried.append(1)
            raise AssertionError("vmap tried")
        monkeypatch.setattr(hvp, "vmap", no_vmap)
        np.testing.assert_array_equal(np.asarray(S.compute()), first)
    assert tried == []                                                # the plan's loop: vmap not tried
    LOOPED.clear()


def test_a_formation_prices_its_last_call_at_the_rest_of_its_columns():
    """Forming a 771-coordinate Hessian takes 3 calls of 256 columns and one of 3: two groups, the
    last call priced at its 3 vectors (before: at 256, a fourth call's worth of work too many)."""
    import models
    from gradalg.exec import LocalExecutor
    from gradalg.expr.curvature import Formed
    model = models.mlp(hidden=64)
    X, y = models.classification_data(n=40)
    H = ga.hessian(ga.tasks.classification(model), (X, y))
    [s] = Formed(H.expr).statistics()
    why = "formed: 771 products, 256 per call"
    assert s.groups == (ProductCalls(3, 256, why), ProductCalls(1, 3, why))
    plan = LocalExecutor().plan(Formed(H.expr))
    [step] = [p for p in plan.passes if p.per_call]
    [job] = step.jobs
    assert job.groups == ((3, 256, why), (1, 3, why)) and job.calls == 4 and step.cost.passes == 4
    dtype = plan.facts.dtype
    assert step.cost.flops == pytest.approx(3 * job.call_cost(dtype, None, 256).flops + job.call_cost(dtype, None, 3).flops,
                                            rel=1e-12)
    assert step.cost.flops < 3.5 * job.call_cost(dtype, None, 256).flops
