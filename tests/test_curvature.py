"""Curvature operators against their dense references, iterative solvers against the
explicit inverse, and the limits where methods coincide."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, hessian

import gradalg as ga
from gradalg.linalg.solvers import arnoldi, conjugate_gradient, lissa
from models import classification_data, mlp


@pytest.fixture(scope="module")
def setting():
    model = mlp()
    X, y = classification_data(n=40)
    task = ga.tasks.classification(model)
    return task, (X, y)


def _flat(G: ga.GradientSet) -> torch.Tensor:
    return torch.cat([v.flatten(1) for v in G.to_dense().values()], 1)


def _coords(task, layers):
    from gradalg.curvature.hvp import ParamCoords
    return ParamCoords(task.model, layers)


def test_hessian_products_equal_torch_func_hessian(setting):
    task, (X, y) = setting
    H = ga.hessian(task, (X, y)).to_dense()
    model = task.model
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]

    def f(flat):
        params, i = {}, 0
        for n, s in zip(names, shapes):
            params[n] = flat[i:i + s.numel()].reshape(s)
            i += s.numel()
        return F.cross_entropy(functional_call(model, params, (X,)), y, reduction="sum") / len(X)

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = hessian(f)(flat)
    coords = _coords(task, ["0", "2"])
    eye = torch.eye(H.shape[0], dtype=H.dtype)
    to_param = torch.cat([coords.to_params(eye)[n].flatten(1) for n in names], 1)   # (canon, param)
    torch.testing.assert_close(to_param.T @ H @ to_param, reference, rtol=1e-10, atol=1e-12)


def test_exact_gauss_newton_three_ways_agree(setting):
    task, data = setting
    products = ga.gauss_newton(task, data).to_dense()
    expected_terms = ga.fisher(ga.grads(task, data, objective="expected", batch_size=16)).to_dense()
    torch.testing.assert_close(expected_terms, products, rtol=1e-10, atol=1e-13)
    sampled = ga.fisher(ga.grads(task, data, objective="sampled")).to_dense()
    # one label per example: unbiased but noisy; it is not the empirical Fisher
    empirical = ga.fisher(ga.grads(task, data)).to_dense()
    assert (sampled - products).norm() < (empirical - products).norm() * 1.5


@pytest.mark.parametrize("method,settings", [("cg", {}), ("lissa", {"depth": 4000})])
def test_iterative_inverses_converge_to_the_explicit_inverse(setting, method, settings):
    task, (X, y) = setting
    Q, G = ga.grads(task, (X[:4], y[:4])), ga.grads(task, (X, y))
    H = ga.gauss_newton(task, (X, y))
    dense = H.to_dense()
    lam = 0.1
    if method == "lissa":
        settings = dict(settings, scale=float(torch.linalg.eigvalsh(dense).max()) * 1.2 + 0.2)
    S = (Q @ H.damp(lam).inv(method=method, **settings) @ G.T).compute().values
    ref = _flat(Q) @ torch.linalg.solve(dense + lam * torch.eye(len(dense), dtype=dense.dtype), _flat(G).T)
    np.testing.assert_allclose(S, ref.numpy(), rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


def test_arnoldi_recovers_the_top_eigenpairs(setting):
    task, data = setting
    H = ga.gauss_newton(task, data)
    dense = H.to_dense()
    approx = ga.arnoldi(H, rank=dense.shape[0] // 2).to_dense()
    top = torch.linalg.eigvalsh(dense).flip(0)[:10]
    torch.testing.assert_close(torch.linalg.eigvalsh(approx).flip(0)[:10], top, rtol=1e-8, atol=1e-12)
    # on the kept eigenspace the damped inverse acts as 1/(μ + λ) (Schioppa et al.)
    values, vectors = torch.linalg.eigh(dense)
    inv = ga.arnoldi(H, rank=10).damp(0.1).inv().to_dense()
    for i in range(1, 6):
        v = vectors[:, -i]
        torch.testing.assert_close(inv @ v, v / (values[-i] + 0.1), rtol=1e-6, atol=1e-8)


def test_solvers_on_a_known_matrix():
    g = torch.Generator().manual_seed(0)
    M = torch.randn(30, 30, generator=g, dtype=torch.float64)
    H = M @ M.T / 30
    X = torch.randn(4, 30, generator=g, dtype=torch.float64)
    ref = torch.linalg.solve(H + 0.1 * torch.eye(30, dtype=H.dtype), X.T).T
    torch.testing.assert_close(conjugate_gradient(lambda V: V @ H, X, 0.1), ref, rtol=1e-7, atol=1e-9)
    scale = float(torch.linalg.eigvalsh(H).max()) * 1.5 + 1
    torch.testing.assert_close(lissa(lambda V: V @ H, X, 0.1, scale=scale, depth=20000, tol=1e-14), ref,
                               rtol=1e-7, atol=1e-9)
    values, vectors = arnoldi(lambda V: V @ H, 30, 5)
    torch.testing.assert_close(values, torch.linalg.eigvalsh(H).flip(0)[:5], rtol=1e-9, atol=1e-12)
    with pytest.raises(ga.GradalgError, match="damping"):
        conjugate_gradient(lambda V: -(V @ H), X)


def test_kfac_is_the_kronecker_of_the_factor_covariances(setting):
    task, data = setting
    C = ga.grads(task, data, objective="expected", batch_size=16)
    K = ga.kfac(C).to_dense()
    chunk = ga.LocalExecutor().gradients(C.expr)
    n = data[0].shape[0]
    blocks = []
    for name in C.layers:
        F_ = chunk.blocks[name]                       # one row per (example, class term)
        A = F_.A.flatten(0, 1)
        D = F_.D.flatten(0, 1)
        a_cov = A.T @ A / (A != 0).any(1).sum()
        s_cov = D.T @ D / n
        blocks.append(torch.kron(s_cov, a_cov))
    torch.testing.assert_close(K, torch.block_diag(*blocks), rtol=1e-9, atol=1e-12)


def test_ekfac_is_kfac_with_eigenvalues_refit_to_the_exact_diagonal(setting):
    task, data = setting
    C = ga.grads(task, data, objective="expected", batch_size=16)
    ex = ga.LocalExecutor()
    kfac = ex.operator(ga.kfac(C).expr)
    ekfac = ga.LocalExecutor().operator(ga.ekfac(C).expr)
    block_fisher = ga.fisher(C, structure="block").to_dense()
    start = 0
    for name in C.layers:
        Q_S, Q_A = kfac.bases[name]
        torch.testing.assert_close(ekfac.bases[name][0], Q_S)   # same eigenbasis
        K = torch.kron(Q_S, Q_A)
        d = K.shape[0]
        F_block = block_fisher[start:start + d, start:start + d]
        start += d
        exact_diag = torch.diagonal(K.T @ F_block @ K).reshape(ekfac.eigenvalues[name].shape)
        torch.testing.assert_close(ekfac.eigenvalues[name], exact_diag, rtol=1e-9, atol=1e-12)
    # EK-FAC is closer to the Fisher than K-FAC (Frobenius), as George et al. prove
    kd, ed = kfac.dense(), ekfac.dense()
    assert (ed - block_fisher).norm() <= (kd - block_fisher).norm() + 1e-12


def test_kfac_damped_inverse_in_the_eigenbasis(setting):
    task, data = setting
    C = ga.grads(task, data, objective="expected", batch_size=16)
    K = ga.kfac(C)
    dense = K.to_dense()
    inv = K.damp(0.05).inv().to_dense()
    torch.testing.assert_close(inv, torch.linalg.inv(dense + 0.05 * torch.eye(len(dense), dtype=dense.dtype)),
                               rtol=1e-8, atol=1e-10)


def test_datainf_is_the_average_of_sherman_morrison_inverses(setting):
    task, data = setting
    G = ga.grads(task, data)
    lam = 0.3
    D = ga.datainf(G, lam).to_dense()
    g = _flat(G)
    blocks, start = [], 0
    for b in G.space.blocks:
        gb = g[:, start:start + b.dim]
        start += b.dim
        eye = torch.eye(b.dim, dtype=g.dtype)
        terms = [eye - torch.outer(x, x) / (lam + x @ x) for x in gb]
        blocks.append(torch.stack(terms).mean(0) / lam)
    torch.testing.assert_close(D, torch.block_diag(*blocks), rtol=1e-9, atol=1e-12)


def test_trak_with_an_invertible_projection_equals_the_influence_function_where_they_coincide():
    """Binary softmax regression at p = 1/2 (zero weights): TRAK's kernel ΦᵀΦ is 4·n·GN and
    the loss gradient is −½∇f, so TRAK = IF / (2n) exactly when the projection is square."""
    torch.manual_seed(0)
    model = nn.Linear(5, 2, dtype=torch.float64)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    X = torch.randn(40, 5, dtype=torch.float64)
    y = torch.randint(0, 2, (40,))
    task = ga.tasks.classification(model)
    dim = 2 * 6
    # the logit-sum direction is a null space of both kernels: a tiny damping is the pseudo-inverse
    trak = ga.methods.trak(task, (X, y), (X[:6], y[:6]), k=dim, damping=1e-10).compute().values
    # the Gauss-Newton of 2-class cross-entropy is singular along the logit-sum direction
    # (shifting both logits changes nothing); restrict IF to its range with a pseudo-inverse
    G, Q = ga.grads(task, (X, y)), ga.grads(task, (X[:6], y[:6]))
    GN = ga.fisher(ga.grads(task, (X, y), objective="expected")).to_dense()
    infl = _flat(Q) @ torch.linalg.pinv(GN, hermitian=True, rtol=1e-10) @ _flat(G).T
    ref = infl.numpy() / (2 * 40)
    np.testing.assert_allclose(trak, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("T", [2, 40])
def test_kron_operator_applied_block_by_block_to_factors_equals_the_dense_matrix(T):
    """``KronOp.apply_blocks`` (the held side of EK-FAC scores) on factored rows: rotated in
    from the factors when T is short, materialized first when it is long."""
    from gradalg.capture.factors import Factors
    from gradalg.linalg import KronOp
    from gradalg.space import Block, ParamSpace
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (5, 3), "b": (4, 6)}
    space = ParamSpace(tuple(Block(n, s, "linear") for n, s in shapes.items()))
    orth = lambda k: torch.linalg.qr(torch.randn(k, k, generator=g, dtype=torch.float64))[0]  # noqa: E731
    op = KronOp(space, {n: (orth(o), orth(i)) for n, (o, i) in shapes.items()},
                {n: torch.rand(o, i, generator=g, dtype=torch.float64) + 0.1 for n, (o, i) in shapes.items()})
    blocks = {n: Factors(torch.randn(3, T, i, generator=g, dtype=torch.float64),
                         torch.randn(3, T, o, generator=g, dtype=torch.float64)) for n, (o, i) in shapes.items()}
    got = op.apply_blocks(blocks)
    for n in shapes:
        G = torch.einsum("nto,nti->noi", blocks[n].D, blocks[n].A).flatten(1)
        torch.testing.assert_close(got[n], G @ op.block_matrix(n), rtol=1e-12, atol=1e-12)
    flat = {n: torch.einsum("nto,nti->noi", blocks[n].D, blocks[n].A).flatten(1) for n in shapes}
    for n, v in op.apply_blocks(flat).items():
        torch.testing.assert_close(v, got[n], rtol=1e-12, atol=1e-12)


def test_preconditioning_held_rows_that_are_consumed_drops_each_raw_block_with_the_same_numbers():
    """``precondition(consume=True)`` (the scores job's held rows, no other reader): each raw
    block leaves the held chunk once preconditioned (the two copies were both resident:
    344 + 471 MB for EK-FAC queries on GPT-2), and the preconditioned rows are those of
    the non-consuming path, which leaves its input whole."""
    from gradalg.capture.chunks import Chunk
    from gradalg.capture.factors import Factors
    from gradalg.linalg import KronOp
    from gradalg.exec.resolve import precondition
    from gradalg.space import Block, ParamSpace
    g = torch.Generator().manual_seed(1)
    shapes = {"a": (5, 3), "b": (4, 6), "c": (2, 2)}
    space = ParamSpace(tuple(Block(n, s, "linear") for n, s in shapes.items()))
    orth = lambda k: torch.linalg.qr(torch.randn(k, k, generator=g, dtype=torch.float64))[0]  # noqa: E731
    op = KronOp(space, {n: (orth(o), orth(i)) for n, (o, i) in shapes.items()},
                {n: torch.rand(o, i, generator=g, dtype=torch.float64) + 0.1 for n, (o, i) in shapes.items()})
    blocks = {"a": Factors(torch.randn(3, 2, 3, generator=g), torch.randn(3, 2, 5, generator=g)),
              "b": torch.randn(3, 24, generator=g), "c": torch.randn(3, 4, generator=g)}
    kept = precondition(op, Chunk((0, 1, 2), dict(blocks)), space)
    held = Chunk((0, 1, 2), dict(blocks))
    got = precondition(op, held, space, consume=True)
    assert held.blocks == {} and list(got.blocks) == list(shapes) and got.ids == (0, 1, 2)
    for n, (o, i) in shapes.items():
        v = blocks[n]
        G = torch.einsum("nto,nti->noi", v.D, v.A).flatten(1) if isinstance(v, Factors) else v
        want = (G.double() @ op.block_matrix(n)).float()
        assert got.blocks[n].dtype == torch.float32
        torch.testing.assert_close(got.blocks[n], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kept.blocks[n], got.blocks[n], rtol=0, atol=0)


def test_projected_fisher_of_fewer_examples_than_dimensions_inverts_with_small_damping():
    """TRAK's ΦᵀΦ with n < k: the Fisher stays in its float64 accumulation, so a damping of
    1e-6 × its mean eigenvalue inverts it as float64 would (rounded to float32 it had
    eigenvalues of ±1e-7·‖F‖, and the inverse was refused or wrong)."""
    model = mlp(dtype=torch.float32)
    task = ga.tasks.classification(model)
    X, y = classification_data(n=12, dtype=torch.float32)
    G = ga.proj.gaussian(64, seed=0)(ga.grads(task, (X, y)))
    R = _flat(G).to(torch.float64)
    F_ref = R.T @ R / 12
    lam = 1e-6 * float(F_ref.diagonal().mean())
    got = ga.fisher(G).damp(lam).inv().to_dense()
    want = torch.linalg.inv(F_ref + lam * torch.eye(64, dtype=torch.float64))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
