"""``ga.capture`` around a user's own training loop, against the torch.func oracle.

The per-example gradients captured at a step must equal the oracle at the parameters
*of that step* (before ``opt.step()``), so each test snapshots the model before stepping.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga
from gradalg.capture import resolve_layers
from models import classification_data, cnn, gpt2, image_data, lm_loss, lm_task, mlp, padded_token_data

TOL = {torch.float64: 1e-5, torch.float32: 1e-4}


def assert_rows_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = ""):
    """Per-example relative error ‖a_i − e_i‖ / ‖e_i‖ ≤ tol."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().flatten(1).double(), expected.detach().flatten(1).double()
    norms = e.norm(dim=1)
    floor = 1e-6 * max(float(norms.max()), 1e-30)
    err = (a - e).norm(dim=1) / norms.clamp_min(floor)
    assert float(err.max()) <= tol, f"{what}: per-example relative error {err.max():.3g} > {tol}"


def params_of_blocks(model: nn.Module, layers, dense: dict) -> dict:
    """Captured ``{block: (n, out, in)}`` in the model's layout ``{param: (n, *shape)}``."""
    out = {}
    for ref in resolve_layers(model, list(layers)):
        for pname, value in ref.rule.to_params(ref.module, dense[ref.name]).items():
            out[f"{ref.name}.{pname}"] = value
    return out


def oracle_at(make_model, state: dict, task_of, batch, names, method="vmap"):
    """Per-example gradients of ``batch`` at parameters ``state``, on a fresh model (no hooks)."""
    model = make_model()
    model.load_state_dict(state)
    return ga.per_example_grads(task_of(model), batch, names, method=method)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def batches(data, size):
    n = data[0].shape[0]
    return [tuple(t[i:i + size] for t in data) for i in range(0, n, size)]


def stack_reference(refs: list[dict]) -> dict:
    return {k: torch.cat([r[k] for r in refs]) for k in refs[0]}


def assert_params_close(captured: dict, reference: dict, tol: float):
    assert sorted(captured) == sorted(reference)
    for name in reference:
        assert_rows_close(captured[name], reference[name], tol, name)


# ---------------------------------------------------------------------------- training loops
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sgd_loop_matches_oracle_at_each_step(dtype):
    model = mlp(dtype=dtype)
    data = classification_data(n=10, dtype=dtype)
    layers = ["0", "2"]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    refs, names = [], ["0.weight", "0.bias", "2.weight", "2.bias"]
    with ga.capture(model, layers=layers) as cap:
        for _ in range(2):                                    # two epochs of chunks 4, 4, 2
            for x, y in batches(data, 4):
                refs.append(oracle_at(lambda: mlp(dtype=dtype), snapshot(model), ga.tasks.classification,
                                      (x, y), names))
                opt.zero_grad()
                F.cross_entropy(model(x), y, reduction="sum").backward()
                opt.step()
    assert cap.steps == 6
    G = cap.grads
    assert G.n == 20 and G.ids == tuple(range(20))
    assert set(G.representation.values()) == {"factored"}
    captured = params_of_blocks(model, layers, G.to_dense())
    reference = stack_reference(refs)
    assert_params_close(captured, reference, TOL[dtype])
    # the parameters moved, so gradients at the final parameters would not match
    final = ga.per_example_grads(ga.tasks.classification(model), data, names)
    assert (final["0.weight"] - reference["0.weight"][10:]).norm() > 1e-2 * reference["0.weight"].norm()


def test_cnn_adam_loop():
    model = cnn()
    data = image_data(n=8)
    layers = ["conv1", "conv2", "fc"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    names = ["conv1.weight", "conv1.bias", "conv2.weight", "fc.weight", "fc.bias"]
    refs = []
    with ga.capture(model, layers=layers) as cap:
        for x, y in batches(data, 3):
            refs.append(oracle_at(cnn, snapshot(model), ga.tasks.classification, (x, y), names))
            opt.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            opt.step()
    captured = params_of_blocks(model, layers, cap.grads.to_dense())
    assert_params_close(captured, stack_reference(refs), TOL[torch.float64])


def test_gpt2_loop_with_padded_batches():
    model = gpt2()
    model.train()                                            # dropout is 0 in the test config
    data = padded_token_data(n=5)
    layers = ["transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = None
    refs = []
    with ga.capture(model, layers=layers) as cap:
        for batch in batches(data, 3):
            names = names or [n for n, _ in model.named_parameters()
                              if n.rsplit(".", 1)[0] in layers]
            refs.append(oracle_at(gpt2, snapshot(model), lm_task, batch, names, method="loop"))
            opt.zero_grad()
            lm_loss(model, batch).backward()
            opt.step()
    captured = params_of_blocks(model, layers, cap.grads.to_dense())
    assert_params_close(captured, stack_reference(refs), TOL[torch.float64])


def test_reduction_mean_loop_equals_sum():
    """A mean-reduced loop (F.cross_entropy's default) recorded with reduction='mean' gives
    the per-example gradients of the summed loss, the short last batch included."""
    data = classification_data(n=10)
    layers = ["0", "2"]
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    captured = {}
    for reduction in ("sum", "mean"):
        model = mlp()
        with ga.capture(model, layers=layers, reduction=reduction) as cap:
            for x, y in batches(data, 4):
                loss = F.cross_entropy(model(x), y, reduction=reduction)
                loss.backward()                               # no optimizer step
        captured[reduction] = params_of_blocks(model, layers, cap.grads.to_dense())
    reference = ga.per_example_grads(ga.tasks.classification(mlp()), data, names)
    assert_params_close(captured["sum"], reference, TOL[torch.float64])
    assert_params_close(captured["mean"], reference, TOL[torch.float64])


def test_on_batch_sees_each_step_before_the_optimizer_step():
    model = mlp()
    data = classification_data(n=10)
    layers = ["0", "2"]
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen, snapshots = [], []
    with ga.capture(model, layers=layers) as cap:
        @cap.on_batch
        def record(step_grads):
            assert isinstance(step_grads, ga.GradientSet)
            seen.append((snapshot(model), step_grads.n, step_grads.to_dense()))

        for x, y in batches(data, 4):
            snapshots.append(snapshot(model))
            opt.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            opt.step()
    assert [n for _, n, _ in seen] == [4, 4, 2]
    for (params_then, _, dense), before, (x, y) in zip(seen, snapshots, batches(data, 4)):
        for k in before:                                      # called before opt.step()
            assert torch.equal(params_then[k], before[k]), k
        reference = oracle_at(mlp, before, ga.tasks.classification, (x, y), names)
        assert_params_close(params_of_blocks(model, layers, dense), reference, TOL[torch.float64])


def test_keep_false_keeps_nothing_but_calls_back():
    model = mlp()
    data = classification_data(n=10)
    calls = []
    with ga.capture(model, layers=["2"], keep=False) as cap:
        cap.on_batch(lambda g: calls.append(g.n))
        for x, y in batches(data, 4):
            F.cross_entropy(model(x), y, reduction="sum").backward()
    assert calls == [4, 4, 2]
    assert cap.steps == 3
    assert cap.grads.n == 0
    assert cap.store.chunks_ == []


# ---------------------------------------------------------------------------- loop shapes
def test_no_grad_evaluation_inside_the_loop_is_ignored():
    model = mlp()
    data = classification_data(n=8)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    with ga.capture(model, layers=["0", "2"]) as cap:
        for x, y in batches(data, 4):
            F.cross_entropy(model(x), y, reduction="sum").backward()
            with torch.no_grad():
                model(data[0])                               # evaluation: not recorded
    assert cap.grads.n == 8
    reference = ga.per_example_grads(ga.tasks.classification(model), data, names)
    assert_params_close(params_of_blocks(model, ["0", "2"], cap.grads.to_dense()), reference,
                        TOL[torch.float64])


def test_inplace_activation_and_weight_sharing():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.act = nn.ReLU(inplace=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = self.act(self.lin(x))
            h = self.act(self.lin(h))                        # same Linear twice, in-place ReLU after
            return self.head(h)

    def make():
        torch.manual_seed(0)
        return Shared().double()

    model = make()
    data = classification_data(n=9)
    names = ["lin.weight", "lin.bias", "head.weight", "head.bias"]
    with ga.capture(model, layers=["lin", "head"]) as cap:
        for x, y in batches(data, 4):
            F.cross_entropy(model(x), y, reduction="sum").backward()
    dense = cap.grads.to_dense()
    reference = ga.per_example_grads(ga.tasks.classification(make()), data, names)
    assert_params_close(params_of_blocks(model, ["lin", "head"], dense), reference, TOL[torch.float64])


def test_grads_is_a_snapshot_and_hooks_are_removed_on_exit():
    model = mlp()
    data = classification_data(n=8)
    with ga.capture(model, layers=["0", "2"]) as cap:
        x, y = data[0][:4], data[1][:4]
        F.cross_entropy(model(x), y, reduction="sum").backward()
        first = cap.grads
        F.cross_entropy(model(x), y, reduction="sum").backward()
    assert first.n == 4 and cap.grads.n == 8
    assert all(not m._forward_hooks for m in model.modules())
    F.cross_entropy(model(x), y, reduction="sum").backward()  # after exit: not recorded
    assert cap.grads.n == 8 and cap.steps == 2


def test_captured_grads_feed_the_algebra():
    """cap.grads is a GradientSet like any other: scores against ga.grads agree with the oracle."""
    model = mlp()
    data = classification_data(n=6)
    with ga.capture(model, layers=["0", "2"]) as cap:
        for x, y in batches(data, 4):
            F.cross_entropy(model(x), y, reduction="sum").backward()
    task = ga.tasks.classification(model)
    Q = ga.grads(task, classification_data(n=3, seed=7), layers=["0", "2"])
    scores = (Q @ cap.grads.T).compute().values
    ref_q = ga.per_example_grads(task, classification_data(n=3, seed=7))
    ref_g = ga.per_example_grads(task, data)
    flat = lambda r: torch.cat([r[k].flatten(1) for k in sorted(r)], 1)  # noqa: E731
    expected = flat(ref_q) @ flat(ref_g).T
    assert scores.shape == (3, 6)
    assert_rows_close(torch.as_tensor(scores), expected, TOL[torch.float64])


# ---------------------------------------------------------------------------- errors
def test_capture_refuses_unsupported_layers_and_bad_names():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    with pytest.raises(ga.UnsupportedLayerError, match="backend='func'"):
        ga.capture(model, layers=["1"])
    with pytest.raises(KeyError, match="no module named"):
        ga.capture(model, layers=["fc"])
    with pytest.raises(ValueError, match="reduction"):
        ga.capture(model, layers=["0"], reduction="none")


def test_unused_layer_is_reported():
    model = mlp()
    x, y = classification_data(n=4)
    with pytest.raises(RuntimeError, match="not used"):
        with ga.capture(model, layers=["0", "2"]):
            F.cross_entropy(model[2](torch.tanh(x @ torch.ones(8, 16, dtype=x.dtype))), y,
                            reduction="sum").backward()



@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gpt2_with_gradient_checkpointing(use_reentrant):
    """Non-reentrant checkpointing re-runs forwards inside backward(): those calls are skipped.
    Reentrant checkpointing hides the first forward (no_grad) from hooks: refused, naming the fix."""
    model = gpt2()
    data = padded_token_data(n=4)
    layers = ["transformer.wte", "transformer.h.0.mlp.c_fc", "lm_head"]
    names = ["transformer.wte.weight", "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.bias",
             "lm_head.weight"]
    reference = ga.per_example_grads(lm_task(model), data, names, method="loop")
    model.train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if use_reentrant:
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            with ga.capture(model, layers=layers):
                lm_loss(model, data).backward()
        return
    with ga.capture(model, layers=layers) as cap:
        lm_loss(model, data).backward()
    assert_params_close(params_of_blocks(model, layers, cap.grads.to_dense()), reference, TOL[torch.float64])


def test_capture_warns_when_the_loops_reduction_is_not_stated():
    """ga.capture cannot see the loss: an unstated reduction is assumed to be a sum, loudly;
    stating it (either way) is silent."""
    import warnings

    model = torch.nn.Linear(3, 2)
    with pytest.warns(UserWarning, match="reduction='mean'"):
        ga.capture(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ga.capture(model, reduction="sum")
        ga.capture(model, reduction="mean")


def test_an_evaluation_forward_without_backward_is_named_with_the_fix():
    """A forward with gradients on whose output never reaches a backward leaves the step open:
    the next forward raises gradalg's CaptureStateError (a RuntimeError) naming the fix, and the
    fix (evaluation under no_grad) captures every training step."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x = torch.randn(5, 4)
    with pytest.raises(ga.errors.CaptureStateError, match="no_grad"):
        with ga.capture(m, reduction="sum"):
            m(x)
            m(x).sum().backward()
            m(x).sum().backward()
    with ga.capture(m, reduction="sum") as cap:
        with torch.no_grad():
            m(x)
        m(x).sum().backward()
        m(x).sum().backward()
    assert cap.grads.n == 10
