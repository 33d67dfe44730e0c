"""Published attribution methods, each a short expression over the gradient algebra.

``ga.methods.list()`` returns the catalogue. Every method returns lazy
:class:`~gradalg.api.Scores` (``.compute()`` to run) with dims (query, train); higher
scores mean the training example helped the query more (removing it would raise the
query's loss). ``self_influence(method, task, train)`` gives any method's diagonal.
"""
from __future__ import annotations

from .ensemble import ensemble
from .grad_dot import grad_cos, grad_dot
from .grass import grass
from .influence import curvature_operator, influence
from .less import less
from .logra import logra
from .magic import MagicScores, magic
from .relatif import relatif
from .self_influence import self_influence
from .source import Segment, segments_of_run, source
from .tracin import tracin
from .trackstar import trackstar
from .trak import trak

CATALOGUE = {
    "grad_dot": "Grad-Dot: ⟨∇L(q), ∇L(z)⟩ (Charpiat et al. 2019)",
    "grad_cos": "Grad-Cos: cosine of ∇L(q) and ∇L(z) (Charpiat et al. 2019; Pruthi et al. 2020)",
    "tracin": "TracIn-CP: Σ_c η_c ⟨∇L(q; θ_c), ∇L(z; θ_c)⟩ over checkpoints (Pruthi et al. 2020); "
              "curvature= preconditions each checkpoint by its own H_c⁻¹",
    "influence": "Influence function ∇L(q)ᵀ(H + λI)⁻¹∇L(z); H: Gauss-Newton, empirical Fisher, Hessian, "
                 "K-FAC, EK-FAC, DataInf; solvers: direct, CG, LiSSA, Arnoldi (Koh & Liang 2017)",
    "trak": "TRAK: projected output-function gradients, Gauss-Newton kernel, ensembles (Park et al. 2023)",
    "logra": "LoGra: Kronecker projection of the factors + EK-FAC in the projected space (Choe et al. 2024)",
    "grass": "GraSS / FactGraSS: mask then sparse JL projection, influence in k dims (Hu et al. 2025)",
    "less": "LESS: Adam-preconditioned, normalized, projected gradients; max over targets (Xia et al. 2024)",
    "trackstar": "TrackStar: Adam-√v̂-corrected, projected, R^{-1/2}-whitened, unit-normalized gradients "
                 "(Chang et al. 2024)",
    "relatif": "RelatIF: influence divided by √(self-influence) of the training example (Barshan et al. 2020)",
    "magic": "MAGIC: exact metagradients −∂f_q/∂ε_i through a replayed training run (Ilyas & Engstrom 2025)",
    "source": "SOURCE: segment-wise approximate unrolling with (EK-)FAC per segment (Bae et al. 2024)",
    "self_influence": "Self-influence S_zz of any method, without the off-diagonal scores",
}


#: combinators over the methods above (not methods themselves: they take one)
COMBINATORS = {
    "ensemble": "any method averaged over models / seeds / checkpoints, one expression (TRAK-M, influence ensembles)",
    "self_influence": "the diagonal S_zz of any method",
}
"""Combinators ``{name: description}``: they take a method and return its scores
averaged (``ensemble``) or its diagonal (``self_influence``)."""


def list() -> dict[str, str]:  # noqa: A001 - ga.methods.list() reads naturally
    """The catalogue ``{name: one-line description}``."""
    return dict(CATALOGUE)


__all__ = ["grad_dot", "grad_cos", "tracin", "trackstar", "ensemble", "influence", "curvature_operator", "trak",
           "logra", "grass", "less", "relatif", "self_influence", "magic", "MagicScores", "source", "Segment",
           "segments_of_run", "list", "CATALOGUE", "COMBINATORS"]
