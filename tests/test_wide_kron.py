"""Kronecker factors wider than ``ga.options(kron_float64_width)``: float32 sums with a Kahan
compensation, float32 eigendecompositions checked in float64, refused with the arithmetic
where the float32 eigenvalues cannot carry an inverse.

Measured on the MLP below (a 1025-wide activation factor, 3000 examples, damping 1e-3):
float32 vs float64 factors, relative Frobenius difference of the influence scores
K-FAC 3.2e-6, EK-FAC 4.0e-5. Tolerances: 1e-4 and 4e-4.
"""
import math
import re

import pytest
import torch
from torch import nn

import gradalg as ga
from gradalg.curvature.kron import FLOAT32_ROUNDOFF, KronStats, checked_eigh
from gradalg.capture.factors import Factors
from gradalg.plan import DecisionKind
from gradalg.units import format_bytes
from references import one_thread  # noqa: F401 - one intra-op thread per test module

D, N = 1024, 3000
FLOAT64 = 10**6        # kron_float64_width above every factor: the float64 path
FLOAT32 = 512          # the 1025-wide factor (1024 inputs and the bias) in float32


def mlp_case(decades: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    X = torch.randn(N + 8, D, generator=g) * torch.logspace(0, -decades, D).sqrt()
    y = torch.randint(0, 4, (N + 8,), generator=g)
    model = nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, 4))
    task = ga.tasks.classification(model)
    return ga.grads(task, (X[N:], y[N:])), ga.grads(task, (X[:N], y[:N]))


def influence(Q, G, fn, width, damping):
    with ga.options(kron_float64_width=width, progress=False, batch_size=500):
        return torch.as_tensor((Q @ fn(G).damp(damping).inv() @ G.T).compute().values)


@pytest.fixture(scope="module")
def well_conditioned():
    return mlp_case(decades=2)


@pytest.mark.parametrize("fn,tol", [(ga.kfac, 1e-4), (ga.ekfac, 4e-4)], ids=["kfac", "ekfac"])
def test_float32_factors_match_float64(well_conditioned, fn, tol, monkeypatch):
    Q, G = well_conditioned
    eighs = []
    real = torch.linalg.eigh

    def spy(M, *args, **kwargs):
        eighs.append((M.shape[0], M.dtype))
        return real(M, *args, **kwargs)
    monkeypatch.setattr(torch.linalg, "eigh", spy)
    ref = influence(Q, G, fn, FLOAT64, 1e-3)
    assert (1025, torch.float64) in eighs and (1025, torch.float32) not in eighs
    eighs.clear()
    out = influence(Q, G, fn, FLOAT32, 1e-3)
    assert (1025, torch.float32) in eighs and (17, torch.float64) in eighs   # only the wide factor
    rel = float((out - ref).norm() / ref.norm())
    assert rel < tol, rel


def test_plan_shows_the_precision_and_its_bytes(well_conditioned):
    Q, G = well_conditioned
    with ga.options(kron_float64_width=FLOAT32, progress=False):
        explained = (Q @ ga.kfac(G).damp(1e-3).inv() @ G.T).explain()
        text = str(explained)
    assert explained.plan.decisions.one(DecisionKind.KRON_PRECISION, block="0").chosen == "float32"
    assert "A (1025×1025) wider than ga.options(kron_float64_width=512)" in text
    assert f"Kahan compensation ({format_bytes(8 * 1025 ** 2)})" in text      # 8·1025² bytes: "8.4 MB"


def test_ill_conditioned_factor_is_refused_with_the_arithmetic():
    """A 10-decade activation spectrum and damping 1e-9: the float32 eigenvalues (accurate
    to δ ≈ 1e-6) cannot be inverted; the message gives δ, min |Λ|, their ratio and the
    damping that makes it accurate, and that damping works (float64 agrees to rtol)."""
    Q, G = mlp_case(decades=10, seed=1)
    with pytest.raises(ga.CurvatureError) as info:
        influence(Q, G, ga.kfac, FLOAT32, 1e-9)
    msg = str(info.value)
    delta = float(re.search(r"accurate to δ = ([0-9.e+-]+)", msg).group(1))
    smallest = float(re.search(r"smallest \|Λ\| \(after damping\) is ([0-9.e+-]+)", msg).group(1))
    ratio = float(re.search(r"\|p\|·δ/min\|Λ\| = ([0-9.e+-]+)", msg).group(1))
    need = float(re.search(r"damp by at least \|p\|·δ/rtol = ([0-9.e+-]+)", msg).group(1))
    assert math.isclose(ratio, delta / smallest, rel_tol=0.02) and ratio > 0.01
    assert math.isclose(need, delta / 0.01, rel_tol=0.02)
    assert "ga.options(kron_float64_width=1025)" in msg and "ga.proj.kron" in msg
    out = influence(Q, G, ga.kfac, FLOAT32, 2 * need)
    ref = influence(Q, G, ga.kfac, FLOAT64, 2 * need)
    assert float((out - ref).norm() / ref.norm()) < 0.01


def test_a_stored_float32_kfac_keeps_its_error_bound(tmp_path):
    """Written to an operator store and read back, float32 factors keep their eigenvalue
    error bound: the loaded operator refuses the inverse the original refuses, and gives
    the original's numbers where damping makes it accurate."""
    pytest.importorskip("zarr")
    Q, G = mlp_case(decades=10, seed=1)
    with ga.options(kron_float64_width=FLOAT32, progress=False, batch_size=500):
        stored = ga.store.write_operator(ga.kfac(G), tmp_path / "kfac.zarr")
    loaded = ga.store.open_operator(tmp_path / "kfac.zarr")
    with pytest.raises(ga.CurvatureError, match="accurate to δ"):
        with ga.options(progress=False):
            (Q @ loaded.damp(1e-9).inv() @ G.T).compute()
    with ga.options(kron_float64_width=FLOAT32, progress=False, batch_size=500):
        ref = torch.as_tensor((Q @ ga.kfac(G).damp(1e-2).inv() @ G.T).compute().values)
        out = torch.as_tensor((Q @ stored.damp(1e-2).inv() @ G.T).compute().values)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)


def test_checked_eigh_error_bounds_the_float32_eigenvalues():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3000, 600, generator=g, dtype=torch.float64) * torch.logspace(0, -3, 600, dtype=torch.float64)
    M = X.T @ X / 3000
    lam64 = torch.linalg.eigvalsh(M)
    Q, lam, check = checked_eigh(M.float(), rtol=1e-2)
    assert Q.dtype == torch.float32 and check.error > 0
    gap = float((lam.double() - lam64.clamp_min(0)).abs().max())
    assert gap <= check.error, (gap, check.describe())
    assert check.error < 1e-5 * float(lam64.max())              # and the bound is not vacuous
    assert check.orthogonality < 1e-5
    _, _, exact = checked_eigh(M, rtol=1e-2)
    assert exact.error == 0.0


def test_kahan_sums_of_many_chunks():
    """4000 chunk sums in float32: compensated, within a few u of float64 (plain float32
    sums drift by more than ten times as much)."""
    g = torch.Generator().manual_seed(0)
    comp, exact = KronStats(float64_width=0), KronStats(float64_width=None)
    plain = torch.zeros(8, 8)
    for _ in range(4000):
        A = torch.randn(1, 5, 8, generator=g) + 3.0
        F = Factors(A, torch.randn(1, 5, 8, generator=g))
        comp.update(F)
        exact.update(F)
        plain += (A.flatten(0, 1).T @ A.flatten(0, 1))
    assert comp.A.dtype == torch.float32 and exact.A.dtype == torch.float64
    ref = exact.sums()[0]
    err_comp = float(((comp.sums()[0].double() - ref).abs() / ref.abs()).max())
    err_plain = float(((plain.double() - ref).abs() / ref.abs()).max())
    assert err_comp < 4 * FLOAT32_ROUNDOFF and err_plain > 10 * err_comp, (err_comp, err_plain)


def test_llama_8b_meta_plan_shows_wide_factor_bytes_and_refuses_over_budget():
    """A Llama-3-8B-like config (4096 × 14336 MLP) on the meta device: the plan names the
    float32 precision of the 14336² factors with their bytes, and a budget below the
    statistics is refused with the arithmetic (explain(device=...) shows it as a warning)."""
    transformers = pytest.importorskip("transformers")
    import torch.nn.functional as F_
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)

    def loss(m, ids):
        logits = m(input_ids=ids).logits
        return F_.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")

    task = ga.Task(model, loss, name="llama-8b-like")
    ids = torch.zeros(1000, 512, dtype=torch.long)
    layers = ["model.layers.*.mlp.*"]
    G, Q = ga.grads(task, ids, layers), ga.grads(task, ids[:8], layers)
    S = Q @ ga.kfac(G).damp(1e-3).inv() @ G.T
    explained = S.explain(device="h200")
    text = str(explained)
    sum_gb, basis_gb = 8 * 14336 ** 2 / 1e9, 4 * 14336 ** 2 / 1e9
    d = explained.plan.decisions.one(DecisionKind.KRON_PRECISION, block="model.layers.0.mlp.gate_proj")
    assert d.chosen == "float32"
    assert f"S (14336×14336) wider than ga.options(kron_float64_width=8192)" in text
    assert f"Kahan compensation ({sum_gb:.3g} GB)" in text and f"basis {basis_gb:.3g} GB" in text
    with ga.options(memory_budget="8GB"):
        with pytest.raises(ga.MemoryBudgetError) as info:
            S.explain()
    msg = str(info.value)
    assert "Kronecker statistics of 6 block(s)" in msg and "(14336×14336, float32)" in msg
    warned = S.explain(device="h200", memory_budget="8GB")
    assert "Kronecker statistics of 6 block(s)" in str(warned)
