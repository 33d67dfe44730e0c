"""Curvature operator nodes beyond the Fisher: Kronecker (K-FAC / EK-FAC), products
with the Hessian or Gauss-Newton matrix, their Arnoldi low-rank approximation, and
DataInf's closed-form inverse. See :mod:`gradalg.curvature` for the math.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..data import DataRef
from ..space import ParamSpace
from .grads import GradNode, first_examples
from .operators import OpNode

__all__ = ["KFAC", "CurvatureProducts", "Arnoldi", "DataInf"]


@dataclass(frozen=True, eq=False)
class KFAC(OpNode):
    """K-FAC (``eigen_correction=False``) or EK-FAC (True) of the rows of ``grads``.

    ``grads`` must keep factors (hook capture, optionally Kronecker-projected): the
    statistics are the covariances of activations and output gradients.

    Per block, with A_i (T, in) and D_i (T, out) the factors of example i:

        A = (1/n_c) Σ_{i<n_c} A_iᵀA_i,   S = (1/n_c) Σ_{i<n_c} D_iᵀD_i     (covariances)
        Λ = (1/n_λ) Σ_{i<n_λ} (Q_Sᵀ G_i Q_A)²                             (EK-FAC's eigenvalues)

    over the first ``n_c = covariance_max_examples`` and ``n_λ = lambda_max_examples``
    examples of ``grads`` (None: all ``n``; Kronfluence's ``FactorArguments`` options of
    the same names). Both are part of the node's identity, and the node holds them only
    below ``n`` (``ga.kfac`` stores a larger value as None), so equal statistics are one node.
    """

    grads: GradNode
    eigen_correction: bool = False
    covariance_max_examples: int | None = None
    lambda_max_examples: int | None = None

    @property
    def space(self) -> ParamSpace:
        return self.grads.space

    @property
    def structure(self):
        return "kron"

    @cached_property
    def covariance_grads(self) -> GradNode:
        """The rows the Kronecker covariances are estimated from (the first
        ``covariance_max_examples`` examples of ``grads``)."""
        return first_examples(self.grads, self.covariance_max_examples)

    @cached_property
    def lambda_grads(self) -> GradNode:
        """The rows EK-FAC's eigenvalue correction is estimated from (the first
        ``lambda_max_examples`` examples of ``grads``)."""
        return first_examples(self.grads, self.lambda_max_examples)

    def subset_notes(self) -> list[str]:
        """What each statistic is estimated on, when not on every example:
        ``["covariances: first 100 of 1,000 examples", ...]`` (shown by ``explain()``)."""
        n, out = self.grads.n, []
        if self.covariance_max_examples is not None:
            out.append(f"covariances: first {self.covariance_max_examples:,} of {n:,} examples")
        if self.eigen_correction and self.lambda_max_examples is not None:
            out.append(f"eigenvalue correction: first {self.lambda_max_examples:,} of {n:,} examples")
        return out

    @property
    def label(self):
        name = "ekfac" if self.eigen_correction else "kfac"
        notes = self.subset_notes()
        return f"{name} ({'; '.join(notes)})" if notes else name


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
