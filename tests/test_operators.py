"""The operator protocol (gradalg.linalg): every resolved operator against a dense float64
reference (torch.linalg), dispatch on structure labels by named rules, refusals, and the
rules the planner predicts without data equal to those resolution applies."""
import sys
from pathlib import Path

import pytest
import torch

import gradalg as ga
from gradalg.linalg import KronOp
from gradalg.linalg import DataInfOp
from gradalg.exec.local import LocalExecutor
from gradalg.expr import Block, ParamSpace
from gradalg.linalg import ImplicitOp, LinearOp, LowRankOp, ResolvedOp, SolvedOp
from gradalg.plan.resolution import resolution_rules
from gradalg.plan.rules import simplify_until_fixpoint

sys.path.insert(0, str(Path(__file__).parent))
from models import classification_data, mlp  # noqa: E402

F64 = torch.float64
SPACE = ParamSpace((Block("a", (3, 4), "linear", "params"), Block("b", (2, 3), "linear", "params")))
DIM = SPACE.dim   # 18


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _spd(d, g, shift=0.5):
    M = torch.randn(d, d, generator=g, dtype=F64)
    return M @ M.T / d + shift * torch.eye(d, dtype=F64)


def _orth(d, g):
    return torch.linalg.qr(torch.randn(d, d, generator=g, dtype=F64))[0]


def _sym_pow(M, p):
    values, vectors = torch.linalg.eigh(M)
    return (vectors * values ** p) @ vectors.T


def make(kind, seed=0) -> LinearOp:
    g = _gen(seed)
    if kind == "diag":
        return ResolvedOp(SPACE, "diag", torch.rand(DIM, generator=g, dtype=F64) + 0.5)
    if kind == "block":
        return ResolvedOp(SPACE, "block", {b.name: _spd(b.dim, g) for b in SPACE.blocks})
    if kind == "dense":
        return ResolvedOp(SPACE, "dense", _spd(DIM, g))
    if kind == "kron":
        return KronOp(SPACE, {b.name: (_orth(b.shape[0], g), _orth(b.shape[1], g)) for b in SPACE.blocks},
                      {b.name: torch.rand(*b.shape, generator=g, dtype=F64) + 0.5 for b in SPACE.blocks})
    if kind == "lowrank":
        V = torch.linalg.qr(torch.randn(DIM, 5, generator=g, dtype=F64))[0]
        return LowRankOp(SPACE, torch.rand(5, generator=g, dtype=F64) + 0.5, V)
    if kind == "implicit":
        M = _spd(DIM, g)
        return ImplicitOp(SPACE, lambda V, M=M: V @ M)
    raise KeyError(kind)


def _rows(n=4, seed=5):
    return torch.randn(n, DIM, generator=_gen(seed), dtype=F64)


EXPLICIT = ["diag", "block", "dense", "kron"]
ALL = EXPLICIT + ["lowrank", "implicit"]
TOL = dict(rtol=1e-9, atol=1e-10)
CG = dict(rtol=1e-13)


@pytest.mark.parametrize("kind", ALL)
def test_apply_and_dense_agree_with_the_matrix(kind):
    op = make(kind)
    M = op.dense()
    X = _rows()
    torch.testing.assert_close(op.apply(X), X @ M.T, **TOL)
    torch.testing.assert_close(M, M.T, **TOL)   # symmetric


@pytest.mark.parametrize("kind", EXPLICIT + ["implicit"])
def test_solve_inverse_power_damp_against_torch_linalg(kind):
    op = make(kind)
    M = op.dense()
    X = _rows()
    settings = CG if kind == "implicit" else {}
    torch.testing.assert_close(op.solve(X, **settings), torch.linalg.solve(M, X.T).T, **TOL)
    torch.testing.assert_close(op.inverse(**settings).dense(), torch.linalg.inv(M), **TOL)
    eye = torch.eye(DIM, dtype=F64)
    torch.testing.assert_close(op.damp(0.3).dense(), M + 0.3 * eye, **TOL)
    torch.testing.assert_close(op.damp(0.3).inverse(**settings).apply(X), torch.linalg.solve(M + 0.3 * eye, X.T).T,
                               **TOL)
    torch.testing.assert_close(op.scale(2.5).dense(), 2.5 * M, **TOL)
    if kind == "implicit":
        with pytest.raises(ga.OperatorError, match="an implicit.*operator.*ga.arnoldi"):
            op.power(-0.5)
    else:
        torch.testing.assert_close(op.power(-0.5).dense(), _sym_pow(M, -0.5), **TOL)
        torch.testing.assert_close(op.power(0.5).dense(), _sym_pow(M, 0.5), **TOL)
        torch.testing.assert_close(op.power(2).dense(), M @ M, **TOL)
    # relative damping: λ · tr(M)/dim
    if kind != "implicit":
        lam = 0.1 * float(M.diagonal().sum()) / DIM
        torch.testing.assert_close(op.damp(0.1, relative=True).dense(), M + lam * eye, **TOL)


def test_low_rank_algebra_stays_on_its_subspace():
    """Arnoldi's V diag(μ) Vᵀ: damping, inverse and powers act on μ only (Schioppa et al.):
    the pseudo-inverse and the projected damping, recorded under their names."""
    op = make("lowrank")
    M, V = op.dense(), op.vectors
    P = V @ V.T
    X = _rows()
    torch.testing.assert_close(op.inverse().dense(), torch.linalg.pinv(M, hermitian=True), **TOL)
    torch.testing.assert_close(op.solve(X), X @ torch.linalg.pinv(M, hermitian=True), **TOL)
    torch.testing.assert_close(op.power(-0.5).dense(), (V * op.eigenvalues ** -0.5) @ V.T, **TOL)
    torch.testing.assert_close(op.damp(0.3).dense(), M + 0.3 * P, **TOL)
    assert op.damp(0.3).inverse().rules == ("low-rank.damp_within_subspace", "low-rank.invert_within_subspace")


def test_solved_operator_is_the_inverse_and_refuses_damping():
    base = make("implicit")
    M = base.dense()
    inv = base.damp(0.2).inverse(method="cg", **CG)
    assert isinstance(inv, SolvedOp) and {"implicit", "inverse"} <= inv.structure
    X = _rows()
    M2 = M + 0.2 * torch.eye(DIM, dtype=F64)
    torch.testing.assert_close(inv.apply(X), torch.linalg.solve(M2, X.T).T, **TOL)
    torch.testing.assert_close(inv.solve(X), X @ M2, **TOL)           # its inverse is the products
    torch.testing.assert_close(inv.inverse().dense(), M2, **TOL)
    torch.testing.assert_close(inv.scale(3.0).apply(X), 3.0 * torch.linalg.solve(M2, X.T).T, **TOL)
    assert inv.inverse().rules == ("implicit.shift", "implicit.solve_by_cg", "implicit.inverse_of_solve")
    with pytest.raises(ga.OperatorError, match="damp the operator before inverting"):
        inv.damp(0.1)
    with pytest.raises(ga.OperatorError, match="relative damping"):
        base.damp(0.1, relative=True)


def test_lissa_variant_is_chosen_by_method():
    base = make("implicit")
    M = base.dense()
    scale = float(torch.linalg.eigvalsh(M).max()) * 1.5 + 1
    inv = base.damp(0.2).inverse(method="lissa", scale=scale, depth=20000, tol=1e-14)
    assert inv.rules[-1] == "implicit.solve_by_lissa"
    X = _rows()
    torch.testing.assert_close(inv.apply(X), torch.linalg.solve(M + 0.2 * torch.eye(DIM, dtype=F64), X.T).T,
                               rtol=1e-7, atol=1e-9)


def _rows_of(G):
    """A stream of fixed training rows, three at a time, as DataInfOp reads them."""
    def stream():
        for start in range(0, len(G), 3):
            rows = G[start:start + 3]
            yield {"a": rows[:, :12], "b": rows[:, 12:]}
    return stream


def test_datainf_against_its_closed_form_and_refusals():
    G = torch.randn(7, DIM, generator=_gen(3), dtype=F64)
    lam = 0.4
    op = DataInfOp(SPACE, _rows_of(G), lam)
    blocks = []
    for s in SPACE.offsets().values():
        g = G[:, s]
        d = g.shape[1]
        eye = torch.eye(d, dtype=F64)
        blocks.append(sum(eye - torch.outer(gi, gi) / (lam + gi @ gi) for gi in g) / (len(G) * lam))
    ref = torch.block_diag(*blocks)
    X = _rows()
    torch.testing.assert_close(op.apply(X), X @ ref, **TOL)
    torch.testing.assert_close(op.scale(2.0).apply(X), 2.0 * X @ ref, **TOL)
    assert {"implicit", "approximate-inverse"} <= op.structure
    for call in (op.inverse, lambda: op.damp(0.1), lambda: op.power(-0.5), lambda: op.solve(X)):
        with pytest.raises(ga.OperatorError, match="DataInf"):
            call()


# ---------------------------------------------------------------------- dispatch
def test_sums_dispatch_on_structure_labels():
    kron, eye = make("kron"), ResolvedOp.identity(SPACE, F64).scale(0.7)
    both = kron.add(eye)
    assert both.form == "kronecker" and both.rules[-1] == "kronecker.plus_identity"
    torch.testing.assert_close(both.dense(), kron.dense() + 0.7 * torch.eye(DIM, dtype=F64), **TOL)
    assert eye.add(kron).form == "kronecker"   # either order
    shared = kron.add(kron.scale(2.0))
    assert shared.form == "kronecker" and shared.rules[-1] == "kronecker.sum_in_shared_eigenbasis"
    torch.testing.assert_close(shared.dense(), 3 * kron.dense(), **TOL)
    other = make("kron", seed=1)
    mixed = kron.add(other)
    assert mixed.form == "block" and mixed.rules[-3:] == ("kronecker.expand_to_block", "kronecker.expand_to_block",
                                                          "block.sum")
    torch.testing.assert_close(mixed.dense(), kron.dense() + other.dense(), **TOL)
    diag, block, dense, low = make("diag"), make("block"), make("dense"), make("lowrank")
    for a, b, form, last in ((diag, diag, "diagonal", "diagonal.sum"), (diag, block, "block", "block.sum"),
                             (kron, diag, "block", "block.sum"), (block, dense, "dense", "dense.sum"),
                             (kron, low, "dense", "dense.sum"), (eye, eye, "diagonal", "identity.sum")):
        s = a.add(b)
        assert s.form == form and s.rules[-1] == last, (a.kind, b.kind, s.rules)
        torch.testing.assert_close(s.dense(), a.dense() + b.dense(), **TOL)
    assert "identity" in eye.add(eye).structure
    implicit = make("implicit")
    lazy = implicit.add(dense)
    assert lazy.form == "implicit" and lazy.rules == ("implicit.sum_of_products",)
    X = _rows()
    M = implicit.dense() + dense.dense()
    torch.testing.assert_close(lazy.inverse(**CG).apply(X), torch.linalg.solve(M, X.T).T, **TOL)
    shifted = implicit.add(eye)
    assert shifted.rules[-1] == "implicit.plus_identity"
    torch.testing.assert_close(shifted.dense(), implicit.dense() + 0.7 * torch.eye(DIM, dtype=F64), **TOL)


def test_kronecker_damping_is_exact_in_the_eigenbasis():
    """(S ⊗ A) + λI through the eigenvalues equals the dense sum, and differs from K-FAC's
    factor-wise damping (S + √λI) ⊗ (A + √λI), which the rule does not apply."""
    g = _gen(4)
    S, A = _spd(3, g), _spd(4, g)
    lam_S, Q_S = torch.linalg.eigh(S)
    lam_A, Q_A = torch.linalg.eigh(A)
    space = ParamSpace((Block("a", (3, 4), "linear", "params"),))
    op = KronOp(space, {"a": (Q_S, Q_A)}, {"a": torch.outer(lam_S, lam_A)})
    torch.testing.assert_close(op.dense(), torch.kron(S, A), **TOL)
    damped = op.damp(0.5)
    torch.testing.assert_close(damped.dense(), torch.kron(S, A) + 0.5 * torch.eye(12, dtype=F64), **TOL)
    factorwise = torch.kron(S + 0.5 ** 0.5 * torch.eye(3, dtype=F64), A + 0.5 ** 0.5 * torch.eye(4, dtype=F64))
    assert (damped.dense() - factorwise).abs().max() > 1e-3
    torch.testing.assert_close(damped.inverse().dense(), torch.linalg.inv(torch.kron(S, A) + 0.5 * torch.eye(12,
                               dtype=F64)), **TOL)
    assert damped.inverse().rules == ("kronecker.damp_in_eigenbasis", "kronecker.invert_eigenvalues")


# ---------------------------------------------------------------------- refusals
def test_refusals_name_the_structure_and_the_fix():
    singular = ResolvedOp(SPACE, "dense", torch.zeros(DIM, DIM, dtype=F64))
    with pytest.raises(ga.OperatorError, match="singular.*damp"):
        singular.inverse()
    indefinite = ResolvedOp(SPACE, "diag", torch.linspace(-1, 1, DIM, dtype=F64))
    with pytest.raises(ga.OperatorError, match="indefinite"):
        indefinite.power(0.5)
    torch.testing.assert_close(indefinite.power(2).dense(), torch.diag(torch.linspace(-1, 1, DIM, dtype=F64) ** 2))
    with pytest.raises(ga.OperatorError, match="implicit operator.*ga.arnoldi"):
        make("implicit").power(0.5)
    kron = make("kron")
    kron.eigenvalues["a"][0, 0] = 0.0
    with pytest.raises(ga.OperatorError, match="block 'a'"):
        kron.inverse()
    with pytest.raises(ValueError, match="non-negative"):
        make("dense").damp(-1.0)


# ---------------------------------------------------------------------- rules without data
@pytest.fixture(scope="module")
def task_data():
    model = mlp()
    return ga.tasks.classification(model), classification_data(n=24)


def _expressions(task, data):
    G = ga.grads(task, data)
    F = ga.fisher(G)
    I = ga.identity(G)
    K, E = ga.kfac(G), ga.ekfac(G)
    GN = ga.gauss_newton(task, data)
    return {
        "fisher dense inv": F.damp(1e-2).inv(),
        "fisher block relative": ga.fisher(G, structure="block").damp(0.1, relative=True).inv(),
        "fisher diag pow": ga.fisher(G, structure="diag").damp(1e-2).pow(-0.5),
        "kfac inv": K.damp(1e-2).inv(),
        "ekfac pow": E.damp(1e-2).pow(-0.5),
        "kfac + c I": (K + 0.1 * I).inv(),
        "kfac + ekfac": (K + E).damp(1e-2).inv(),
        "kfac + diag fisher": (K + ga.fisher(G, structure="diag")).damp(1e-2).inv(),
        "gauss-newton cg": GN.damp(0.1).inv(method="cg"),
        "arnoldi": ga.arnoldi(GN, rank=4).damp(0.1).inv(),
        "datainf": ga.datainf(G, damping=0.1),
        "sum with implicit": (F + GN).damp(0.1).inv(method="cg"),
        "scaled": 2.0 * F.damp(1e-2).inv(),
    }


def test_resolution_rules_without_data_equal_the_rules_applied(task_data):
    task, data = task_data
    for name, H in _expressions(task, data).items():
        node, _ = simplify_until_fixpoint(H.expr)
        predicted = resolution_rules(node)
        resolved = LocalExecutor().operator(H.expr)
        assert isinstance(resolved, LinearOp)
        assert list(resolved.rules) == predicted, name
    assert resolution_rules(ga.kfac(ga.grads(task, data)).damp(1e-2).inv()) == [
        "kronecker.damp_in_eigenbasis", "kronecker.invert_eigenvalues"]


def test_resolution_rules_refuse_before_any_pass(task_data):
    task, data = task_data
    G = ga.grads(task, data)
    with pytest.raises(ga.OperatorError, match="an implicit.*operator.*ga.arnoldi"):
        resolution_rules(ga.gauss_newton(task, data).damp(0.1).pow(-0.5))
    with pytest.raises(ga.OperatorError, match="DataInf"):
        resolution_rules(ga.datainf(G, damping=0.1).inv())
    with pytest.raises(ga.OperatorError, match="relative damping"):
        resolution_rules(ga.hessian(task, data).damp(0.1, relative=True))


def test_stored_operators_keep_the_protocol(task_data, tmp_path):
    pytest.importorskip("zarr")
    task, data = task_data
    G = ga.grads(task, data)
    for H, form in ((ga.kfac(G), "kronecker"), (ga.fisher(G, structure="block"), "block"),
                    (ga.arnoldi(ga.fisher(G), rank=3), "low-rank")):
        stored = ga.store.write_operator(H, tmp_path / f"{form}.zarr")
        op = LocalExecutor().operator(stored.expr)
        ref = LocalExecutor().operator(H.expr)
        assert isinstance(op, LinearOp) and op.form == form
        torch.testing.assert_close(op.dense(), ref.dense(), rtol=0, atol=0)
        if form != "low-rank":
            M = ref.dense() + 1e-2 * torch.eye(ref.space.dim, dtype=F64)
            torch.testing.assert_close(op.damp(1e-2).inverse().dense(), torch.linalg.inv(M), rtol=1e-8, atol=1e-8)
        assert resolution_rules(stored.damp(1e-2).inv()) == list(LocalExecutor().operator(
            stored.damp(1e-2).inv().expr).rules)


def test_kfac_factorwise_damping_only_when_asked():
    """damp_factorwise is K-FAC's (S + √λ/π I) ⊗ (A + π√λ I), named; refused for EK-FAC."""
    g = _gen(6)
    S, A = _spd(3, g), _spd(4, g)
    lam_S, Q_S = torch.linalg.eigh(S)
    lam_A, Q_A = torch.linalg.eigh(A)
    space = ParamSpace((Block("a", (3, 4), "linear", "params"),))
    op = KronOp(space, {"a": (Q_S, Q_A)}, {"a": torch.outer(lam_S, lam_A)})
    lam = 0.2
    pi = ((torch.trace(A) / 4) / (torch.trace(S) / 3)) ** 0.5
    ref = torch.kron(S + lam ** 0.5 / pi * torch.eye(3, dtype=F64), A + pi * lam ** 0.5 * torch.eye(4, dtype=F64))
    damped = op.damp_factorwise(lam)
    torch.testing.assert_close(damped.dense(), ref, **TOL)
    split = KronOp(space, {"a": (Q_S, Q_A)}, {"a": torch.outer(7.0 * lam_S, lam_A / 7.0)})   # same Λ
    torch.testing.assert_close(split.damp_factorwise(lam).dense(), ref, **TOL)
    assert damped.rules == ("kronecker.factorwise_damp",) and op.damp(lam).rules == ("kronecker.damp_in_eigenbasis",)
    ekfac = KronOp(space, {"a": (Q_S, Q_A)}, {"a": torch.rand(3, 4, generator=g, dtype=F64) + 0.1})
    with pytest.raises(ga.OperatorError, match="not a Kronecker product"):
        ekfac.damp_factorwise(lam)
