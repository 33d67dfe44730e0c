"""Bad input ends in the right answer or a GradalgError naming the problem: a
hypothesis-driven search over options, data shapes, batching, losses and damping, plus
the cases found by hand (a mean loss seen on one example, shuffling or dropping loaders,
MultiheadAttention, two different models in one product, NaN inputs).

Every answer that is computed is checked against a loop of single-example backward
passes (float64).
"""
from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import gradalg as ga

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

HYPO = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)


def loop_rows(model, X, y, mean=False):
    """(n, dim) per-example gradients of every parameter, one backward per example."""
    rows = []
    for i in range(len(X)):
        model.zero_grad()
        loss = F.cross_entropy(model(X[i:i + 1]), y[i:i + 1], reduction="mean" if mean else "sum")
        grads = torch.autograd.grad(loss, list(model.parameters()))
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def setting():
    model = models.mlp()
    X, y = models.classification_data(n=12)
    return model, ga.tasks.classification(model), X, y


# ------------------------------------------------------------------ options
_BAD_OPTIONS = [("batch_size", True), ("batch_size", 0), ("batch_size", 2.0), ("batch_size", "8"),
                ("check_finite", "no"), ("check_reduction", 1), ("share_forward", None), ("progress", "yes"),
                ("ghost", None), ("ghost", "sometimes"), ("memory_budget", "lots"), ("memory_budget", -1),
                ("memory_budget", float("nan")), ("memory_budget", True), ("check_models", 0),
                ("fingerprint_cache", "true"), ("no_such_option", 1)]


@pytest.mark.parametrize("name,value", _BAD_OPTIONS)
def test_invalid_options_are_refused(name, value):
    before = ga.get_options()
    with pytest.raises(ga.OptionError, match=name):
        ga.options(**{name: value})
    assert ga.get_options() == before


@HYPO
@given(value=st.one_of(st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=4), st.none(),
                       st.booleans()))
def test_batch_size_is_a_positive_int_or_refused(value):
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if ok:
        with ga.options(batch_size=value):
            assert ga.get_options().batch_size == value
    else:
        with pytest.raises(ga.OptionError):
            ga.options(batch_size=value)


@HYPO
@given(damping=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2)))
def test_damping_is_finite_and_non_negative_or_refused(setting, damping):
    _, task, X, y = setting
    G = ga.grads(task, (X, y))
    if isinstance(damping, float) and np.isfinite(damping) and damping >= 0 or isinstance(damping, int) and damping >= 0:
        ga.fisher(G).damp(damping)
    else:
        with pytest.raises(ga.OptionError, match="damping"):
            ga.fisher(G).damp(damping)


# ------------------------------------------------------------------ data and batching
@HYPO
@given(n=st.integers(1, 7), batch_size=st.integers(1, 8), first=st.integers(1, 3))
def test_scores_match_the_loop_for_any_size_and_batching(setting, n, batch_size, first):
    """1-example data, batches of one, a last partial batch: always the loop's answer."""
    model, task, X, y = setting
    Q, G = (X[:first], y[:first]), (X[:n], y[:n])
    S = ga.grads(task, Q, batch_size=batch_size) @ ga.grads(task, G, batch_size=batch_size).T
    want = loop_rows(model, *Q) @ loop_rows(model, *G).T
    np.testing.assert_allclose(S.compute().values, want.numpy(), rtol=1e-10, atol=1e-12)


@HYPO
@given(n=st.integers(1, 6), batch_size=st.integers(1, 4))
def test_a_mean_loss_is_refused_even_on_one_example(setting, n, batch_size):
    model, _, X, y = setting
    mean_task = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    with pytest.raises(ga.LossReductionError):
        (ga.grads(mean_task, (X[:n], y[:n]), batch_size=batch_size) @ ga.grads(mean_task, (X, y)).T).compute()


def test_a_declared_mean_loss_on_one_example_is_rescaled(setting):
    model, _, X, y = setting
    mean_task = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), reduction="mean")
    S = ga.grads(mean_task, (X[:1], y[:1]), batch_size=1) @ ga.grads(mean_task, (X, y), batch_size=5).T
    want = loop_rows(model, X[:1], y[:1]) @ loop_rows(model, X, y).T
    np.testing.assert_allclose(S.compute().values, want.numpy(), rtol=1e-10)


def test_empty_data_and_bad_ids_are_refused(setting):
    _, task, X, y = setting
    with pytest.raises(ga.DataError, match="no examples"):
        ga.grads(task, (X[:0], y[:0]))
    with pytest.raises(ga.DataError, match="one id per example"):
        ga.grads(task, (X, y), ids=range(5))
    with pytest.raises(ga.DataError, match=r"repeated: \[3\]"):
        ga.grads(task, (X[:5], y[:5]), ids=[0, 1, 2, 3, 3])
    with pytest.raises(ga.DataError, match="numbers of examples"):
        ga.grads(task, (X, y[:4]))
    with pytest.raises(ga.OptionError, match="batch_size"):
        ga.grads(task, (X, y), batch_size=0)


class _Shuffled(BatchSampler):
    def __iter__(self):
        order = torch.randperm(len(self.sampler)).tolist()
        for a in range(0, len(order), self.batch_size):
            yield order[a:a + self.batch_size]


def test_loaders_that_reorder_or_drop_examples_are_refused(setting):
    _, task, X, y = setting
    ds = TensorDataset(X, y)
    with pytest.raises(ga.DataError, match="shuffle=False"):
        ga.grads(task, DataLoader(ds, batch_size=4, shuffle=True))
    with pytest.raises(ga.DataError, match="batch_sampler"):
        ga.grads(task, DataLoader(ds, batch_sampler=_Shuffled(SequentialSampler(ds), 4, False)))
    with pytest.raises(ga.DataError, match="drop_last"):
        ga.grads(task, DataLoader(ds, batch_size=5, drop_last=True))
    # drop_last that drops nothing, and an in-order custom batch sampler, are fine
    ga.grads(task, DataLoader(ds, batch_size=4, drop_last=True))
    ga.grads(task, DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 5, False)))


def test_a_loaders_collate_fn_is_kept_by_shards_and_stores(setting, tmp_path):
    """A collate_fn that scales the inputs: the store (written by shards) equals memory."""
    model, task, X, y = setting
    ds = TensorDataset(X, y)

    def collate(items):
        xs, ys = zip(*items)
        return torch.stack(xs) * 2.0, torch.stack(ys)

    loader = DataLoader(ds, batch_size=5, collate_fn=collate)
    P = ga.proj.gaussian(k=8, seed=0)
    G = P(ga.grads(task, loader))
    stored = ga.store.write(G, tmp_path / "g.zarr", chunk_rows=4)
    Q = P(ga.grads(task, (X[:2], y[:2])))
    want = (Q @ G.T).compute().values
    np.testing.assert_allclose((Q @ stored.T).compute().values, want, rtol=1e-10)
    direct = loop_rows(model, X[:2], y[:2]) @ loop_rows(model, X * 2.0, y).T
    np.testing.assert_allclose((ga.grads(task, (X[:2], y[:2])) @ ga.grads(task, loader).T).compute().values,
                               direct.numpy(), rtol=1e-10)


# ------------------------------------------------------------------ models and layers
def test_no_layers_and_multihead_attention(setting):
    _, task, X, y = setting
    with pytest.raises(ga.UnsupportedLayerError, match=r"layers=\[\]"):
        ga.grads(task, (X, y), layers=[])

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.att = nn.MultiheadAttention(8, 2, batch_first=True)
            self.out = nn.Linear(8, 3)

        def forward(self, x):
            h = self.inp(x).unsqueeze(1)
            h, _ = self.att(h, h, h)
            return self.out(h.squeeze(1))

    torch.manual_seed(0)
    m = Attn().double()
    t = ga.tasks.classification(m)
    G = ga.grads(t, (X, y))
    assert "att.out_proj" not in G.expr.layers
    got = (G @ G.T).compute().values
    names = [n for n, _ in m.named_parameters() if n.startswith(("inp.", "out."))]
    rows = []
    for i in range(len(X)):
        loss = F.cross_entropy(m(X[i:i + 1]), y[i:i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, [dict(m.named_parameters())[n] for n in names])
        rows.append(torch.cat([g.flatten() for g in grads]))
    R = torch.stack(rows)
    np.testing.assert_allclose(got, (R @ R.T).numpy(), rtol=1e-10)
    with pytest.raises(ga.UnsupportedLayerError, match="MultiheadAttention"):
        ga.grads(t, (X, y), layers=["att.out_proj"])


def test_two_different_models_in_one_product_are_refused(setting):
    model, task, X, y = setting
    other = ga.tasks.classification(models.mlp(seed=7))
    G, G2 = ga.grads(task, (X, y)), ga.grads(other, (X, y))
    with pytest.raises(ga.SpaceMismatchError, match="different models"):
        G @ G2.T
    with pytest.raises(ga.SpaceMismatchError, match="different models"):
        G @ ga.fisher(G2).damp(1e-3).inv() @ G.T
    with ga.options(check_models=False):
        G @ G2.T
    # a copy with the same weights is the same model
    import copy
    same = ga.tasks.classification(copy.deepcopy(model))
    G @ ga.grads(same, (X, y)).T


def test_nan_inputs_name_the_examples_for_every_objective(setting):
    _, task, X, y = setting
    Xn = X.clone()
    Xn[4, 1] = float("nan")
    for objective in ("loss", "expected", "sampled"):
        G = ga.grads(task, (Xn, y), objective=objective)
        with pytest.raises(ga.NonFiniteGradientError, match=r"ids \[4\]"):
            ga.fisher(G).to_dense()


def test_a_projection_that_does_not_reduce_warns(setting):
    _, task, X, y = setting
    G = ga.grads(task, (X, y))
    with pytest.warns(UserWarning, match="above the dimension"):
        ga.proj.gaussian(k=10_000)(G)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ga.proj.gaussian(k=8)(G)
