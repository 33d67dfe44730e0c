"""Resolution of :class:`gradalg.expr.spectral.Spectral`: a function of a resolved
operator's eigenvalues, on its own eigenstructure."""
from __future__ import annotations

import torch

from ..curvature.kron import KronOp
from ..errors import GradalgError
from .operators import ResolvedOp

__all__ = ["resolve_spectral"]


def resolve_spectral(inner, fn, what: str):
    """``fn(inner)`` for a resolved K-FAC / EK-FAC (``KronOp``) or explicit (``ResolvedOp``) operator."""
    if isinstance(inner, KronOp):
        return inner._with({k: fn(v.to(torch.float64)).to(v.dtype) for k, v in inner.eigenvalues.items()})
    if isinstance(inner, ResolvedOp):
        return inner._map(lambda values, _what: fn(values.to(torch.float64)), what)
    raise GradalgError(
        f"a function of the eigenvalues of {what} needs its eigendecomposition, but it is known only through "
        f"products ({getattr(inner, 'kind', type(inner).__name__)}): use an explicit curvature "
        "(ga.fisher, ga.kfac, ga.ekfac) instead of ga.hessian / ga.gauss_newton products")
