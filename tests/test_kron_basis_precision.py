"""The precision K-FAC / EK-FAC eigenbases are stored in (:func:`gradalg.curvature.kron.basis_dtype`).

Every use of a basis rotates in the rows' work dtype, so a float64 eigendecomposition of
statistics summed from float32 rows is stored once as its float32 rounding: the same
numbers, bit for bit, as the float64 basis cast at each use (what gradalg did before), at
half the bytes. Float64 rows keep float64 bases: a float32-rounded basis would make a
damped inverse at small damping wrong by ~u₃₂·κ, which the dense float64 reference below
detects (a basis that silently lost its precision fails here).
"""
from dataclasses import replace

import pytest
import torch

import gradalg as ga
import gradalg.curvature.kron as curvature_kron
from gradalg.exec.local import LocalExecutor
from gradalg.plan.jobs.kron import KronAccumulator, basis_dtype, kron_factor_bytes, kron_output_bytes
from models import classification_data, mlp
from references import one_thread  # noqa: F401 - one intra-op thread per test module

F32, F64 = torch.float32, torch.float64


def _setting(dtype):
    model = mlp(dtype=dtype)
    X, y = classification_data(n=40, dtype=dtype)
    return ga.tasks.classification(model), (X, y)


def _bases(op):
    return [Q for Qs in op.bases.values() for Q in Qs if Q is not None]


def test_float64_rows_keep_float64_bases_exact_at_small_damping():
    """K-FAC of a float64 model: float64 bases, orthogonal to float64 rounding, and the damped
    inverse at λ = 10⁻⁷·‖F‖ a float64 inverse of the dense F + λI: (F + λI)⁻¹(F + λI) = I to
    1e-8 (measured 5.9e-10). The same bases rounded to float32 miss it by 7.3e-6: the
    check sees a basis that lost its precision."""
    task, data = _setting(F64)
    C = ga.grads(task, data, objective="expected", batch_size=16)
    op = LocalExecutor().operator(ga.kfac(C).expr)
    assert _bases(op) and all(Q.dtype == F64 for Q in _bases(op))
    for Q in _bases(op):
        assert float((Q.T @ Q - torch.eye(Q.shape[0], dtype=F64)).abs().max()) < 1e-12
    K = ga.kfac(C)
    dense = K.to_dense()
    lam = 1e-7 * float(torch.linalg.matrix_norm(dense, 2))
    damped = dense + lam * torch.eye(len(dense), dtype=F64)
    inv = K.damp(lam).inv().to_dense()
    assert inv.dtype == F64
    eye = torch.eye(len(dense), dtype=F64)
    err = float((inv @ damped - eye).abs().max())            # (F + λI)⁻¹ (F + λI) = I, a float64 dense F
    assert err < 1e-8, err                                  # measured 5.9e-10
    # the same check with the bases rounded to float32 fails: the test can see a lost precision
    Q32 = {k: tuple(None if Q is None else Q.to(F32).to(F64) for Q in Qs) for k, Qs in op.bases.items()}
    rounded = replace(op, bases=Q32).damp(lam).inverse().dense()
    assert float((rounded @ damped - eye).abs().max()) > 1e-6  # measured 7.3e-6


def _ekfac_influence(task, data, damping, monkeypatch=None):
    X, y = data
    S = ga.methods.influence(task, (X[:30], y[:30]), (X[30:], y[30:]), curvature="ekfac", damping=damping)
    ex = LocalExecutor()
    scores = torch.as_tensor(ex.scores(S.expr))
    krons = [op for op in list(ex.state.ops.values()) + list(ex.state.kron.values()) if hasattr(op, "bases")]
    return scores, krons


@pytest.mark.parametrize("damping", [1e-6, 1e-2])
def test_float32_rows_store_float32_bases_with_the_numbers_of_the_float64_ones(monkeypatch, damping):
    """EK-FAC influence of a float32 model: its bases are stored in float32 (column-major, as
    eigh returned them), and the scores equal, bit for bit, those of float64-stored bases cast
    at each use (the code before: ``basis_dtype`` patched to keep the eigendecomposition's dtype)."""
    task, data = _setting(F32)
    scores, krons = _ekfac_influence(task, data, damping)
    assert krons and all(Q.dtype == F32 for op in krons for Q in _bases(op))
    assert all(Q.stride() == (1, Q.shape[0]) for op in krons for Q in _bases(op) if Q.shape[0] > 1)
    monkeypatch.setattr(curvature_kron, "basis_dtype", lambda eigh_dtype, rows_dtype: eigh_dtype)
    before, old = _ekfac_influence(task, data, damping)
    assert all(Q.dtype == F64 for op in old for Q in _bases(op))
    assert torch.equal(scores, before)
    eig = [op for op in krons if any(len(p.base) == 1 for p in op.parts.values())][0]
    eig_old = [op for op in old if any(len(p.base) == 1 for p in op.parts.values())][0]
    for name in eig.parts:                                   # EK-FAC's re-fitted eigenvalues: the same
        assert torch.equal(eig.eigenvalues[name], eig_old.eigenvalues[name])


def test_a_finishing_shard_that_only_absorbed_keeps_the_rows_precision():
    """Sharded passes (Dask, torch.distributed): the owner finishing K-FAC may have summed no
    chunk itself; the rows' dtype travels with the exported sums."""
    for dtype in (F32, F64):
        task, data = _setting(dtype)
        C = ga.grads(task, data, objective="expected", batch_size=16)
        node = ga.kfac(C).expr
        chunk = LocalExecutor().gradients(C.expr)
        worker, owner = KronAccumulator(node), KronAccumulator(node)
        worker.update(chunk)
        owner.absorb(worker.export())
        assert all(Q.dtype == dtype for Q in _bases(owner.finish()))


def test_the_planner_counts_bases_in_the_precision_they_are_stored_in():
    """``kron_factor_bytes``: 4·d² for float32 (and half-precision) rows, 8·d² for float64 rows;
    a float32 eigendecomposition (wider than kron_float64_width) 4·d² either way."""
    d = 100
    assert basis_dtype(F64, F32) == F32 and basis_dtype(F64, torch.bfloat16) == F32
    assert basis_dtype(F64, F64) == F64 and basis_dtype(F64, None) == F64 and basis_dtype(F32, F64) == F32
    assert kron_factor_bytes(d, 8192, None, F32)["basis"] == 4 * d * d
    assert kron_factor_bytes(d, 8192, None, torch.bfloat16)["basis"] == 4 * d * d
    assert kron_factor_bytes(d, 8192, None, F64)["basis"] == 8 * d * d
    assert kron_factor_bytes(d, 50, None, F64)["basis"] == 4 * d * d
    # the float64 eigenvectors beside their float32 copy while it is made
    assert kron_factor_bytes(d, 8192, None, F32)["eigh"] == 28 * d * d
    task, _ = _setting(F32)
    space = ga.grads(task, classification_data(n=4, dtype=F32)).expr.space
    b64 = kron_output_bytes(space, 8192, None, rows_dtype=F64)
    b32 = kron_output_bytes(space, 8192, None, rows_dtype=F32)
    bases64 = sum(8.0 * (o * o + i * i) for o, i in ((b.shape[0], b.shape[-1]) for b in space.blocks))
    assert b64 - b32 == bases64 / 2
