"""Stage 1 of planning, **lower**: what the simplified expression asks the passes for.

``lower(root, topk)`` → :class:`Lowered`: the kind of result (``scores``, ``topk``,
``diag``, ``rows`` of a gradient node, ``operator`` statistics) and, for scores, their
``Inner`` terms with their coefficients (sums flattened). No size is read and nothing is
chosen; an expression the planner cannot run is refused here.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ObjectiveError
from ..expr import GradNode, Inner, Node, OpNode, ScoreDiagonal, ScoreNode, Source
from .graph import flat_terms, stream_root
from .jobs import TopK
from .rules import PlanError

__all__ = ["Lowered", "lower"]


@dataclass(frozen=True)
class Lowered:
    """The result a plan computes. ``terms``: ``((coef, Inner), ...)`` of a score or
    self-score expression (empty otherwise); ``topk``: the top-k asked for, if any."""

    root: Node
    result: str                 # "scores" | "topk" | "diag" | "rows" | "operator"
    terms: tuple = ()
    topk: TopK | None = None

    def describe(self) -> str:
        head = f"{self.result} of {self.root.label}" + (f" (top-{self.topk.k})" if self.topk else "")
        return "\n".join([head] + [f"  {c:g} × {t.label}" for c, t in self.terms])


def _check_objective(inner: Inner) -> None:
    roots = [stream_root(side) for side in (inner.left, inner.right)]
    if any(isinstance(r, Source) and r.objective == "expected" for r in roots):
        raise ObjectiveError("gradients with objective='expected' have one row per term of the "
                             "Gauss-Newton decomposition, not per example: use them for curvature "
                             "(ga.fisher, ga.kfac) only, and score with objective='loss' (the default) "
                             "or 'sampled' gradients")


def lower(root: Node, topk: TopK | None = None) -> Lowered:
    """The :class:`Lowered` record of the simplified expression ``root``."""
    if topk is not None and not isinstance(root, ScoreNode):
        raise PlanError(f"a top-k is taken of scores, not of a {type(root).__name__}")
    if isinstance(root, ScoreNode):
        terms = tuple(flat_terms(root))
        result = "topk" if topk is not None else "scores"
    elif isinstance(root, ScoreDiagonal):
        try:
            terms = tuple(flat_terms(root.scores))
        except PlanError:
            raise PlanError(f"cannot plan the diagonal of {type(root.scores).__name__}") from None
        result = "diag"
    elif isinstance(root, (GradNode, OpNode)):
        terms, result = (), "rows" if isinstance(root, GradNode) else "operator"
    else:
        raise PlanError(f"cannot plan a {type(root).__name__}")
    for _, inner in terms if result != "diag" else ():
        _check_objective(inner)
    return Lowered(root, result, terms, topk)
