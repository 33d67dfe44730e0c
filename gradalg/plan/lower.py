"""Stage 1 of planning, **lower**: ``lower(root, topk)`` → :class:`Lowered`, what the
simplified expression asks the passes for (scores, a top-k, self-scores, rows, operator
statistics) and its score terms, sums flattened; nothing is sized or chosen, and what the
planner cannot run is refused here. Also the walks of an expression the stages share.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ObjectiveError
from ..expr import Captured, GradNode, Inner, Node, OpNode, RowWise, ScoreDiagonal, ScoreNode, ScoreSum, Source
from ..expr.windows import chain, stream_root
from .jobs import EKFACJob, FisherJob, GroupJob, KFACJob, ProductsJob, TopK
from .passkeys import CapturedPassKey, DataPassKey, MemoryPassKey, PassKey
from .rules import PlanError

__all__ = ["Lowered", "lower", "ROW_WISE", "STATISTICS_JOBS", "chain", "stream_root", "chain_ops",
           "chain_contains", "flat_terms", "pass_key"]

ROW_WISE = RowWise      # the nodes a pass derives chunk by chunk (the row-wise protocol)
#: the job class of each statistics kind an operator or a gradient node asks for (``Statistic.job``)
STATISTICS_JOBS = {cls.kind: cls for cls in (FisherJob, KFACJob, EKFACJob, ProductsJob, GroupJob)}


def chain_ops(node: GradNode) -> list[OpNode]:
    """Operators used by the row-wise chain from ``node`` down to its stream root (the
    operator operands of each of its nodes: a preconditioner, a normalization's metric)."""
    return [c for x in chain(node) if isinstance(x, ROW_WISE) for c in x.children if isinstance(c, OpNode)]


def chain_contains(stream: GradNode, node: GradNode) -> bool:
    """Whether ``node`` is ``stream`` or a node of its row-wise chain."""
    return any(x.token == node.token for x in chain(stream))


def flat_terms(node: ScoreNode) -> list[tuple[float, Inner]]:
    """[(coef, Inner)] of a score expression, sums flattened."""
    if isinstance(node, ScoreSum):
        return [(c * c2, t2) for c, t in zip(node.coefs, node.terms) for c2, t2 in flat_terms(t)]
    if not isinstance(node, Inner):
        raise PlanError(f"cannot plan scores of {type(node).__name__}")
    return [(1.0, node)]


def pass_key(node: GradNode, stored, facts) -> PassKey:
    """The key of the pass that reads ``node``'s rows (:mod:`~gradalg.plan.passkeys`):
    :class:`MemoryPassKey` for rows kept in memory (``stored`` tokens, a group mean's),
    :class:`CapturedPassKey`, or :class:`DataPassKey` for a read of a dataset."""
    for x in chain(node):
        if x.token in stored:
            return MemoryPassKey(x.token)
    if isinstance(x, Source):
        return DataPassKey(facts.task_token(x), x.data.token, x.task.name, x.data.n)
    if isinstance(x, Captured):
        return CapturedPassKey(x.token)
    return MemoryPassKey(x.token)  # GroupMean, filled by its group job


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
    if any(isinstance(r, Source) and r.objective == "expected" for r in map(stream_root, (inner.left, inner.right))):
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
