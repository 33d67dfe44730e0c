"""Resolution of operator nodes known through products (Hessian/Gauss-Newton
products, Arnoldi, DataInf) by the local executor. K-FAC and EK-FAC are statistics
of a pass: see :mod:`gradalg.exec.accumulators`."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..curvature.hvp import dataset_matvec
from ..errors import GradalgError
from ..expr.curvature import Arnoldi, CurvatureProducts, DataInf
from ..linalg import ImplicitOp, LinearOp, LowRankOp
from ..linalg.solvers import arnoldi
from ..capture.chunks import flat_block, unflatten

__all__ = ["resolve_curvature", "DataInfOp"]


def resolve_curvature(executor, node):
    if isinstance(node, CurvatureProducts):
        matvec = dataset_matvec(node.task, node.data, node.layers, kind=node.kind,
                                batch_size=executor.options.batch_size)
        # the Gauss-Newton matrix is PSD; the Hessian need not be
        return ImplicitOp(node.space, matvec, tags=frozenset({"psd"}) if node.kind != "hessian" else frozenset())
    if isinstance(node, Arnoldi):
        inner = executor.resolve(node.op)
        dtype = torch.float64
        evals, vecs = arnoldi(lambda V: inner.apply(V.to(dtype)), node.space.dim, node.rank,
                              iters=node.iters, seed=node.seed, dtype=dtype)
        return LowRankOp(node.space, evals, vecs, inner.tags & {"psd"})
    if isinstance(node, DataInf):
        return DataInfOp(node.space, executor, node)
    raise TypeError(f"not a curvature node: {type(node).__name__}")


@dataclass
class DataInfOp(LinearOp):
    """Applies DataInf's inverse to rows with one pass over the training gradients.

    For each block b and query row q (times ``coef``):
        H⁻¹q = (1/λ) (q − (1/n) Σ_i g_i (g_iᵀ q) / (λ + ‖g_i‖²))

    An approximate inverse known only by this closed form (labels ``implicit``,
    ``approximate-inverse``): damping, inverting or powers of it are refused.
    """

    space: object
    executor: object
    node: DataInf
    coef: float = 1.0
    tags: frozenset = frozenset({"approximate-inverse", "psd"})
    rules: tuple = ()

    form = "implicit"
    kind = "implicit"

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        lam = self.node.damping
        if lam <= 0:
            raise GradalgError("DataInf needs a positive damping λ: ga.datainf(G, damping=λ) with λ > 0")
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
        return self.coef * torch.cat([out[name] for name in self.space.names], dim=1)

    def _scale(self, c: float) -> "DataInfOp":
        return replace(self, coef=self.coef * c)
