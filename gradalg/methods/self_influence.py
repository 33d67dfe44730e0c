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


@method('Self-influence S_zz of any method, without the off-diagonal scores')
def self_influence(method: Callable, task, train, **kwargs) -> SelfScores:
    """``method(task, train, train, **kwargs).diag()``; e.g.
    ``self_influence(ga.methods.influence, task, train, damping=1e-3).compute()``."""
    return method(task, train, train, **kwargs).diag()
