"""Every refusal of K-FAC / EK-FAC names a fix; each test applies the fix as written and
checks that it then runs (the memory refusal's ``kron_diagonal_width`` fix is in
``test_vocab_kron``, the float32 inverse's damping fix in ``test_wide_kron``)."""
import re

import pytest
import torch

import gradalg as ga
from gradalg.exec.local import LocalExecutor
from references import one_thread  # noqa: F401 - one intra-op thread per test module
from models import classification_data, mlp


@pytest.fixture(scope="module")
def grads():
    X, y = classification_data(n=24)
    task = ga.tasks.classification(mlp())
    return ga.grads(task, (X[:20], y[:20])), ga.grads(task, (X[20:], y[20:]))


def scores(Q, H, G):
    with ga.options(progress=False):
        return torch.as_tensor((Q @ H.damp(1e-2).inv() @ G.T).compute().values)


def test_kfac_of_rows_without_factors_names_the_hooks_backend_and_that_works(grads):
    G, Q = grads
    task, data = G.expr.source.task, G.expr.source.data
    with pytest.raises(ValueError, match=r"Use ga\.grads\(task, data, layers, backend='hooks'\)"):
        ga.kfac(ga.grads(task, data, backend="func"))      # flat rows, no factors
    fixed = ga.grads(task, data, None, backend="hooks")
    torch.testing.assert_close(scores(Q, ga.kfac(fixed), G), scores(Q, ga.kfac(G), G), rtol=0, atol=0)


def test_kfac_of_flat_projected_blocks_names_the_kronecker_projection_and_that_works(grads):
    G, Q = grads
    P = ga.proj.gaussian(k=8, seed=0)
    with pytest.raises(ValueError) as info:
        ga.kfac(P(G))
    fix = re.search(r"ga\.proj\.kron\(k=(\d+)\)", str(info.value))
    assert fix, str(info.value)
    K = ga.proj.kron(k=int(fix.group(1)), seed=0)
    assert torch.isfinite(scores(K(Q), ga.kfac(K(G)), K(G))).all()


def test_lambda_max_examples_on_kfac_names_ekfac_and_that_works(grads):
    G, Q = grads
    with pytest.raises(ValueError, match=r"use it with ga\.ekfac"):
        ga.kfac(G, lambda_max_examples=5)
    assert torch.isfinite(scores(Q, ga.ekfac(G, lambda_max_examples=5), G)).all()


def test_factorwise_damping_of_ekfac_names_damp_and_that_works(grads):
    G, _ = grads
    with ga.options(progress=False):
        op = LocalExecutor().operator(ga.ekfac(G).expr)
    with pytest.raises(ga.GradalgError, match=r"use damp\(λ\)"):
        op.damp_factorwise(1e-2)
    assert torch.isfinite(op.damp(1e-2).inverse().dense()).all()


def test_failed_float32_eigendecomposition_names_float64_width_and_that_works(grads):
    """kron_float32_rtol far below float32's accuracy makes the checked float32 eigh refuse;
    the kron_float64_width it names computes the factor in float64 instead."""
    G, Q = grads
    with ga.options(kron_float64_width=8, kron_float32_rtol=1e-12):
        with pytest.raises(ga.CurvatureError) as info:
            scores(Q, ga.kfac(G), G)
    fix = re.search(r"ga\.options\(kron_float64_width=(\d+)\)", str(info.value))
    assert fix, str(info.value)
    with ga.options(kron_float64_width=int(fix.group(1)), kron_float32_rtol=1e-12):
        out = scores(Q, ga.kfac(G), G)
    torch.testing.assert_close(out, scores(Q, ga.kfac(G), G), rtol=1e-12, atol=0)


def test_float32_inverse_refusal_names_float64_width_and_that_works(grads):
    """The inverse of float32 eigenvalues below their error is refused; the float64 width
    it names (the block's widest factor) makes the same inverse run, exactly as float64."""
    G, Q = grads
    tiny = 1e-14
    with ga.options(kron_float64_width=8):
        with pytest.raises(ga.CurvatureError) as info:
            with ga.options(progress=False):
                (Q @ ga.kfac(G).damp(tiny).inv() @ G.T).compute()
    fix = re.search(r"or float64 factors, ga\.options\(kron_float64_width=(\d+)\)", str(info.value))
    assert fix, str(info.value)
    with ga.options(kron_float64_width=int(fix.group(1)), progress=False):
        out = torch.as_tensor((Q @ ga.kfac(G).damp(tiny).inv() @ G.T).compute().values)
    assert torch.isfinite(out).all()
