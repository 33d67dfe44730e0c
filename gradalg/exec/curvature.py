"""Resolution of operator nodes known through products (Hessian/Gauss-Newton
products, Arnoldi, DataInf) by the local executor. K-FAC and EK-FAC are statistics
of a pass: see :mod:`gradalg.exec.accumulators`."""
from __future__ import annotations

import torch

from ..curvature.hvp import dataset_matvec
from ..curvature.implicit import ImplicitOp, LowRankOp, dense_by_products
from ..curvature.solvers import arnoldi
from ..errors import GradalgError
from ..expr.curvature import Arnoldi, CurvatureProducts, DataInf
from .chunks import flat_block, unflatten

__all__ = ["resolve_curvature"]


def resolve_curvature(executor, node):
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
        return dense_by_products(self)

    def scale(self, c):
        raise GradalgError("DataInf is an inverse already; scale the result instead")

    def nbytes(self):
        return 0


