"""The products pass decides in the plan, before any run, whether a call's vectors go through one
``torch.func.vmap`` or a loop of one product per vector (``DecisionKind.PRODUCTS_BATCHING``), from a
probe on the meta device (:func:`~gradalg.curvature.hvp.probe_batching`); the loop is priced as m
calls of one vector, the run follows the plan, and a model the probe passed but whose real batch
vmap fails raises a typed error naming the fix, never a silent fallback."""
import os
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

import gradalg as ga
from gradalg.curvature import hvp
from gradalg.data import as_data
from gradalg.devices import profile
from gradalg.curvature.hvp import BatchingProbe, ParamCoords, probe_batching
from gradalg.errors import OptionError, UnsupportedLayerError
from gradalg.exec import LocalExecutor
from gradalg.plan.decisions import DecisionSource
from gradalg.plan.jobs import ProductsJob

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import zoo  # noqa: E402
from references import one_thread  # noqa: E402,F401
from test_influence_near_minimum import _TanhNoJvp  # noqa: E402


class _NoVmapTanh(_TanhNoJvp):
    """tanh with backward and jvp rules but no vmap rule: torch.func.vmap refuses it."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def jvp(ctx, t):
        (y,) = ctx.saved_tensors
        return t * (1 - y * y)


class NoVmapNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16).double(), nn.Linear(16, 3).double()

    def forward(self, x):
        return self.b(_NoVmapTanh.apply(self.a(x)))


class GatedNet(nn.Module):
    """Branches on a buffer's value: vmap batches it, the meta device cannot run it (undecided)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16).double(), nn.Linear(16, 3).double()
        self.register_buffer("gate", torch.ones((), dtype=torch.float64))

    def forward(self, x):
        h = self.a(x)
        return self.b(h.tanh() if self.gate > 0 else h)


def _setting(model):
    X, y = models.classification_data(n=20)
    return ga.tasks.classification(model), (X, y), (X[:3], y[:3])


def _job(plan) -> ProductsJob:
    [job] = [j for p in plan.passes if p.per_call for j in p.jobs]
    return job


@pytest.fixture
def batchings(monkeypatch):
    """The ``batching`` of every batch of products the run computes."""
    seen, inner = [], hvp._batch_product

    def spy(*args, **kwargs):
        seen.append(args[6] if len(args) > 6 else kwargs.get("batching", "vmap"))
        return inner(*args, **kwargs)
    monkeypatch.setattr(hvp, "_batch_product", spy)
    return seen


def _dense_hessian(model, X, y, layers):
    """(1/n) Σ_i ∇²L_i in the products' coordinates, column by column by double backward in float64."""
    coords = ParamCoords(model, layers)
    params = [model.get_parameter(n) for n in coords.param_names]
    loss = nn.functional.cross_entropy(model(X), y, reduction="sum") / len(y)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    eye = torch.eye(sum(p.numel() for p in params), dtype=torch.float64)
    cols = []
    for i in range(len(eye)):
        V = coords.to_params(eye[i:i + 1])
        Hv = torch.autograd.grad(grads, params, [V[n][0] for n in coords.param_names], retain_graph=True)
        cols.append(coords.from_params({n: h.unsqueeze(0) for n, h in zip(coords.param_names, Hv)}))
    return torch.cat(cols)


def test_a_model_vmap_batches_is_planned_and_run_through_vmap(batchings):
    task, train, queries = _setting(models.mlp())
    S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver="cg", damping=0.1)
    ex = LocalExecutor()
    plan = ex.plan(S.expr)
    decision = plan.decisions.one("products_batching")
    assert decision.chosen == "vmap" and _job(plan).batching == "vmap" and decision.source is DecisionSource.PLANNER
    assert set(decision.alternatives) == {"vmap", "loop"} and "meta device" in decision.reason
    S.compute(executor=ex)
    assert batchings and set(batchings) == {"vmap"}


def test_a_model_vmap_cannot_batch_loops_from_the_plan_and_equals_the_dense_hessian(batchings):
    model = NoVmapNet()
    task, (X, y), (Xq, yq) = _setting(model)
    assert probe_batching(task, (X[:1], y[:1]), ["a.weight"], "hessian").batching == "loop"
    H = ga.hessian(task, (X, y))
    ex = LocalExecutor()
    plan = ex.plan(H.expr)
    decision = plan.decisions.one("products_batching")
    # decided before any run (nothing has run: no batch was computed), with the probe's error class
    assert not batchings and decision.chosen == "loop" and _job(plan).batching == "loop"
    assert "RuntimeError" in decision.reason and "NoVmap" in decision.reason
    resolved = ex.resolve(H.expr)
    V = torch.randn(4, H.expr.space.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = resolved.apply(V)
    assert batchings and set(batchings) == {"loop"}
    dense = _dense_hessian(model, X, y, ["a", "b"])
    torch.testing.assert_close(got, V @ dense, rtol=1e-9, atol=1e-11)
    # and the scores of a CG influence through the looped pass equal the dense solve
    S = ga.methods.influence(task, (X, y), (Xq, yq), curvature="hessian", solver="cg", damping=1.0)
    shown = str(S.explain())
    assert "batching of the vectors of hessian products" in shown and "chose loop" in shown
    assert "looped: 3 calls of one vector per batch" in shown
    scores = np.asarray(S.compute(executor=LocalExecutor()))
    flat = lambda R: torch.cat([v.flatten(1) for v in R.to_dense().values()], 1)   # noqa: E731
    Q, G = flat(ga.grads(task, (Xq, yq))), flat(ga.grads(task, (X, y)))
    ref = (Q @ torch.linalg.solve(dense + torch.eye(len(dense), dtype=dense.dtype), G.T)).numpy()
    np.testing.assert_allclose(scores, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))


def test_the_loop_is_priced_as_m_calls_of_one_vector():
    task, train, _ = _setting(NoVmapNet())
    H = ga.hessian(task, train)
    job = _job(LocalExecutor().plan(H.expr))
    assert job.batching == "loop"
    one, eight = job.call_cost(torch.float64, None, 1), job.call_cost(torch.float64, None, 8)
    assert one.flops > 0 and eight.flops == pytest.approx(8 * one.flops, rel=1e-12)
    prof = profile("cpu")
    assert eight.seconds(prof) == pytest.approx(8 * one.seconds(prof), rel=1e-9)
    vmapped = replace(job, batching="vmap").call_cost(torch.float64, None, 8)
    assert vmapped.flops < eight.flops     # vmap runs the primal once for the 8 vectors


def test_a_model_the_meta_device_cannot_run_is_probed_on_its_first_example(batchings):
    """GatedNet branches on a buffer's value: the meta device cannot run it, the first example
    with the real weights can, and vmap batches it; the run follows the plan, and equals the
    loop the option forces."""
    task, train, queries = _setting(GatedNet())
    S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver="cg", damping=0.1)
    decision = LocalExecutor().plan(S.expr).decisions.one("products_batching")
    assert decision.chosen == "vmap" and "first example" in decision.reason
    assert "products_batching='vmap' or 'loop'" in decision.reason
    vmapped = np.asarray(S.compute(executor=LocalExecutor()))
    assert set(batchings) == {"vmap"}
    batchings.clear()
    with ga.options(products_batching="loop"):
        plan = LocalExecutor().plan(S.expr)
        forced = plan.decisions.one("products_batching")
        assert forced.chosen == "loop" and forced.source is DecisionSource.OPTIONS
        assert forced.setting == "products_batching='loop'"
        looped = np.asarray(S.compute(executor=LocalExecutor()))
    assert set(batchings) == {"loop"}
    np.testing.assert_allclose(vmapped, looped, rtol=1e-10, atol=1e-12 * float(np.abs(looped).max()))


def test_hugging_face_attention_with_a_padding_mask_is_batched_and_equals_the_dense_hessian(batchings):
    """SDPA with a padding mask: the mask builder's ``.item()`` cannot run on meta (the plan
    looped these models before); the first-example probe decides vmap, and the products equal
    the float64 double-backward Hessian of the attributed block."""
    model = models.gpt2(n_layer=1, n_embd=16, vocab=31)
    task, data = models.lm_task(model), models.padded_token_data(n=5, vocab=31, min_len=3, max_len=7)
    layer = "transformer.h.0.attn.c_proj"
    names = [f"{layer}.weight", f"{layer}.bias"]
    probe = probe_batching(task, tuple(t[:1] for t in data), names, "hessian")
    assert (probe.batching, probe.where) == ("vmap", "first example") and ".item()" in probe.meta_error
    decision = LocalExecutor().plan(ga.hessian(task, data, layers=[layer]).expr).decisions.one("products_batching")
    assert decision.chosen == "vmap" and "first example" in decision.reason
    matvec = hvp.dataset_matvec(task, as_data(data), [layer])
    coords = ParamCoords(model, [layer])
    params = [model.get_parameter(n) for n in coords.param_names]
    loss = task.summed_loss(model, data) / len(data[0])
    grads = torch.autograd.grad(loss, params, create_graph=True)
    dim = sum(p.numel() for p in params)
    V = torch.randn(3, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = torch.stack([coords.from_params({n: h.unsqueeze(0) for n, h in zip(
        coords.param_names, torch.autograd.grad(grads, params, [coords.to_params(v[None])[n][0]
                                                                 for n in coords.param_names], retain_graph=True))})[0]
                        for v in V])
    torch.testing.assert_close(matvec(V), want, rtol=1e-8, atol=1e-10)
    assert set(batchings) == {"vmap"}


def test_a_model_with_meta_weights_stays_undecided_and_loops():
    """No weight to run the first example with: undecided, the loop (the safe side)."""
    model = GatedNet().to("meta")
    X, _ = models.classification_data(n=2)
    probe = probe_batching(ga.tasks.classification(model), (X[:1], torch.zeros(1, dtype=torch.long)),
                           ["a.weight", "a.bias"], "hessian")
    assert probe.batching is None and probe.where == "meta" and probe.error


def test_vmap_forced_on_a_model_it_cannot_batch_raises_a_typed_error_naming_the_fix():
    task, train, queries = _setting(NoVmapNet())
    S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver="cg", damping=0.1)
    with ga.options(products_batching="vmap"), pytest.raises(UnsupportedLayerError) as err:
        S.compute(executor=LocalExecutor())
    assert "NoVmap" in str(err.value) and "products_batching='loop'" in str(err.value)
    with pytest.raises(OptionError, match="products_batching"):
        ga.options(products_batching="sometimes").__enter__()


def test_out_of_memory_under_vmap_is_raised_as_it_is(monkeypatch):
    """Memory is not vmap's failure: the error is not turned into the vmap one (whose fix is the loop)."""
    task, train, _ = _setting(models.mlp())
    matvec = hvp.dataset_matvec(task, as_data(train), ["0", "2"])

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (test)")
    monkeypatch.setattr(hvp, "vmap", lambda *args, **kwargs: full)
    with pytest.raises(torch.OutOfMemoryError):
        matvec(torch.ones(2, sum(p.numel() for p in task.model.parameters()), dtype=torch.float64))


def test_the_products_outside_a_plan_follow_the_same_decision(batchings):
    task, train, _ = _setting(NoVmapNet())
    matvec = hvp.dataset_matvec(task, as_data(train), ["a", "b"])
    V = torch.randn(2, sum(p.numel() for p in task.model.parameters()), dtype=torch.float64)
    torch.testing.assert_close(matvec(V), V @ _dense_hessian(task.model, *train, ["a", "b"]), rtol=1e-9, atol=1e-11)
    assert set(batchings) == {"loop"}


def test_the_probe_is_memoised_by_the_architecture_not_the_weights(monkeypatch):
    monkeypatch.setattr(hvp, "_PROBES", {})
    probes, inner = [], hvp.probe_batching
    monkeypatch.setattr(hvp, "probe_batching", lambda *a: probes.append(a[3]) or inner(*a))
    model = NoVmapNet()
    task, train, _ = _setting(model)
    before = LocalExecutor().plan(ga.hessian(task, train).expr)
    with torch.no_grad():
        model.a.weight.add_(0.5)                       # an optimizer step: a new token, the same architecture
    after = LocalExecutor().plan(ga.hessian(task, train).expr)
    assert _job(before).target.token != _job(after).target.token
    assert probes == ["hessian"] and _job(after).batching == "loop"
    LocalExecutor().plan(ga.gauss_newton(task, train).expr)     # another kind is probed on its own
    assert probes == ["hessian", "gauss_newton"]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_probe_passes_transformers_with_eager_attention(arch):
    model, task, data, _ = getattr(zoo, arch)()
    model.set_attn_implementation("eager")
    names = [n for n, _ in model.named_parameters()]
    assert probe_batching(task, tuple(t[:1] for t in data), names, "hessian") == BatchingProbe("vmap")
    # no weight was touched: the probe runs on meta
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_gauss_newton_without_the_task_s_forward_is_refused_by_the_plan_not_probed():
    """A task without ``forward`` / ``loss_from_outputs`` cannot give Gauss-Newton products: the
    plan refuses it with the fix (before, its probe failed with a TypeError and the plan showed
    an "undecided" loop; only the run refused)."""
    model = NoVmapNet()
    _, train, queries = _setting(model)
    task = ga.Task(model, lambda m, batch: nn.functional.cross_entropy(m(batch[0]), batch[1], reduction="sum"))
    S = ga.methods.influence(task, train, queries, curvature="gauss_newton", solver="cg", damping=0.1)
    with pytest.raises(OptionError, match="loss_from_outputs.*ga.tasks.classification"):
        S.explain()
