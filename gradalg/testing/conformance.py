"""Conformance mixins: every algebra operation of a node type checked against dense torch.

A test class mixes in :class:`GradientSetConformance` (or :class:`OperatorConformance`),
supplies ``create()`` and ``dense_reference()``, and inherits one ``test_*`` method per
operation. Each method builds the lazy expression, computes it with a fresh
:class:`~gradalg.exec.local.LocalExecutor` and compares it with the same operation done
in float64 torch on the reference. Tolerances are per class (``rtol``, ``atol``; ``atol`` is
scaled by the largest magnitude of the expected tensor, so one setting fits scores and
gradients of any size).

The methods take no arguments and use no fixtures, so an instance can also be created by
hand (e.g. inside a hypothesis test with drawn shapes) and checked with
:meth:`run_conformance`.

Conventions
-----------
``GradientSetConformance.dense_reference()`` returns the (n, dim) rows of ``create()``,
computed independently (``ga.per_example_grads`` and torch, not the executor), with
columns in the order of ``create().space``: block after block, each block flattened
row-major in its canonical shape (``(out, in)`` with the bias as the last column of
``in``; see :mod:`gradalg.capture.layers`).

``OperatorConformance.dense_reference()`` returns the (dim, dim) matrix of ``create()``
(symmetric positive semi-definite unless ``psd = False``), in the same column order.
"""
from __future__ import annotations

import unittest

import torch

from ..linalg import SHORT, VOCABULARY

__all__ = ["GradientSetConformance", "OperatorConformance", "assert_close", "project_dense"]

F64 = torch.float64
_STRUCTURES = tuple(SHORT.values())   # the one-word names of the vocabulary of gradalg.linalg.labels


def _as64(x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    return x.detach().to("cpu", F64)


def assert_close(actual, expected, *, rtol: float, atol: float, what: str = "") -> None:
    """``|actual - expected| <= atol·max(1, max|expected|) + rtol·|expected|`` elementwise."""
    actual, expected = _as64(actual), _as64(expected)
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    bound = atol * scale + rtol * expected.abs()
    err = (actual - expected).abs()
    if not bool((err <= bound).all()):
        worst = int((err - bound).flatten().argmax())
        raise AssertionError(
            f"{what}: max abs error {float(err.max()):.3g} (largest |expected| {scale:.3g}); worst "
            f"element {worst}: got {float(actual.flatten()[worst]):.10g}, expected "
            f"{float(expected.flatten()[worst]):.10g} (rtol={rtol}, atol={atol})")


def project_dense(rows: torch.Tensor, space, projector) -> torch.Tensor:
    """The projection of dense reference ``rows`` (n, dim) in ``space``, in plain torch.

    Uses the projector's own matrices (:func:`gradalg.proj.dense_matrix`,
    :func:`gradalg.proj.kron_matrices`): per block ``R_b M_bᵀ`` (``per_block``), their sum
    (one (k, dim) matrix over the concatenated gradient), or ``P_out G_b P_inᵀ`` ("kron").
    Returns (n, k_total) in the projected space's column order.
    """
    from ..proj import dense_matrix, kron_matrices

    rows = _as64(rows)
    n = rows.shape[0]
    offsets = space.offsets()
    parts = []
    for b in space.blocks:
        block = rows[:, offsets[b.name]]
        if projector.kind == "kron":
            P_out, P_in = kron_matrices(projector, b.name, *b.shape, dtype=F64)
            parts.append((P_out @ block.reshape(n, *b.shape) @ P_in.T).flatten(1))
        else:
            parts.append(block @ dense_matrix(projector, b.name, b.dim, dtype=F64).T)
    if projector.kind == "kron" or projector.per_block:
        return torch.cat(parts, dim=1)
    return sum(parts)


class _Counting:
    """Counts forward calls of every module while active (proves laziness)."""

    def __enter__(self):
        self.calls = 0

        def hook(module, args):
            self.calls += 1

        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        return False


class _Base:
    rtol: float = 1e-5
    atol: float = 1e-7

    def check(self, actual, expected, what: str) -> None:
        assert_close(actual, expected, rtol=self.rtol, atol=self.atol, what=f"{type(self).__name__}: {what}")

    def run_conformance(self) -> list[str]:
        """Run every inherited ``test_*`` check on this instance; returns the names skipped."""
        skipped = []
        for name in sorted(dir(self)):
            if name.startswith("test_") and callable(getattr(self, name)):
                try:
                    getattr(self, name)()
                except unittest.SkipTest:
                    skipped.append(name)
        return skipped

    @staticmethod
    def _executor(ghost: str | None = None):
        from ..exec.local import LocalExecutor
        from ..options import get_options, options

        if ghost is None:
            return LocalExecutor()
        with options(ghost=ghost):
            return LocalExecutor(get_options())


def _rows(G, executor=None) -> torch.Tensor:
    """(n, dim) rows of a GradientSet via ``to_dense``, in space order."""
    dense = G.to_dense(executor)
    return torch.cat([_as64(dense[name]).reshape(G.n, -1) for name in G.space.names], dim=1)


def _spd(dim: int, seed: int) -> torch.Tensor:
    """A well-conditioned symmetric positive definite (dim, dim) matrix: I + a rank-8 term."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, 8, generator=gen, dtype=F64) / 8 ** 0.5
    return a @ a.T + torch.eye(dim, dtype=F64)


def _sym_fn(matrix: torch.Tensor, fn) -> torch.Tensor:
    evals, evecs = torch.linalg.eigh((matrix + matrix.T) / 2)
    return (evecs * fn(evals)) @ evecs.T


# ====================================================================== gradient sets
class GradientSetConformance(_Base):
    """Mixin checking a gradient-set node type against dense torch.

    Supply ``create() -> GradientSet`` and ``dense_reference() -> (n, dim)``; optionally
    override ``rtol``/``atol``, ``proj_k`` (projection sizes) and ``proj_seed``.
    """

    proj_k: int = 6
    proj_seed: int = 11

    def create(self):
        """The GradientSet under test (supplied by the test class)."""
        raise NotImplementedError("return the GradientSet under test")

    def dense_reference(self) -> torch.Tensor:
        """The reference rows of :meth:`create`, computed with plain torch: (n, dim)."""
        raise NotImplementedError("return the (n, dim) reference rows of create()")

    # ---- helpers --------------------------------------------------------------------
    def reference(self) -> torch.Tensor:
        """``dense_reference()`` in float64, computed once per instance."""
        if "_conformance_ref" not in self.__dict__:
            self.__dict__["_conformance_ref"] = _as64(self.dense_reference())
        return self.__dict__["_conformance_ref"]

    def _scores(self, S, ghost="auto"):
        ex = self._executor(ghost)
        out = S.compute(executor=ex)
        return torch.from_numpy(out.values), ex

    def _check_projection(self, projector):
        from ..errors import GradalgError

        G = self.create()
        if projector.kind == "kron" and any(len(b.shape) != 2 or b.basis != "params" for b in G.space.blocks):
            with _raises((ValueError, GradalgError)):
                projector(G).space  # noqa: B018 - a Kronecker projection needs (out, in) blocks
            raise unittest.SkipTest("kron projection needs (out, in) blocks in parameter coordinates")
        R = self.reference()
        expected = project_dense(R, G.space, projector)
        PG = projector(G)
        assert PG.n == G.n and PG.space.dim == expected.shape[1], "projected metadata"
        assert set(PG.representation.values()) == {"projected"}
        self.check(_rows(PG, self._executor()), expected, f"{projector!r} rows")
        for ghost in ("always", "never"):
            S, _ = self._scores(PG @ PG.T, ghost)
            self.check(S, expected @ expected.T, f"{projector!r} scores, ghost={ghost}")

    def _check_precondition(self, H, M):
        G = self.create()
        R = self.reference()
        self.check(_rows(G @ H, self._executor()), R @ M, "rows of G @ H")
        S, _ = self._scores(G @ H @ G.T)
        self.check(S, R @ M @ R.T, "G @ H @ G.T")
        S, _ = self._scores(G @ (H @ G.T))
        self.check(S, R @ M @ R.T, "G @ (H @ G.T)")

    # ---- checks ---------------------------------------------------------------------
    def test_metadata(self):
        from ..api import GradientSet

        G = self.create()
        R = self.reference()
        assert isinstance(G, GradientSet)
        assert R.dim() == 2, "dense_reference must return (n, dim)"
        assert (G.n, G.space.dim) == tuple(R.shape), f"(n, dim) = {(G.n, G.space.dim)} vs reference {tuple(R.shape)}"
        assert len(G) == G.n and len(G.ids) == G.n and len(set(G.ids)) == G.n
        assert tuple(G.representation) == G.space.names
        assert set(G.representation.values()) <= {"factored", "dense", "projected"}

    def test_to_dense_rows(self):
        G = self.create()
        dense = G.to_dense(self._executor())
        assert tuple(dense) == G.space.names, "to_dense keys follow the space's block order"
        for b in G.space.blocks:
            assert tuple(dense[b.name].shape) == (G.n, *b.shape), f"block {b.name!r} shape"
        self.check(_rows(G), self.reference(), "to_dense rows")

    def test_scores_ghost_dense_auto(self):
        G = self.create()
        R = self.reference()
        expected = R @ R.T
        factored = "factored" in G.representation.values()
        results = {}
        for ghost in ("always", "never", "auto"):
            S, ex = self._scores(G @ G.T, ghost)
            self.check(S, expected, f"G @ G.T with ghost={ghost!r}")
            results[ghost] = S
            if ghost == "always" and factored:
                assert ex.trace["ghost"] > 0, f"ghost='always' ran no ghost kernel: {dict(ex.trace)}"
            if ghost == "never":
                assert ex.trace["ghost"] == 0, f"ghost='never' ran a ghost kernel: {dict(ex.trace)}"
        self.check(results["always"], results["never"], "ghost vs dense kernels")

    def test_compute_returns_dataarray(self):
        import numpy as np
        import xarray as xr

        G = self.create()
        out = (G @ G.T).compute(executor=self._executor())
        assert isinstance(out, xr.DataArray)
        assert out.dims == ("query", "train")
        assert out.shape == (G.n, G.n)
        assert list(out.coords["query"].values) == list(np.asarray(G.ids))
        assert list(out.coords["train"].values) == list(np.asarray(G.ids))
        assert np.isfinite(out.values).all()

    def test_normalize(self):
        G = self.create()
        R = self.reference()
        norms = R.norm(dim=1, keepdim=True)
        expected = torch.where(norms > 0, R / norms.clamp_min(1e-300), torch.zeros_like(R))
        N = G.normalize()
        assert N.space == G.space and N.n == G.n
        self.check(_rows(N, self._executor()), expected, "normalize rows")
        for ghost in ("always", "never"):
            S, _ = self._scores(N @ N.T, ghost)
            self.check(S, expected @ expected.T, f"cosine scores, ghost={ghost}")

    def test_select(self):
        G = self.create()
        R = self.reference()
        offsets = G.space.offsets()
        for name in G.space.names:
            sub = G.select([name])
            assert sub.space.names == (name,)
            expected = R[:, offsets[name]]
            self.check(_rows(sub, self._executor()), expected, f"select {name!r}")
            self.check(_rows(G[name], self._executor()), expected, f"G[{name!r}]")
            S, _ = self._scores(sub @ sub.T, "auto")
            self.check(S, expected @ expected.T, f"scores of select {name!r}")
        if len(G.space.names) > 1:
            names = tuple(reversed(G.space.names))
            expected = torch.cat([R[:, offsets[n]] for n in names], dim=1)
            self.check(_rows(G.select(names), self._executor()), expected, "select in reversed order")

    def test_scale_constant(self):
        G = self.create()
        R = self.reference()
        for c, scaled in ((2.5, G * 2.5), (-0.5, -0.5 * G), (3.0, G.scale(3))):
            self.check(_rows(scaled, self._executor()), c * R, f"rows scaled by {c}")
        for ghost in ("always", "never"):
            S, _ = self._scores(G @ (G * -1.5).T, ghost)
            self.check(S, -1.5 * (R @ R.T), f"G @ (-1.5 G).T, ghost={ghost}")

    def test_project_gaussian(self):
        from ..proj import gaussian
        self._check_projection(gaussian(self.proj_k, self.proj_seed))

    def test_project_gaussian_per_block(self):
        from ..proj import gaussian
        self._check_projection(gaussian(self.proj_k, self.proj_seed, per_block=True))

    def test_project_rademacher(self):
        from ..proj import rademacher
        self._check_projection(rademacher(self.proj_k, self.proj_seed + 1))

    def test_project_rademacher_per_block(self):
        from ..proj import rademacher
        self._check_projection(rademacher(self.proj_k, self.proj_seed + 1, per_block=True))

    def test_project_kron(self):
        from ..proj import kron
        self._check_projection(kron(self.proj_k, self.proj_seed + 2))

    def test_precondition_identity(self):
        from ..api import identity
        G = self.create()
        self._check_precondition(identity(G), torch.eye(G.space.dim, dtype=F64))

    def test_precondition_diagonal(self):
        from ..api import diagonal
        G = self.create()
        gen = torch.Generator().manual_seed(5)
        values = torch.rand(G.space.dim, generator=gen, dtype=F64) + 0.5
        self._check_precondition(diagonal(values, G), torch.diag(values))

    def test_precondition_dense(self):
        from ..api import dense
        G = self.create()
        M = _spd(G.space.dim, 6)
        self._check_precondition(dense(M, G), M)

    def test_sum_and_mean_of_scores(self):
        from .. import api

        G = self.create()
        R = self.reference()
        K = R @ R.T
        S = G @ G.T
        cases = [
            (api.sum_scores([S, S * 2.0]), 3 * K, "ga.sum([S, 2S])"),
            (api.sum_scores([S, S], weights=[1.0, -0.25]), 0.75 * K, "ga.sum weighted"),
            (api.mean_scores([S, 3 * S]), 2 * K, "ga.mean([S, 3S])"),
            (S + S, 2 * K, "S + S"),
            (S - S * 0.5, 0.5 * K, "S - 0.5 S"),
            (S / 4, K / 4, "S / 4"),
        ]
        for expr, expected, what in cases:
            values, _ = self._scores(expr)
            self.check(values, expected, what)

    def test_building_is_lazy(self):
        from ..api import dense, diagonal, fisher, identity
        from ..proj import gaussian

        self.reference()  # the reference may run the model; only what follows is counted
        with _Counting() as count:
            G = self.create()
            P = gaussian(self.proj_k, self.proj_seed)
            exprs = [G, G.normalize(), G * 2.0, G.select(G.space.names[:1]), P(G),
                     G @ G.T, G @ identity(G) @ G.T, P(G) @ fisher(P(G)).damp(1.0).inv() @ P(G).T,
                     G @ diagonal(torch.ones(G.space.dim, dtype=F64), G) @ G.T,
                     G @ dense(torch.eye(G.space.dim, dtype=F64), G)]
            for e in exprs:
                assert repr(e) and e._repr_html_() and e.cost() is not None
        assert count.calls == 0, f"building and displaying expressions ran {count.calls} forward calls"


# ====================================================================== operators
class OperatorConformance(_Base):
    """Mixin checking an operator node type against dense torch.

    Supply ``create() -> Operator`` and ``dense_reference() -> (dim, dim)``. For the
    application checks, supply ``gradients() -> GradientSet`` in the operator's space
    (and optionally ``gradients_reference() -> (n, dim)``; by default its ``to_dense``).
    ``inv_damping``: damping added before inverting (> 0 for a singular operator).
    """

    inv_damping: float = 0.0
    psd: bool = True

    def create(self):
        """The Operator under test (supplied by the test class)."""
        raise NotImplementedError("return the Operator under test")

    def dense_reference(self) -> torch.Tensor:
        """The reference matrix of :meth:`create`, computed with plain torch: (dim, dim)."""
        raise NotImplementedError("return the (dim, dim) reference matrix of create()")

    def gradients(self):
        """Optional: a GradientSet in the operator's space for the application checks
        (``None``, the default, skips them)."""
        return None

    def gradients_reference(self) -> torch.Tensor:
        """The reference rows of :meth:`gradients`: (n, dim); by default its dense rows."""
        return _rows(self.gradients())

    # ---- helpers --------------------------------------------------------------------
    def reference(self) -> torch.Tensor:
        """``dense_reference()`` in float64, computed once per instance."""
        if "_conformance_ref" not in self.__dict__:
            self.__dict__["_conformance_ref"] = _as64(self.dense_reference())
        return self.__dict__["_conformance_ref"]

    def _dense(self, op) -> torch.Tensor:
        return _as64(op.to_dense(self._executor()))

    def _eye(self):
        return torch.eye(self.reference().shape[0], dtype=F64)

    def _damped(self):
        op = self.create()
        return (op.damp(self.inv_damping) if self.inv_damping else op), self.reference() + self.inv_damping * self._eye()

    def _needs_psd(self):
        if not self.psd:
            raise unittest.SkipTest("needs a positive semi-definite operator")

    # ---- checks ---------------------------------------------------------------------
    def test_metadata(self):
        from ..api import Operator

        op = self.create()
        ref = self.reference()
        assert isinstance(op, Operator)
        assert op.shape == tuple(ref.shape) == (op.space.dim, op.space.dim)
        assert op.structure in _STRUCTURES, f"unknown structure {op.structure!r}"
        labels = op.expr.labels().labels
        assert labels <= VOCABULARY, f"labels {sorted(labels - VOCABULARY)} are not in gradalg.linalg.labels"

    def test_to_dense(self):
        op = self.create()
        M = self._dense(op)
        self.check(M, self.reference(), "to_dense")
        self.check(M, M.T, "symmetry")

    def test_structure_pattern(self):
        op = self.create()
        M = self._dense(op)
        if op.structure in ("identity", "diag"):
            self.check(M - torch.diag(torch.diagonal(M)), torch.zeros_like(M), f"{op.structure} has no off-diagonal")
        if op.structure == "identity":   # a multiple of the identity, c·I
            self.check(M, M[0, 0] * self._eye(), "identity")
        if op.structure in ("block", "kron"):   # block-diagonal across layers
            mask = torch.block_diag(*(torch.ones(b.dim, b.dim, dtype=F64) for b in op.space.blocks))
            self.check(M * (1 - mask), torch.zeros_like(M), "block structure has no cross-block entries")

    def test_damp(self):
        op = self.create()
        ref = self.reference()
        for lam in (0.0, 0.3, 2.0):
            self.check(self._dense(op.damp(lam)), ref + lam * self._eye(), f"damp({lam})")
        with _raises(ValueError):
            op.damp(-1.0)

    def test_inv(self):
        op, A = self._damped()
        inv = self._dense(op.inv())
        expected = torch.linalg.inv(A)
        self.check(inv, expected, "inv() vs torch.linalg.inv")
        self.check(inv @ A, self._eye(), "inv() @ A")

    def test_pow(self):
        self._needs_psd()
        op = self.create()
        ref = self.reference()
        half = self._dense(op.pow(0.5))
        self.check(half @ half, ref, "pow(0.5)²")
        self.check(half, half.T, "pow(0.5) is symmetric")
        self.check(self._dense(op.pow(1.0)), ref, "pow(1)")
        # The square root is compared entrywise on the damped operator only: near a zero
        # eigenvalue √ is not Lipschitz, so rounding of a singular op moves √ by ~√eps.
        damped, A = self._damped()
        self.check(self._dense(damped.pow(0.5)), _sym_fn(A, lambda e: e.clamp_min(0).sqrt()), "pow(0.5) vs eigh")
        self.check(self._dense(damped.pow(-1)), torch.linalg.inv(A), "pow(-1) vs torch.linalg.inv")
        self.check(self._dense(damped.pow(-0.5)), _sym_fn(A, lambda e: e.rsqrt()), "pow(-0.5)")

    def test_scaling(self):
        op = self.create()
        ref = self.reference()
        self.check(self._dense(op * 2.5), 2.5 * ref, "op * 2.5")
        self.check(self._dense(0.5 * op), 0.5 * ref, "0.5 * op")
        self.check(self._dense((op * 3.0).damp(0.5)), 3 * ref + 0.5 * self._eye(), "(3 op).damp(0.5)")

    def test_sum(self):
        from ..api import identity

        op = self.create()
        ref = self.reference()
        self.check(self._dense(op + op), 2 * ref, "op + op")
        self.check(self._dense(op + identity(op)), ref + self._eye(), "op + I")
        self.check(self._dense(op + 0.5 * op + identity(op) * 2.0), 1.5 * ref + 2 * self._eye(), "op + 0.5 op + 2 I")

    def test_apply_to_gradients(self):
        G = self.gradients()
        if G is None:
            raise unittest.SkipTest("no gradients() supplied")
        op = self.create()
        ref = self.reference()
        R = _as64(self.gradients_reference())
        self.check(_rows(G @ op, self._executor()), R @ ref, "rows of G @ op")
        for what, S in (("G @ op @ G.T", G @ op @ G.T), ("G @ (op @ G.T)", G @ (op @ G.T))):
            values = torch.from_numpy(S.compute(executor=self._executor()).values)
            self.check(values, R @ ref @ R.T, what)
        damped, A = self._damped()
        values = torch.from_numpy((G @ damped.inv() @ G.T).compute(executor=self._executor()).values)
        self.check(values, R @ torch.linalg.solve(A, R.T), "G @ op⁻¹ @ G.T")

    def test_building_is_lazy(self):
        self.reference()  # the references may run the model; only what follows is counted
        if self.gradients() is not None:
            self.gradients_reference()
        with _Counting() as count:
            op = self.create()
            exprs = [op, op.damp(0.1), op.damp(0.1).inv(), op.pow(0.5), 2.0 * op, op + op]
            G = self.gradients()
            if G is not None:
                exprs += [G @ op @ G.T, G @ op]
            for e in exprs:
                assert repr(e) and e._repr_html_() and e.cost() is not None
        assert count.calls == 0, f"building and displaying operators ran {count.calls} forward calls"


class _raises:
    """``with _raises(Error):`` without depending on pytest."""

    def __init__(self, errors):
        self.errors = errors

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            raise AssertionError(f"expected {self.errors} to be raised")
        return issubclass(kind, self.errors)
