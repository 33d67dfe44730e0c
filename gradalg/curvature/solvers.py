"""Iterative solvers on matrix-vector products: they live on the operator floor,
:mod:`gradalg.linalg.solvers` (re-exported here for the curvature code)."""
from ..linalg.solvers import arnoldi, conjugate_gradient, lissa

__all__ = ["conjugate_gradient", "lissa", "arnoldi"]
