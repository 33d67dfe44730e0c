"""Curvature operator nodes beyond the Fisher: Kronecker (K-FAC / EK-FAC), products
with the Hessian or Gauss-Newton matrix, their Arnoldi low-rank approximation, and
DataInf's closed-form inverse. See :mod:`gradalg.curvature` for the math.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..data import DataRef
from ..space import ParamSpace
from .grads import GradNode
from .operators import OpNode

__all__ = ["KFAC", "CurvatureProducts", "Arnoldi", "DataInf"]


@dataclass(frozen=True, eq=False)
class KFAC(OpNode):
    """K-FAC (``eigen_correction=False``) or EK-FAC (True) of the rows of ``grads``.

    ``grads`` must keep factors (hook capture, optionally Kronecker-projected): the
    statistics are the covariances of activations and output gradients.
    """

    grads: GradNode
    eigen_correction: bool = False

    @property
    def space(self) -> ParamSpace:
        return self.grads.space

    @property
    def structure(self):
        return "kron"

    @property
    def label(self):
        return "ekfac" if self.eigen_correction else "kfac"


@dataclass(frozen=True, eq=False)
class CurvatureProducts(OpNode):
    """H = (1/n) Σ_i ∇²L_i ("hessian") or the Gauss-Newton matrix, known by products.

    Each product with a batch of vectors is one pass over ``data``.
    """

    task: Any
    data: DataRef
    layers: tuple[str, ...]
    kind: str = "hessian"
    space_: ParamSpace | None = None

    @property
    def space(self):
        return self.space_

    @property
    def structure(self):
        return "implicit"

    @property
    def label(self):
        return f"{self.kind} products (n={self.data.n})"


@dataclass(frozen=True, eq=False)
class Arnoldi(OpNode):
    """Top-``rank`` eigen-approximation V diag(μ) Vᵀ of ``op`` (Schioppa et al. 2022)."""

    op: OpNode
    rank: int
    iters: int | None = None
    seed: int = 0

    @property
    def space(self):
        return self.op.space

    @property
    def structure(self):
        return "lowrank"

    @property
    def label(self):
        return f"arnoldi(rank={self.rank})"


@dataclass(frozen=True, eq=False)
class DataInf(OpNode):
    """DataInf's inverse (Kwon et al. 2024), per block b:

        (F_b + λI)⁻¹ ≈ (1/(nλ)) Σ_i (I − g_ib g_ibᵀ / (λ + ‖g_ib‖²))

    the average of the Sherman-Morrison inverses of the per-example rank-one Fishers
    (an approximation that swaps the order of averaging and inversion).
    """

    grads: GradNode
    damping: float

    @property
    def space(self):
        return self.grads.space

    @property
    def structure(self):
        return "implicit"

    @property
    def label(self):
        return f"datainf⁻¹(λ={self.damping:g})"
