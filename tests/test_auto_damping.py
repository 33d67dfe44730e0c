"""Automatic damping (``damping="auto"`` / ``ga.linalg.DampingRule``): each rule's λ on
spectra with a known answer, λ_b per block against a dense reference of the damped
inverse, the provenance in the plan, and the overrides (absolute, relative, a rule)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.errors import OptionError
from gradalg.linalg.autodamp import DampingRule, block_lambdas, rule_lambda
from gradalg.methods.influence import AUTO_DAMPING

from models import classification_data, mlp
from references import one_thread, reference_rows  # noqa: F401 - one_thread is an autouse fixture

LAYERS = ["0", "2"]


@pytest.fixture()
def setting():
    X, y = classification_data(n=30, d_in=5, classes=3)
    model = mlp(d_in=5, hidden=4, classes=3, seed=0)
    return {"model": model, "task": ga.tasks.classification(model), "X": X, "y": y,
            "train": (X[:24], y[:24]), "query": (X[24:], y[24:])}


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10 * np.abs(want).max())


# ------------------------------------------------------------------ the rules' λ, by hand
def test_mass_rule_is_the_eigenvalue_where_the_top_ones_reach_q_of_the_mass():
    mu = torch.tensor([1.0, 8.0, 2.0, 4.0, 1.0])          # sorted: 8 4 2 1 1, total 16
    assert rule_lambda(DampingRule("mass", 0.5), mu) == 8.0     # 8 ≥ 8
    assert rule_lambda(DampingRule("mass", 0.75), mu) == 4.0    # 8 + 4 = 12 ≥ 12
    assert rule_lambda(DampingRule("mass", 0.8), mu) == 2.0     # 14 ≥ 12.8
    assert rule_lambda(DampingRule("mass", 1.0), mu) == 1.0
    assert rule_lambda(DampingRule("mass", 0.75), torch.tensor([8.0, 4.0, -1e-12, 0.0])) == 4.0   # negatives: 0


def test_effdim_rule_solves_the_effective_dimension():
    # flat spectrum μ = 1 (×4): participation ratio 4, d_eff(λ) = 4/(1 + λ) = 4f → λ = 1/f − 1
    assert math.isclose(rule_lambda(DampingRule("effdim", 0.5), torch.ones(4)), 1.0, rel_tol=1e-8)
    assert math.isclose(rule_lambda(DampingRule("effdim", 0.25), torch.ones(4)), 3.0, rel_tol=1e-8)
    assert rule_lambda(DampingRule("effdim", 1.0), torch.ones(4)) == 0.0        # target = #μ > 0
    mu = torch.tensor([100.0, 10.0, 1.0, 0.1, 0.0], dtype=torch.float64)
    lam = rule_lambda(DampingRule("effdim", 1.0), mu)
    target = float(mu.sum()) ** 2 / float((mu ** 2).sum())
    assert math.isclose(float((mu / (mu + lam)).sum()), target, rel_tol=1e-8)


def test_mean_rule_and_bad_rules():
    assert math.isclose(rule_lambda(DampingRule("mean", 0.5), torch.tensor([1.0, 3.0])), 1.0)
    for bad in (("knee", 0.5), ("mass", 1.5), ("mass", 0.0), ("effdim", -1.0), ("mean", float("nan"))):
        with pytest.raises(OptionError, match="DampingRule|damping rule"):
            DampingRule(*bad)


# ------------------------------------------------------- per block, against dense references
def _per_block_reference(H: torch.Tensor, offsets: dict, rule: DampingRule) -> torch.Tensor:
    """H + diag(λ_b I_b), λ_b from the eigenvalues of H's diagonal block b."""
    shift = torch.empty(H.shape[0], dtype=H.dtype)
    for s in offsets.values():
        shift[s] = rule_lambda(rule, torch.linalg.eigvalsh(H[s, s]))
    return H + torch.diag(shift)


@pytest.mark.parametrize("structure", ["dense", "block"])
def test_fisher_damped_per_block_matches_a_dense_reference(setting, structure):
    s = setting
    G, Q = reference_rows(s["task"], s["train"], LAYERS), reference_rows(s["task"], s["query"], LAYERS)
    Gl = ga.grads(s["task"], s["train"], LAYERS)
    offsets = Gl.space.offsets()
    Fm = G.T @ G / G.shape[0]
    if structure == "block":
        Fm = torch.block_diag(*(Fm[sl, sl] for sl in offsets.values()))
    rule = DampingRule("mass", 0.9)
    want = Q @ torch.linalg.solve(_per_block_reference(Fm, offsets, rule), G.T)
    H = ga.fisher(Gl, structure=structure).damp(rule)
    got = (ga.grads(s["task"], s["query"], LAYERS) @ H.inv() @ Gl.T).compute().values
    close(np.asarray(got), want.numpy())


def test_blocks_of_different_scale_get_their_own_lambda():
    """Two blocks 1e4 apart: per block each λ_b is on its block's scale; one pooled λ is not."""
    from gradalg.linalg import ResolvedOp
    from gradalg.space import Block, ParamSpace
    space = ParamSpace((Block("a", (3,), "param"), Block("b", (3,), "param")))
    op = ResolvedOp(space, "block", {"a": torch.diag(torch.tensor([4e4, 2e4, 1e4], dtype=torch.float64)),
                                     "b": torch.diag(torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64))})
    rule = DampingRule("mass", 0.5)
    assert block_lambdas(op, rule) == {"a": 4e4, "b": 4.0}
    pooled = block_lambdas(op, DampingRule("mass", 0.5, per_block=False))
    assert pooled["a"] == pooled["b"] == 4e4


def test_floor_bounds_each_lambda_by_a_multiple_of_the_pooled_mean():
    """λ_b = max(rule_b, c · tr(H)/dim): the small block is lifted to c × the pooled mean, the
    large one keeps its own; bad floors are refused."""
    from gradalg.linalg import ResolvedOp
    from gradalg.space import Block, ParamSpace
    space = ParamSpace((Block("a", (3,), "param"), Block("b", (3,), "param")))
    op = ResolvedOp(space, "block", {"a": torch.diag(torch.tensor([4e4, 2e4, 1e4], dtype=torch.float64)),
                                     "b": torch.diag(torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64))})
    mean = (7e4 + 7.0) / 6
    got = block_lambdas(op, DampingRule("mass", 0.5, floor=0.1))
    assert got["a"] == 4e4 and math.isclose(got["b"], 0.1 * mean, rel_tol=1e-12)
    assert block_lambdas(op, DampingRule("mass", 0.5, floor=0.0)) == {"a": 4e4, "b": 4.0}
    pooled = block_lambdas(op, DampingRule("mass", 0.5, per_block=False, floor=10.0))
    assert math.isclose(pooled["a"], 10 * mean, rel_tol=1e-12) and pooled["a"] == pooled["b"]
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(OptionError, match="floor"):
            DampingRule("mass", 0.5, floor=bad)
    assert "at least 0.1 × H's mean eigenvalue" in DampingRule("mass", 0.5, floor=0.1).describe()


def test_floored_rule_on_a_dense_gauss_newton_matches_a_dense_reference(setting):
    s = setting
    G, Q = reference_rows(s["task"], s["train"], LAYERS), reference_rows(s["task"], s["query"], LAYERS)
    Gl = ga.grads(s["task"], s["train"], LAYERS)
    offsets = Gl.space.offsets()
    Fm = G.T @ G / G.shape[0]
    rule = DampingRule("mass", 0.9, floor=1.0)
    shift = torch.empty(Fm.shape[0], dtype=Fm.dtype)
    for sl in offsets.values():
        shift[sl] = max(rule_lambda(rule, torch.linalg.eigvalsh(Fm[sl, sl])), float(torch.trace(Fm)) / Fm.shape[0])
    want = Q @ torch.linalg.solve(Fm + torch.diag(shift), G.T)
    got = (ga.grads(s["task"], s["query"], LAYERS) @ ga.fisher(Gl).damp(rule).inv() @ Gl.T).compute().values
    close(np.asarray(got), want.numpy())


def test_kronecker_damped_per_block_matches_a_dense_reference(setting):
    """K-FAC / EK-FAC: λ_b from block b's Λ; (F_kron + ⊕ λ_b I)⁻¹ against the dense matrix."""
    s = setting
    G, Q = reference_rows(s["task"], s["train"], LAYERS), reference_rows(s["task"], s["query"], LAYERS)
    C = ga.grads(s["task"], s["train"], LAYERS, objective="expected")
    offsets = C.space.offsets()
    for eigen_correction in (False, True):
        K = ga.kfac(C, eigen_correction=eigen_correction)
        Hd = K.to_dense()
        rule = AUTO_DAMPING["kronecker"]
        shift = torch.empty(Hd.shape[0], dtype=Hd.dtype)
        for sl in offsets.values():       # a Kronecker block's Λ are the eigenvalues of its diagonal block
            shift[sl] = rule_lambda(rule, torch.linalg.eigvalsh(Hd[sl, sl]))
        want = Q @ torch.linalg.solve(Hd + torch.diag(shift), G.T)
        S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS,
                                 curvature="ekfac" if eigen_correction else "kfac", damping="auto")
        close(np.asarray(S.compute().values), want.numpy())
        # the default of a Kronecker H (issue 31): the same λ_b per block, named or given as an Operator
        S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS,
                                 curvature="ekfac" if eigen_correction else "kfac")
        close(np.asarray(S.compute().values), want.numpy())
        S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature=K)
        close(np.asarray(S.compute().values), want.numpy())


def test_influence_auto_matches_a_dense_reference_and_adds_weight_decay(setting):
    s = setting
    G, Q = reference_rows(s["task"], s["train"], LAYERS), reference_rows(s["task"], s["query"], LAYERS)
    offsets = ga.grads(s["task"], s["train"], LAYERS).space.offsets()
    Fm = G.T @ G / G.shape[0]
    H = _per_block_reference(Fm, offsets, AUTO_DAMPING["dense"]) + 0.02 * torch.eye(Fm.shape[0], dtype=Fm.dtype)
    S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="empirical",
                             damping="auto", weight_decay=0.02)
    close(np.asarray(S.compute().values), (Q @ torch.linalg.solve(H, G.T)).numpy())


# ------------------------------------------------------------ provenance in the plan, overrides
def test_the_plan_shows_the_rule_and_where_it_came_from(setting):
    s = setting
    S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, damping="auto")
    text = str(S.explain(stage="simplified"))
    rule = AUTO_DAMPING["dense"]
    assert f"damp(auto: {rule.short()}) [damping='auto': {rule.describe()}, from H's own spectrum; " \
           "curvature='auto': " in text and "not near a minimum: the dense Gauss-Newton]" in text
    assert "damp.per_block_spectrum" in text
    S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="ekfac",
                             damping=DampingRule("effdim", 2.0))
    assert "damp(auto: effdim=2) [damping=DampingRule (given): λ_b at effective dimension 2 × participation " \
           "ratio, per block, from H's own spectrum]" in repr(S)


def test_overrides_absolute_relative_and_rule(setting):
    s = setting
    call = lambda **kw: ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS,  # noqa: E731
                                             curvature="empirical", **kw)
    assert "damp(λ=0.01) [damping (given)" in repr(call(damping=0.01))
    assert "damp(λ=0.5·mean eig) [default: 0.5 × mean eigenvalue" in repr(call(relative_damping=0.5))
    a = np.asarray(call(damping=DampingRule("mass", 0.9)).compute().values)
    b = np.asarray(call(damping=DampingRule("mass", 0.5)).compute().values)
    assert not np.allclose(a, b)
    with pytest.raises(OptionError, match="damping='auto'"):
        call(damping="automatic")
    with pytest.raises(OptionError, match="absolute damping"):
        ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="hessian", solver="cg",
                             damping="auto")
    with pytest.raises(OptionError, match="DataInf"):
        ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="datainf",
                             damping="auto")


@pytest.mark.parametrize("method", ["trak", "grass", "logra", "relatif", "trackstar"])
def test_every_damping_method_takes_auto(setting, method):
    s = setting
    fn = getattr(ga.methods, method)
    task = [s["task"]] if method == "trak" else s["task"]
    kw = {"k": 16} if method in ("trak", "trackstar", "logra") else {"k": 4} if method == "grass" else {}
    if method == "trackstar":
        import torch.nn.functional as F
        opt = torch.optim.Adam(s["model"].parameters(), lr=1e-3)
        opt.zero_grad()
        F.cross_entropy(s["model"](s["X"]), s["y"]).backward()
        opt.step()
        kw["optimizer"] = opt
    S = fn(task, s["train"], s["query"], layers=LAYERS, damping="auto", **kw)
    assert "damp(auto: " in repr(S) and "damping='auto'" in repr(S)
    v = np.asarray(S.compute().values)
    assert v.shape == (6, 24) and np.isfinite(v).all()


def test_trak_and_grass_default_to_auto(setting):
    """Issue 31: TRAK's and GraSS's default damping is "auto" (chosen across the nine fidelity
    settings, docs/fidelity.md); the plan says it is the default; damping=None gives the
    previous default, relative_damping × the mean eigenvalue."""
    s = setting
    for method, extra in ((ga.methods.trak, dict(k=8)), (ga.methods.grass, dict(k=4))):
        call = lambda **kw: method(s["task"], s["train"], s["query"], layers=LAYERS, **extra, **kw)  # noqa: E731
        default = call()
        assert "[default: damping='auto', λ_b = the eigenvalue where the top ones hold 0.95" in repr(default)
        np.testing.assert_allclose(np.asarray(default.compute().values),
                                   np.asarray(call(damping="auto").compute().values), rtol=1e-12, atol=0)
        old = np.asarray(call(damping=None).compute().values)
        np.testing.assert_allclose(old, np.asarray(call(damping=None, relative_damping=(
            1.0 if method is ga.methods.trak else 0.1)).compute().values), rtol=1e-12, atol=0)
        assert not np.allclose(old, np.asarray(default.compute().values))


def test_relatif_defaults_to_auto_where_h_has_a_spectrum(setting):
    """Issue 31: RelatIF's default damping is "auto" per block for a Kronecker H, one λ from the
    pooled spectrum (mass 0.95) for a dense H (checked against a dense reference), the plan
    names the rule and where it came from; an iterative solver keeps the absolute 1e-3."""
    s = setting
    call = lambda **kw: ga.methods.relatif(s["task"], s["train"], s["query"], layers=LAYERS, **kw)  # noqa: E731
    default = call(curvature="ekfac")
    assert "damping='auto'" in repr(default)
    np.testing.assert_allclose(np.asarray(default.compute().values),
                               np.asarray(call(curvature="ekfac", damping="auto").compute().values),
                               rtol=1e-12, atol=0)
    for curvature in ("gauss_newton", "auto"):           # "auto" is the dense Gauss-Newton here
        default = call(curvature=curvature)
        assert "RelatIF's default for a dense H (issue 31)" in repr(default)
        assert "mass=0.95, global" in repr(default)
        pooled = DampingRule("mass", 0.95, per_block=False)
        np.testing.assert_allclose(np.asarray(default.compute().values),
                                   np.asarray(call(curvature=curvature, damping=pooled).compute().values),
                                   rtol=1e-12, atol=0)
    # against a dense reference: H = the empirical Fisher (dense), one λ from its full spectrum
    G, Q = reference_rows(s["task"], s["train"], LAYERS), reference_rows(s["task"], s["query"], LAYERS)
    H = G.T @ G / G.shape[0]
    A = H + rule_lambda(DampingRule("mass", 0.95), torch.linalg.eigvalsh(H)) * torch.eye(H.shape[0], dtype=H.dtype)
    X = torch.linalg.solve(A, G.T)
    want = (Q @ X) / torch.sqrt(torch.einsum("ij,ji->i", G, X))[None, :]
    close(np.asarray(call(curvature="empirical").compute().values), want.numpy())
    # damping="auto" given: influence's per-block rule on the dense H too
    assert "damping='auto'" in repr(call(curvature="gauss_newton", damping="auto"))
    cg = call(curvature="gauss_newton", solver="cg")
    np.testing.assert_allclose(np.asarray(cg.compute().values),
                               np.asarray(call(curvature="gauss_newton", solver="cg", damping=1e-3).compute().values),
                               rtol=1e-12, atol=0)


def test_trak_and_grass_relative_damping_given_is_used(setting):
    """relative_damping=c given with the default damping is the relative rule (not silently
    replaced by "auto"): the same scores as damping=None, relative_damping=c."""
    s = setting
    for method, extra in ((ga.methods.trak, dict(k=8)), (ga.methods.grass, dict(k=4))):
        call = lambda **kw: method(s["task"], s["train"], s["query"], layers=LAYERS, **extra, **kw)  # noqa: E731
        given = np.asarray(call(relative_damping=0.3).compute().values)
        np.testing.assert_allclose(given, np.asarray(call(damping=None, relative_damping=0.3).compute().values),
                                   rtol=1e-12, atol=0)
        assert not np.allclose(given, np.asarray(call().compute().values))
