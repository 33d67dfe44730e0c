"""Published attribution methods, each a short expression over the gradient algebra.

``ga.methods.list()`` returns the catalogue, read from :data:`REGISTRY`: a method is one
file here whose function is decorated with :func:`method` (docs/contributing.md, "A
method"). Every method returns lazy :class:`~gradalg.api.Scores` (``.compute()`` to run)
with dims (query, train); higher
scores mean the training example helped the query more (removing it would raise the
query's loss). ``self_influence(method, task, train)`` gives any method's diagonal.
"""
from __future__ import annotations

import importlib
import pkgutil

# the catalogue's order: each module registers its methods (``@method``, registry.py) on import
from .grad_dot import grad_cos, grad_dot
from .tracin import tracin
from .influence import curvature_operator, influence
from .trak import trak
from .logra import logra
from .grass import grass
from .less import less
from .trackstar import trackstar
from .relatif import relatif
from .magic import MagicScores, magic
from .source import Segment, segments_of_run, source
from .self_influence import self_influence
from .ensemble import ensemble
from .centre import newton_centre
from .perturbed import perturbed
from .registry import REGISTRY, Method, method

# a new method is one file: every module of the package is imported, so its @method registers it
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f".{_module.name}", __name__)
for _name, _entry in REGISTRY.items():
    globals()[_name] = _entry.fn          # the function, not the module of the same name

#: the catalogue ``{name: one-line description}`` of every registered method (REGISTRY)
CATALOGUE = {name: entry.summary for name, entry in REGISTRY.items()}


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


__all__ = [*REGISTRY, "ensemble", "newton_centre", "perturbed", "curvature_operator", "MagicScores", "Segment", "segments_of_run",
           "list", "CATALOGUE", "COMBINATORS", "REGISTRY", "Method", "method"]
