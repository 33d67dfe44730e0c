"""Self-influence of every training example under any method:

    s_z = S_zz      (the method's score of z on itself)

computed as the diagonal of the method's scores with the training set as the queries,
without the off-diagonal entries (``Scores.diag()``). High self-influence flags
mislabeled or atypical examples (Koh & Liang 2017; Pruthi et al. 2020).
"""
from __future__ import annotations

from typing import Callable

from ..api import SelfScores
from .registry import method
from ..errors import OptionError


@method('Self-influence S_zz of any method, without the off-diagonal scores')
def self_influence(method: Callable, task, train, **kwargs) -> SelfScores:
    """``method(task, train, train, **kwargs).diag()``; e.g.
    ``self_influence(ga.methods.influence, task, train, damping=1e-3).compute()``."""
    if isinstance(method, str):   # a method's name: self_influence("influence", ...)
        import importlib
        methods = importlib.import_module(__package__)   # this package: ga.methods
        CATALOGUE = methods.CATALOGUE
        if method not in CATALOGUE or method == "self_influence":
            raise OptionError(f"no method named {method!r}: pass one of ga.methods ({sorted(CATALOGUE)}) or the "
                              "function itself, e.g. ga.methods.influence")
        method = getattr(methods, method)
    if not callable(method):
        raise OptionError(f"self_influence takes a method (e.g. ga.methods.influence), got {method!r:.80}")
    return method(task, train, train, **kwargs).diag()
