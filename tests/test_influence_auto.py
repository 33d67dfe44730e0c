"""``curvature="auto"``, the default of ``ga.methods.influence`` and ``relatif``: the dense
Gauss-Newton where a dense H fits (``ga.options(dense_curvature_dim)``), EK-FAC above; and the
dense Fisher's memory refusal, whose every suggested fix is applied here as written."""
from __future__ import annotations

import pytest
import torch

import gradalg as ga
from gradalg.testing import assert_close
from models import classification_data, mlp


@pytest.fixture
def setting():
    model = mlp()                                           # 8 → 16 → 3: 195 coordinates
    X, y = classification_data(n=24)
    task = ga.tasks.classification(model)
    return task, (X[:20], y[:20]), (X[20:], y[20:])


def _note(S) -> str:
    return str(S.explain(stage="simplified"))


def test_auto_is_the_dense_gauss_newton_where_it_fits_away_from_a_minimum(setting):
    """Up to ga.options(dense_curvature_dim) coordinates "auto" decides between the formed Hessian
    and the dense Gauss-Newton (issue 31, tests/test_influence_near_minimum.py): this MLP at its
    random initialisation is far from a minimum, so the dense Gauss-Newton, and the plan says so."""
    task, train, query = setting
    S = ga.methods.influence(task, train, query)
    ref = ga.methods.influence(task, train, query, curvature="gauss_newton").compute()
    assert_close(S.compute().values, ref.values, rtol=1e-10, atol=0)
    assert "curvature='auto': 195 coordinates ≤ ga.options(dense_curvature_dim=4096); not near a minimum: " \
           "the dense Gauss-Newton" in _note(S)
    assert S.explain().plan.decisions.one("curvature").chosen == "gauss_newton"


def test_auto_is_ekfac_above_the_threshold(setting):
    task, train, query = setting
    with ga.options(dense_curvature_dim=100):
        S = ga.methods.influence(task, train, query)
        scores = S.compute()
        note = _note(S)
    ref = ga.methods.influence(task, train, query, curvature="ekfac").compute()
    assert_close(scores.values, ref.values, rtol=1e-10, atol=0)
    assert "curvature='auto': EK-FAC, 195 coordinates > ga.options(dense_curvature_dim=100)" in note
    # and RelatIF follows the same rule
    with ga.options(dense_curvature_dim=100):
        rel = ga.methods.relatif(task, train, query).compute()
    ref = ga.methods.relatif(task, train, query, curvature="ekfac").compute()
    assert_close(rel.values, ref.values, rtol=1e-10, atol=0)


def test_auto_counts_projected_coordinates(setting):
    task, train, query = setting
    P = ga.proj.gaussian(k=12, seed=0)
    with ga.options(dense_curvature_dim=100):     # 195 parameters, 12 projected coordinates: dense
        S = ga.methods.influence(task, train, query, projector=P)
        assert "dense Gauss-Newton, 12 coordinates" in _note(S)
        scores = S.compute()
    ref = ga.methods.influence(task, train, query, projector=P, curvature="gauss_newton").compute()
    assert_close(scores.values, ref.values, rtol=1e-10, atol=0)


def test_auto_with_an_iterative_solver_uses_products(setting):
    task, train, query = setting
    with ga.options(dense_curvature_dim=10):
        S = ga.methods.influence(task, train, query, solver="cg", damping=0.1)
        assert "curvature='auto': Gauss-Newton products (cg)" in _note(S)
        scores = S.compute()
    ref = ga.methods.influence(task, train, query, curvature="gauss_newton", solver="cg", damping=0.1).compute()
    assert_close(scores.values, ref.values, rtol=1e-10, atol=0)


def test_bad_threshold_is_refused():
    with pytest.raises(ga.errors.OptionError, match="dense_curvature_dim"):
        ga.options(dense_curvature_dim=0).__enter__()


def test_dense_fisher_refusal_names_fixes_that_work(setting):
    import re
    task, train, query = setting
    budget = 8 * 195 ** 2 - 1                           # the dense Fisher is one byte too many
    with ga.options(memory_budget=budget):
        with pytest.raises(ga.errors.MemoryBudgetError) as err:
            ga.methods.influence(task, train, query, curvature="gauss_newton").compute()
        message = str(err.value)
        assert "curvature='ekfac'" in message and "structure='diag'" in message
        k = re.search(r"projector=ga.proj.kron\(k=(\d+)\)", message)
        larger = re.search(r"a larger memory budget.*would fit under ga.options\(memory_budget='([^']+)'\)", message)
        assert k and larger, message                    # this machine has the memory
        # each fix, applied as written, plans and runs under the same budget (the matrix and
        # its damped inverse: a structure or k whose inverse would not fit is not named)
        fixes = [{"curvature": "ekfac"}, {"structure": "diag", "curvature": "gauss_newton"},
                 {"projector": ga.proj.kron(k=int(k.group(1)), seed=0), "curvature": "gauss_newton"}]
        if "structure='block'" in message:
            fixes.append({"structure": "block", "curvature": "gauss_newton"})
        for fix in fixes:
            scores = ga.methods.influence(task, train, query, **fix).compute()
            assert bool(torch.isfinite(torch.as_tensor(scores.values)).all())
    with ga.options(memory_budget=larger.group(1)):
        ga.methods.influence(task, train, query, curvature="gauss_newton").compute()


def test_auto_on_a_dataset_and_a_tied_lm_matches_the_named_curvature():
    """Inputs other than tensors: a tied GPT-2 (layers="all": the tied embedding/head one
    block) fed as a list of dicts; above the threshold 'auto' is exactly EK-FAC's numbers."""
    from models import gpt2, padded_token_data
    model = gpt2(tied=True)
    task = ga.tasks.causal_lm(model)
    ids, mask = padded_token_data(n=6)
    data = [{"input_ids": i[m.bool()]} for i, m in zip(ids, mask)]      # variable-length dicts
    train, query = data[:4], data[4:]
    with ga.options(dense_curvature_dim=100):
        auto = ga.methods.influence(task, train, query, layers="all")
        assert "curvature='auto': EK-FAC" in _note(auto)
        got = auto.compute()
    ref = ga.methods.influence(task, train, query, layers="all", curvature="ekfac").compute()
    assert_close(got.values, ref.values, rtol=1e-10, atol=0)
    assert bool(torch.isfinite(torch.as_tensor(got.values)).all())
