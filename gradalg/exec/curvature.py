"""Resolution of curvature operator nodes (K-FAC, EK-FAC, Hessian/Gauss-Newton
products, Arnoldi, DataInf) by the local executor."""
from __future__ import annotations

import torch

from ..capture.factors import Factors
from ..curvature.hvp import dataset_matvec
from ..curvature.implicit import ImplicitOp, LowRankOp
from ..curvature.kron import KronOp, KronStats, kron_eigenbasis, rotate_factors
from ..curvature.solvers import arnoldi
from ..errors import GradalgError
from ..expr.curvature import KFAC, Arnoldi, CurvatureProducts, DataInf
from .chunks import flat_block, unflatten

__all__ = ["resolve_curvature"]


def resolve_curvature(executor, node):
    if isinstance(node, KFAC):
        return _kfac(executor, node)
    if isinstance(node, CurvatureProducts):
        matvec = dataset_matvec(node.task, node.data, node.layers, kind=node.kind,
                                batch_size=executor.options.batch_size)
        return ImplicitOp(node.space, matvec)
    if isinstance(node, Arnoldi):
        inner = executor.resolve(node.op)
        dtype = torch.float64
        evals, vecs = arnoldi(lambda V: inner.apply(V.to(dtype)), node.space.dim, node.rank,
                              iters=node.iters, seed=node.seed, dtype=dtype)
        return LowRankOp(node.space, evals, vecs)
    if isinstance(node, DataInf):
        return _DataInfOp(executor, node)
    raise TypeError(f"not a curvature node: {type(node).__name__}")


def _kfac(executor, node: KFAC) -> KronOp:
    space = node.space
    stats = {name: KronStats() for name in space.names}
    for chunk in executor.iter_chunks(node.grads):
        for name in space.names:
            value = chunk.blocks[name]
            if not isinstance(value, Factors):
                raise GradalgError(
                    f"K-FAC needs factored gradients, but block {name!r} is {node.grads.representation[name]}: "
                    "apply ga.kfac to gradients from ga.grads (hook backend), optionally projected with "
                    "ga.proj.kron, not to normalized-then-dense or gaussian-projected ones"
                )
            stats[name].update(value)
    bases, eigenvalues = {}, {}
    for name in space.names:
        stats[name].examples = node.grads.n  # rows may repeat examples (objective="expected")
        S, A = stats[name].covariances()
        Q_S, lam_S, Q_A, lam_A = kron_eigenbasis(S, A)
        bases[name] = (Q_S, Q_A)
        eigenvalues[name] = torch.outer(lam_S, lam_A)
    if node.eigen_correction:
        sums = {name: torch.zeros_like(eigenvalues[name]) for name in space.names}
        for chunk in executor.iter_chunks(node.grads):
            for name in space.names:
                Q_S, Q_A = bases[name]
                sums[name] += (rotate_factors(chunk.blocks[name], Q_S, Q_A) ** 2).sum(0)
        eigenvalues = {name: s / node.grads.n for name, s in sums.items()}
    return KronOp(space, bases, eigenvalues)


class _DataInfOp:
    """Applies DataInf's inverse to rows with one pass over the training gradients.

    For each block b and query row q:
        H⁻¹q = (1/λ) (q − (1/n) Σ_i g_i (g_iᵀ q) / (λ + ‖g_i‖²))
    """

    kind = "implicit"

    def __init__(self, executor, node: DataInf):
        self.executor = executor
        self.node = node
        self.space = node.space

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        lam = self.node.damping
        if lam <= 0:
            raise GradalgError("DataInf needs a positive damping λ")
        q = unflatten(rows, self.space)
        acc = {name: torch.zeros_like(v) for name, v in q.items()}
        n = 0
        for chunk in self.executor.iter_chunks(self.node.grads):
            n += chunk.n
            for name in self.space.names:
                g = flat_block(chunk.blocks[name]).to(rows.dtype)      # (c, d_b)
                coef = (q[name] @ g.T) / (lam + (g * g).sum(1))        # (m, c)
                acc[name] += coef @ g
        out = {name: (q[name] - acc[name] / n) / lam for name in self.space.names}
        return torch.cat([out[name] for name in self.space.names], dim=1)

    def dense(self) -> torch.Tensor:
        return self.apply(torch.eye(self.space.dim, dtype=torch.float64)).T

    def scale(self, c):
        raise GradalgError("DataInf is an inverse already; scale the result instead")

    def nbytes(self):
        return 0


