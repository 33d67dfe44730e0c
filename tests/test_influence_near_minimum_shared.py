"""The near-minimum rule's follow-ups (issue 31): ``curvature="auto"`` never turns a call the
Gauss-Newton answers into a refusal (a singular damped, shifted Hessian falls back to it, and the
plan says why), and the formed Hessian is eigendecomposed once — for μ_min, its PSD shift and its
inverse — with the numbers of separate decompositions. References: ``torch.func.hessian`` and a
``jacrev`` Gauss-Newton (:mod:`test_influence_near_minimum`)."""
from __future__ import annotations

import pytest
import torch

import gradalg as ga
from gradalg.errors import OperatorError
from gradalg.expr.curvature import PROBES
from gradalg.linalg import SINGULAR_RTOL
from gradalg.linalg.explicit import ResolvedOp
from gradalg.space import Block, ParamSpace
from gradalg.testing import assert_close
from test_influence_near_minimum import WD, Flat, far_from_a_minimum, hessian_reference, logreg_at_its_minimum, run


def test_damping_zero_off_an_exact_minimum_takes_the_gauss_newton_not_a_refusal():
    """damping=0 with the objective's weight decay: the Gauss-Newton G + wd·I is invertible, but
    the Hessian H̄ + wd·I of a model not exactly at a minimum has a negative eigenvalue, and its
    shift to PSD leaves 0. Where the ratio picks the Hessian (here forced: r = inf), ``"auto"``
    answers with the Gauss-Newton (what the old default gave) and says why; by name the Hessian
    refuses. (A softmax model's G alone is singular: its logits shift together.)"""
    flat = far_from_a_minimum()
    H, Gn = flat.hessian(), flat.gauss_newton()
    eye = torch.eye(len(H), dtype=H.dtype)
    mu = torch.linalg.eigvalsh(H + WD * eye)
    assert float(mu.min()) < 0
    with ga.options(hessian_negative_ratio=float("inf")):
        values, probe, _, after = run(flat, damping=0.0, weight_decay=WD)
    assert probe.chosen == "gauss_newton" and probe.exact and probe.ratio <= probe.threshold
    low, high = probe.singular
    assert low <= SINGULAR_RTOL * high and high == pytest.approx(float(mu.max() - mu.min()), rel=1e-10)
    assert_close(values, flat.scores(Gn + WD * eye), rtol=1e-8, atol=1e-12)        # (G + 0·I + wd·I)⁻¹
    assert after.chosen == "gauss_newton" and "shifted to PSD is singular (smallest eigenvalue 0" in after.reason and "damping > 0" in after.reason
    assert f"−μ_min / mean = {probe.ratio:.3g} ≤ r = inf" in after.reason
    # "auto" is the same rule: the same scores, no refusal
    task, train, queries = ga.tasks.classification(flat.model), (flat.X, flat.y), (flat.Xq, flat.yq)
    with ga.options(hessian_negative_ratio=float("inf")):
        auto = ga.methods.influence(task, train, queries, damping=0.0, weight_decay=WD).compute()
    assert_close(torch.as_tensor(auto.transpose("query", "train").values), values, rtol=1e-12, atol=0)
    # named, the Hessian keeps its refusal
    with pytest.raises(OperatorError, match="cannot invert .* singular"):
        ga.methods.influence(task, train, queries, curvature="dense_hessian", damping=0.0,
                             weight_decay=WD).compute()
    # with a damping the same model takes the Hessian, shifted and damped as asked
    with ga.options(hessian_negative_ratio=float("inf")):
        values, probe, _, after = run(flat, damping=1e-3, weight_decay=WD)
    assert probe.chosen == "dense_hessian" and probe.singular is None and "so the dense Gauss-Newton" not in after.reason
    A = H + WD * eye + (1e-3 - float(mu.min())) * eye
    assert_close(values, flat.scores(A), rtol=1e-8, atol=1e-12)


def _full_size_decompositions(monkeypatch, dim):
    """A list that records each eigh / eigvalsh of a (dim, dim) matrix from now on."""
    calls = []
    for name in ("eigh", "eigvalsh"):
        real = getattr(torch.linalg, name)

        def counted(A, *args, _real=real, _name=name, **kwargs):
            if A.shape[-1] == dim:
                calls.append(_name)
            return _real(A, *args, **kwargs)
        monkeypatch.setattr(torch.linalg, name, counted)
    return calls


def _separate_decompositions(monkeypatch):
    """The path before the pairs were kept: every step decomposes its own matrix."""
    def eigenpairs(self):
        m = self.data.to(torch.float64)
        return torch.linalg.eigh((m + m.T) / 2)
    monkeypatch.setattr(ResolvedOp, "eigenpairs", eigenpairs)
    monkeypatch.setattr(ResolvedOp, "_shifted_eig", lambda self, shift: None)


@pytest.mark.parametrize("case", ["minimum_with_decay", "indefinite_always_hessian", "named_dense_hessian"])
def test_the_formed_hessian_is_decomposed_once_with_the_numbers_of_separate_decompositions(monkeypatch, case):
    flat = logreg_at_its_minimum() if case == "minimum_with_decay" else far_from_a_minimum()
    kwargs = {"weight_decay": WD} if case == "minimum_with_decay" else {}
    H = flat.hessian()
    task, train, queries = ga.tasks.classification(flat.model), (flat.X, flat.y), (flat.Xq, flat.yq)

    def scores():
        PROBES.clear()
        with ga.options(hessian_negative_ratio=float("inf")):           # the Hessian wherever it is
            curvature = "dense_hessian" if case == "named_dense_hessian" else "near_minimum"
            S = ga.methods.influence(task, train, queries, curvature=curvature, **kwargs)
            return torch.as_tensor(S.compute().transpose("query", "train").values)

    with monkeypatch.context() as m:
        calls = _full_size_decompositions(m, len(H))
        shared = scores()
    assert calls == ["eigh"]                       # μ_min, the PSD shift and the inverse: one eigh
    with monkeypatch.context() as m:
        _separate_decompositions(m)
        calls = _full_size_decompositions(m, len(H))
        separate = scores()
    # each its own: (μ_min, the check that its inverse exists,) the PSD shift, the inverse
    assert len(calls) == (2 if case == "named_dense_hessian" else 4)
    assert_close(shared, separate, rtol=1e-12, atol=1e-12 * float(separate.abs().max()))
    decay = WD if case == "minimum_with_decay" else 0.0
    assert_close(shared, flat.scores(hessian_reference(H, decay)), rtol=1e-8, atol=1e-12)


def test_a_shift_by_one_lambda_keeps_the_pairs_and_a_per_block_one_drops_them():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(6, 6, generator=g, dtype=torch.float64)
    space = ParamSpace((Block("a", (2,), "param"), Block("b", (4,), "param")))
    op = ResolvedOp(space, "dense", (A + A.T) / 2)
    assert op.nbytes() == 36 * 8
    mu, U = op.eigenpairs()
    assert op.nbytes() == (36 + 6 + 36) * 8                              # the kept pairs are counted
    assert op.eigenpairs()[0] is mu                                     # kept
    shifted = op._damp(0.5)
    assert shifted.eig is not None and torch.equal(shifted.eig[0], mu + 0.5) and shifted.eig[1] is U
    assert op._damp_blocks({"a": 0.5, "b": 0.5}).eig is not None
    assert op._damp_blocks({"a": 0.5, "b": 0.25}).eig is None          # different λ_b: new eigenvectors
    inv = (op._damp(float(-mu.min()) + 1.0)).inverse()
    assert_close(inv.data, torch.linalg.inv(op.data + (1.0 - float(mu.min())) * torch.eye(6, dtype=torch.float64)),
                 rtol=1e-12, atol=1e-12)


def test_products_in_vmap_chunks_are_the_products_of_one_call():
    """``ga.options(products_vmap_elements)`` splits a products call's vectors into vmap chunks of
    ⌊E / (batch · activations per example)⌋: the numbers are those of one call (each vector's
    product alone either way), and the formed Hessian's scores match torch.func's."""
    from gradalg.curvature.hvp import Products, dataset_matvec
    from gradalg.data import as_data
    from models import cnn, image_data
    X, y = image_data(n=12)
    flat = Flat(cnn(), (X[:10], y[:10]), (X[10:], y[10:]))
    task = ga.tasks.classification(flat.model)
    layers = ga.grads(task, (flat.X, flat.y)).space.names
    dim = len(flat.theta)
    g = torch.Generator().manual_seed(0)
    V = torch.randn(7, dim, generator=g, dtype=torch.float64)
    data = as_data((flat.X, flat.y))
    per_example = 4 * 4 * 4 + 5 * 2 * 2 + 3          # conv1, conv2, fc outputs (its relus are functions)
    with ga.options(products_vmap_elements=3 * 10 * per_example):
        products = Products(task, data, layers)
        assert products.vmap_chunk((flat.X, flat.y), 7) == 3 and products.example_elements == per_example
        chunked = dataset_matvec(task, data, layers, batch_size=64)(V)
    with ga.options(products_vmap_elements=0):
        whole = dataset_matvec(task, data, layers, batch_size=64)(V)
    assert torch.equal(chunked, whole) or float((chunked - whole).abs().max()) <= 1e-14 * float(whole.abs().max())
    with ga.options(products_vmap_elements=10 * per_example, hessian_negative_ratio=float("inf")):
        values, probe, _, _ = run(flat)                                  # one vector per vmap call
    assert probe.chosen == "dense_hessian"
    assert_close(values, flat.scores(hessian_reference(flat.hessian())), rtol=1e-8, atol=1e-12)
