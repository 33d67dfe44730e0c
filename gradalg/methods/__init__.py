"""Published attribution methods, each a short expression over the gradient algebra.

``ga.methods.list()`` prints the catalogue. Every method returns lazy
:class:`~gradalg.api.Scores` (``.compute()`` to run) with dims (query, train); higher
scores mean the training example helped the query more (removing it would raise the
query's loss).
"""
from __future__ import annotations

from .grad_dot import grad_cos, grad_dot
from .influence import influence
from .trak import trak

CATALOGUE = {
    "grad_dot": "Grad-Dot: ⟨∇L(q), ∇L(z)⟩ (Charpiat et al. 2019)",
    "grad_cos": "Grad-Cos: cosine of ∇L(q) and ∇L(z) (Pruthi et al. 2020; Charpiat et al. 2019)",
    "influence": "Influence function: ∇L(q)ᵀ (H + λI)⁻¹ ∇L(z), H = Gauss-Newton / Fisher (Koh & Liang 2017)",
    "trak": "TRAK: projected output-function gradients, Gauss-Newton inverse, ensemble (Park et al. 2023)",
}


def list() -> dict[str, str]:  # noqa: A001 - ga.methods.list() reads naturally
    """The catalogue ``{name: one-line description}``."""
    return dict(CATALOGUE)


__all__ = ["grad_dot", "grad_cos", "influence", "trak", "list", "CATALOGUE"]
