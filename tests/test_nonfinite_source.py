"""NaN/inf named where it starts (issue 29, item 4): a NaN weight, an inf bias or a NaN
BatchNorm statistic is named by parameter before any pass (never blamed on the
examples, never NaN scores); a NaN input or loss names its example ids; overflowing
curvature statistics name the layer. Every path: ``ga.grads`` (every objective and
backend, curvature), ``ga.capture``, training-time capture, MAGIC. Each fix the
messages give is applied and checked to give the reference numbers."""
from __future__ import annotations

import os
import pickle
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga
from gradalg.finite import check_model

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread  # noqa: F401,E402 - autouse fixture

F64 = torch.float64


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def bn_net():
    torch.manual_seed(0)
    m = BNNet().to(F64).eval()
    with torch.no_grad():
        m.bn.running_mean.normal_()
        m.bn.running_var.uniform_(0.5, 2.0)
    return m


def _poison(tensor, index, value):
    with torch.no_grad():
        tensor.view(-1)[index] = value


# (model builder, tensor to poison, value, the name the error must give)
CASES = {
    "nan weight": (models.mlp, lambda m: m[0].weight, float("nan"), "0.weight", "parameter"),
    "inf bias": (models.mlp, lambda m: m[2].bias, float("inf"), "2.bias", "parameter"),
    "-inf weight": (models.mlp, lambda m: m[2].weight, float("-inf"), "2.weight", "parameter"),
    "nan running mean": (bn_net, lambda m: m.bn.running_mean, float("nan"), "bn.running_mean", "buffer"),
    "inf running var": (bn_net, lambda m: m.bn.running_var, float("inf"), "bn.running_var", "buffer"),
}


def _reference_scores(model, X, y):
    """G Gᵀ from a loop of single-example backward passes (float64)."""
    rows = []
    for i in range(X.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(X[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    G = torch.stack(rows)
    return G @ G.T


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_weight_or_buffer_is_named_before_any_pass_and_the_fix_works(case):
    build, where, value, name, kind = CASES[case]
    model = build()
    X, y = models.classification_data(n=10)
    good = where(model).detach().clone()
    _poison(where(model), 1, value)
    task = ga.tasks.classification(model)
    G = ga.grads(task, (X, y), layers="all")
    for expr in (G @ G.T, G @ ga.fisher(G).damp(1e-3).inv() @ G.T, G @ ga.kfac(G).damp(1e-3).inv() @ G.T):
        with pytest.raises(ga.NonFiniteWeightError) as info:
            expr.compute()
        err = info.value
        assert (err.name, err.kind) == (name, kind) and err.example_ids == []
        assert repr(name) in str(err) and "whatever the examples" in str(err)
        assert isinstance(err, ga.NonFiniteGradientError)      # caught by the older except clauses
    for objective in ("expected", "sampled"):
        with pytest.raises(ga.NonFiniteWeightError, match=name):
            ga.fisher(ga.grads(task, (X, y), objective=objective)).to_dense()
    with pytest.raises(ga.NonFiniteWeightError, match=name):
        ga.grads(task, (X, y), backend="func").to_dense()
    with torch.no_grad():                                      # the fix: finite weights
        where(model).copy_(good)
    S = torch.from_numpy((G @ G.T).compute().values)
    torch.testing.assert_close(S, _reference_scores(model, X, y), rtol=1e-9, atol=1e-12)


def test_the_error_pickles_and_check_finite_false_turns_the_check_off():
    model = models.mlp()
    _poison(model[0].weight, 0, float("nan"))
    with pytest.raises(ga.NonFiniteWeightError) as info:
        check_model(model)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is ga.NonFiniteWeightError and str(copy) == str(info.value)
    for err in (ga.NonFiniteGradientError([3, 5], ["fc"]), ga.NonFiniteGradientError([1], [], "NaN in x", "Fix x")):
        copy = pickle.loads(pickle.dumps(err))         # raised on a Dask worker, re-raised here
        assert str(copy) == str(err) and copy.example_ids == err.example_ids
    X, y = models.classification_data(n=4)
    G = ga.grads(ga.tasks.classification(model), (X, y))
    with ga.options(check_finite=False):
        assert torch.isnan(torch.from_numpy((G @ G.T).compute().values)).all()   # asked for: no check


class MaskedHead(nn.Module):
    """Logits plus a registered additive mask buffer holding -inf (a class never predicted)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.register_buffer("mask", torch.tensor([0.0, 0.0, float("-inf")]))

    def forward(self, x):
        return self.fc(x) + self.mask


def test_an_inf_mask_buffer_is_valid_and_gives_the_reference_scores():
    torch.manual_seed(0)
    model = MaskedHead().to(F64)
    X, y = models.classification_data(n=8)
    y = y % 2                                          # labels the mask allows
    G = ga.grads(ga.tasks.classification(model), (X, y))
    S = torch.from_numpy((G @ G.T).compute().values)
    torch.testing.assert_close(S, _reference_scores(model, X, y), rtol=1e-9, atol=1e-12)


def test_a_gpt2_with_a_nan_layer_norm_weight_is_named():
    model = models.gpt2()
    _poison(model.transformer.ln_f.weight, 5, float("nan"))
    G = ga.grads(models.lm_task(model), models.padded_token_data(n=3))
    with pytest.raises(ga.NonFiniteWeightError, match=r"'transformer.ln_f.weight' of layer 'transformer.ln_f'"):
        (G @ G.T).compute()


def test_nan_inputs_still_name_their_examples_after_the_weight_check():
    model = models.mlp()
    X, y = models.classification_data(n=10)
    X = X.clone()
    X[[1, 6]] = float("inf")
    G = ga.grads(ga.tasks.classification(model), (X, y), ids=[f"ex{i}" for i in range(10)])
    with pytest.raises(ga.NonFiniteGradientError) as info:
        (G @ G.T).compute()
    assert type(info.value) is ga.NonFiniteGradientError and info.value.example_ids == ["ex1", "ex6"]
    assert "passed the weight check" in str(info.value)


# ---------------------------------------------------------------------------- ga.capture
def _loop(model, X, y, steps=2):
    for i in range(steps):
        model.zero_grad()
        sl = slice(i * len(X) // steps, (i + 1) * len(X) // steps)
        F.cross_entropy(model(X[sl]), y[sl], reduction="sum").backward()


@pytest.mark.parametrize("case", ["nan weight", "inf bias", "nan running mean"])
def test_ga_capture_names_a_bad_weight_on_entry_and_the_fix_works(case):
    build, where, value, name, _ = CASES[case]
    model = build()
    X, y = models.classification_data(n=8)
    good = where(model).detach().clone()
    _poison(where(model), 1, value)
    layers = ["fc1", "fc2"] if case == "nan running mean" else ["0", "2"]
    with pytest.raises(ga.NonFiniteWeightError, match=name):
        with ga.capture(model, layers, reduction="sum"):
            _loop(model, X, y)
    with torch.no_grad():
        where(model).copy_(good)
    with ga.capture(model, layers, reduction="sum") as cap:
        _loop(model, X, y)
    G = cap.grads
    assert torch.isfinite(torch.from_numpy((G @ G.T).compute().values)).all()


def test_ga_capture_names_the_examples_of_a_nan_input():
    model = models.mlp()
    X, y = models.classification_data(n=8)
    X = X.clone()
    X[6, 2] = float("nan")
    with pytest.raises(ga.NonFiniteGradientError) as info:
        with ga.capture(model, reduction="sum"):
            _loop(model, X, y)       # backward 1 holds examples 4..7
    assert type(info.value) is ga.NonFiniteGradientError
    assert info.value.example_ids == [6] and "backward 1" in str(info.value)


def test_ga_capture_names_the_weight_when_a_step_made_it_nan():
    model = models.mlp()
    X, y = models.classification_data(n=8)
    with pytest.raises(ga.NonFiniteWeightError, match="'0.weight'"):
        with ga.capture(model, reduction="sum"):
            _loop(model, X, y, steps=1)
            _poison(model[0].weight, 0, float("nan"))       # a diverged optimizer step
            _loop(model, X, y, steps=1)


def test_training_capture_refuses_a_nan_weight_before_training():
    model = models.mlp()
    _poison(model[2].bias, 0, float("inf"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tc = ga.integrations.training_capture(model, optimizer=opt)
    with pytest.raises(ga.NonFiniteWeightError, match="'2.bias'"):
        tc.__enter__()
    assert not tc.session.active


# ---------------------------------------------------------------------------- MAGIC
def _ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def _run(X, y, model=None, lr=0.1):
    torch.manual_seed(0)
    model = model if model is not None else nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    return ga.unroll.TrainingRun(model, _ce, (X, y), ga.unroll.SGD(lr), batch_size=4, epochs=1, seed=0)


def test_magic_names_a_nan_training_example_and_without_it_the_scores_are_finite():
    X, y = models.classification_data(n=8)
    Xn = X.clone()
    Xn[2, 1] = float("nan")
    Q = (X[:2], y[:2])
    with pytest.raises(ga.NonFiniteGradientError) as info:
        ga.methods.magic(_run(Xn, y), Q).compute()
    assert info.value.example_ids == [2] and "inputs of examples [2]" in str(info.value)
    keep = [i for i in range(8) if i != 2]                    # the fix: remove the example
    scores = ga.methods.magic(_run(Xn[keep], y[keep]), Q).compute().values
    assert torch.isfinite(torch.from_numpy(scores)).all()


def test_magic_names_a_nan_loss_of_finite_inputs():
    X, y = models.classification_data(n=8)
    index = torch.arange(8)

    def loss(model, batch):     # example 5's loss is a log of zero (NaN in the gradient)
        x, labels, i = batch
        scale = torch.where(i == 5, torch.full((len(i),), float("nan"), dtype=F64), torch.ones(len(i), dtype=F64))
        return F.cross_entropy(model(x), labels, reduction="none") * scale
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    run = ga.unroll.TrainingRun(model, loss, (X, y, index), ga.unroll.SGD(0.1), batch_size=4, epochs=1, seed=0)
    with pytest.raises(ga.NonFiniteGradientError, match="their inputs are finite") as info:
        ga.methods.magic(run, (X[:2], y[:2]), query_loss=lambda m, b: _ce(m, b)).compute()
    assert info.value.example_ids == [5]


def test_magic_names_a_nan_weight_a_nan_query_and_a_diverging_run():
    X, y = models.classification_data(n=8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    _poison(model[0].weight, 0, float("nan"))
    with pytest.raises(ga.NonFiniteWeightError, match="'0.weight'"):
        _run(X, y, model)
    Xq = X[:3].clone()
    Xq[1] = float("nan")
    with pytest.raises(ga.NonFiniteGradientError) as info:
        ga.methods.magic(_run(X, y), (Xq, y[:3])).compute()
    assert info.value.example_ids == [1] and "query" in str(info.value)
    def squared(model, batch):      # no saturation: a too large learning rate blows up
        return (model(batch[0]) - F.one_hot(batch[1], 3).to(F64)).square().sum(1)
    torch.manual_seed(0)
    run = ga.unroll.TrainingRun(nn.Linear(8, 3).to(F64), squared, (X, y), ga.unroll.SGD(10.0), batch_size=4,
                                epochs=100, seed=0)
    with pytest.raises(ga.NonFiniteGradientError, match="the training run diverges: at step") as info:
        ga.methods.magic(run, (X[:2], y[:2])).compute()
    assert info.value.example_ids == []


def test_an_inf_input_with_a_finite_loss_is_named_by_the_step_that_made_the_weights_nan():
    X, y = models.classification_data(n=8)
    Xn = X.clone()
    Xn[4, 0] = float("inf")             # tanh saturates: the loss is finite, the gradient is not
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    run = ga.unroll.TrainingRun(model, _ce, (Xn, y), ga.unroll.Adam(0.01), batch_size=4, epochs=2, seed=0)
    with pytest.raises(ga.NonFiniteGradientError, match="their inputs hold NaN/inf") as info:
        ga.methods.magic(run, (X[:2], y[:2])).compute()
    assert info.value.example_ids == [4]
    with pytest.raises(ga.NonFiniteGradientError, match="their inputs hold NaN/inf"):
        run.train()                                            # the retraining ground truth too


def test_source_names_the_training_example_behind_nan_checkpoints():
    X, y = models.classification_data(n=8)
    Xn = X.clone()
    Xn[5, 3] = float("nan")
    with pytest.raises(ga.NonFiniteGradientError) as info:
        ga.methods.source(_run(Xn, y), (X[:2], y[:2]), n_segments=1, checkpoints_per_segment=2).compute()
    assert info.value.example_ids == [5] and type(info.value) is ga.NonFiniteGradientError
    keep = [i for i in range(8) if i != 5]                    # the fix
    S = ga.methods.source(_run(Xn[keep], y[keep]), (X[:2], y[:2]), n_segments=1, checkpoints_per_segment=2)
    assert np.isfinite(S.compute().values).all()


# ---------------------------------------------------------------------------- curvature
@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
def test_overflowing_kronecker_factors_name_the_layer_and_float64_fixes_it(curvature):
    X, y = models.classification_data(n=8)
    big = X * 1e19                          # finite in float32, its squares are not
    model = models.mlp(dtype=torch.float32)
    G = ga.grads(ga.tasks.classification(model), (big.float(), y))
    H = getattr(ga, curvature)(G).damp(1e-3)
    with pytest.raises(ga.CurvatureError, match=r"activation factor of '0' holds NaN/inf"):
        (G @ H.inv() @ G.T).compute()
    G64 = ga.grads(ga.tasks.classification(model.double()), (big, y))       # the fix: float64
    S = (G64 @ getattr(ga, curvature)(G64).damp(1e-3).inv() @ G64.T).compute().values
    assert torch.isfinite(torch.from_numpy(S)).all()


@pytest.mark.parametrize("kind", ["hessian", "gauss_newton"])
def test_curvature_products_name_a_bad_weight_and_the_examples_of_a_nan_input(kind):
    X, y = models.classification_data(n=8)
    model = models.mlp()
    task = ga.tasks.classification(model)
    G = ga.grads(task, (X, y))
    _poison(model[2].weight, 0, float("nan"))
    H = getattr(ga, kind)(task, (X, y))
    with pytest.raises(ga.NonFiniteWeightError, match="'2.weight'"):
        (G @ H.damp(0.1).inv(method="cg") @ G.T).compute()
    with pytest.raises(ga.NonFiniteWeightError, match="'2.weight'"):     # not a failed eigensolver
        ga.arnoldi(H, 3).to_dense()
    model = models.mlp()
    task = ga.tasks.classification(model)
    Xn = X.clone()
    Xn[3, 0] = float("nan")
    with pytest.raises(ga.NonFiniteGradientError) as info:
        (ga.grads(task, (X, y)) @ getattr(ga, kind)(task, (Xn, y)).damp(0.1).inv(method="cg")
         @ ga.grads(task, (X, y)).T).compute()
    assert info.value.example_ids == [3]
