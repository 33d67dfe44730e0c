"""``ga.methods.influence(curvature=<ga.Operator>)``: the operator carries its own knobs
(covariance_max_examples, structure, rank ...) and is damped and inverted by its labels. Each
form gives the same numbers as the named curvature it replaces, and the dense Fisher form
matches a dense reference (rows from loop-of-backward)."""
from __future__ import annotations

import pytest
import torch

import gradalg as ga
from gradalg.errors import OptionError
from gradalg.testing import assert_close
from models import classification_data, mlp
from references import reference_rows


@pytest.fixture
def setting():
    model = mlp()                                           # 8 → 16 → 3: 195 coordinates
    X, y = classification_data(n=24)
    task = ga.tasks.classification(model)
    return task, (X[:20], y[:20]), (X[20:], y[20:])


def _values(S):
    return torch.as_tensor(S.compute().values)


def _gn(task, data):
    return ga.grads(task, data, objective="expected")


def test_ekfac_operator_equals_the_named_curvature_with_its_knobs(setting):
    task, train, query = setting
    H = ga.ekfac(_gn(task, train), covariance_max_examples=12, lambda_max_examples=15)
    got = _values(ga.methods.influence(task, train, query, curvature=H))
    ref = _values(ga.methods.influence(task, train, query, curvature="ekfac", covariance_max_examples=12,
                                       lambda_max_examples=15))
    assert_close(got, ref, rtol=1e-10, atol=0)


@pytest.mark.parametrize("structure", ["dense", "block"])
def test_fisher_operator_equals_the_named_gauss_newton(setting, structure):
    task, train, query = setting
    got = _values(ga.methods.influence(task, train, query, curvature=ga.fisher(_gn(task, train), structure),
                                       damping=1e-2, weight_decay=0.01))
    ref = _values(ga.methods.influence(task, train, query, curvature="gauss_newton", structure=structure,
                                       damping=1e-2, weight_decay=0.01))
    assert_close(got, ref, rtol=1e-10, atol=0)


def test_empirical_fisher_operator_against_a_dense_reference(setting):
    task, train, query = setting
    lam = 1e-2
    layers = ["0", "2"]
    S = ga.methods.influence(task, train, query, layers=layers, damping=lam,
                             curvature=ga.fisher(ga.grads(task, train, layers)))
    G, Q = reference_rows(task, train, layers), reference_rows(task, query, layers)    # (n, dim) each
    F = G.T @ G / G.shape[0]
    want = Q @ torch.linalg.solve(F + lam * torch.eye(F.shape[0], dtype=F.dtype), G.T)
    assert_close(_values(S), want, rtol=1e-7, atol=1e-10)


def test_products_and_low_rank_operators_equal_the_named_solvers(setting):
    task, train, query = setting
    cg = {"max_iter": 200, "rtol": 1e-10}
    got = _values(ga.methods.influence(task, train, query, curvature=ga.gauss_newton(task, train), solver="cg",
                                       damping=0.1, solver_settings=cg))
    ref = _values(ga.methods.influence(task, train, query, curvature="gauss_newton", solver="cg", damping=0.1,
                                       solver_settings=cg))
    assert_close(got, ref, rtol=1e-10, atol=0)
    got = _values(ga.methods.influence(task, train, query, damping=0.1,
                                       curvature=ga.arnoldi(ga.hessian(task, train), 8, seed=1)))
    ref = _values(ga.methods.influence(task, train, query, curvature="hessian", solver="arnoldi", rank=8, seed=1,
                                       damping=0.1))
    assert_close(got, ref, rtol=1e-10, atol=0)


def test_relatif_takes_an_operator(setting):
    task, train, query = setting
    got = _values(ga.methods.relatif(task, train, query, curvature=ga.ekfac(_gn(task, train))))
    ref = _values(ga.methods.relatif(task, train, query, curvature="ekfac"))
    assert_close(got, ref, rtol=1e-10, atol=0)


def test_knobs_the_operator_carries_are_refused(setting):
    task, train, query = setting
    H = ga.ekfac(_gn(task, train))
    with pytest.raises(OptionError, match="covariance_max_examples= is a knob of a named curvature"):
        ga.methods.influence(task, train, query, curvature=H, covariance_max_examples=10)
    with pytest.raises(OptionError, match="curvature_data="):
        ga.methods.influence(task, train, query, curvature=H, curvature_data=train)
    with pytest.raises(OptionError, match="use solver='direct'"):
        ga.methods.influence(task, train, query, curvature=H, solver="cg")
    with pytest.raises(OptionError, match="unknown keyword 'ranks'"):
        ga.methods.influence(task, train, query, ranks=3)
    with pytest.raises(OptionError, match="already an inverse"):
        ga.methods.influence(task, train, query, curvature=ga.datainf(ga.grads(task, train), 1e-3), damping=0.1)


def test_the_named_curvatures_are_one_table():
    from gradalg.methods.influence import CURVATURE_TABLE, CURVATURES, RELATIVE_DAMPING
    assert CURVATURES == ("auto", *CURVATURE_TABLE, "near_minimum")     # near_minimum: one of two, decided when run
    for name, factor in RELATIVE_DAMPING.items():
        assert CURVATURE_TABLE[name].relative_damping == factor
