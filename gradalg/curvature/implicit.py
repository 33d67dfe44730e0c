"""Operators known only through products (``H V`` by passes over data), their iterative
inverses and low-rank (Arnoldi) approximations. The classes live on the operator floor
(:mod:`gradalg.linalg`); this module names them for the curvature code.

``ImplicitOp``   c·H + λI through ``matvec``; ``inverse()`` returns a solver-backed op
``SolvedOp``     (c·H + λI)⁻¹ applied by CG or LiSSA, one pass over data per iteration
``LowRankOp``    V diag(μ) Vᵀ on H's top-r eigenspace (Arnoldi); its algebra stays on the
                 subspace, as in Schioppa et al. (2022)
"""
from __future__ import annotations

import torch

from ..linalg.implicit import ImplicitOp, SolvedOp
from ..linalg.lowrank import LowRankOp

__all__ = ["ImplicitOp", "SolvedOp", "LowRankOp", "dense_by_products"]


def dense_by_products(op) -> torch.Tensor:
    """The full (dim, dim) matrix of an operator known by products: dim of them, so for
    tests and small spaces only."""
    eye = torch.eye(op.space.dim, dtype=torch.float64)
    return op.apply(eye).T
