"""Walks of an expression the planner's stages share: row-wise chains, their stream roots
and operators, the pass a node's rows are read in."""
from __future__ import annotations

from ..expr import Captured, GradNode, Inner, OpNode, RowWise, ScoreNode, ScoreSum, Source
from .jobs import EKFACJob, FisherJob, KFACJob
from .rules import PlanError

__all__ = ["ROW_WISE", "CONV_KINDS", "STATISTICS_JOBS", "stream_root", "chain_ops", "chain_contains",
           "flat_terms", "pass_key"]

ROW_WISE = RowWise      # the nodes a pass derives chunk by chunk (the row-wise protocol)
#: block kinds whose positions per example depend on the layer (unfolded convolutions)
#: rather than on the data's token length
CONV_KINDS = ("conv1d_nn", "conv2d", "conv3d")
#: the job class of each statistics kind an operator asks for (``Statistic.job``)
STATISTICS_JOBS = {cls.kind: cls for cls in (FisherJob, KFACJob, EKFACJob)}


def stream_root(node: GradNode) -> GradNode:
    """The node whose chunks a pass iterates to produce ``node`` row by row."""
    while isinstance(node, ROW_WISE):
        node = node.grads
    return node


def chain_ops(node: GradNode) -> list[OpNode]:
    """Operators used by the row-wise chain from ``node`` down to its stream root (the
    operator operands of each of its nodes: a preconditioner, a normalization's metric)."""
    ops = []
    while isinstance(node, ROW_WISE):
        ops.extend(c for c in node.children if isinstance(c, OpNode))
        node = node.grads
    return ops


def chain_contains(stream: GradNode, node: GradNode) -> bool:
    """Whether ``node`` is ``stream`` or a node of its row-wise chain."""
    x = stream
    while x.token != node.token:
        if not isinstance(x, ROW_WISE):
            return False
        x = x.grads
    return True


def flat_terms(node: ScoreNode) -> list[tuple[float, Inner]]:
    """[(coef, Inner)] of a score expression, sums flattened."""
    if isinstance(node, ScoreSum):
        return [(c * c2, t2) for c, t in zip(node.coefs, node.terms) for c2, t2 in flat_terms(t)]
    if not isinstance(node, Inner):
        raise PlanError(f"cannot plan scores of {type(node).__name__}")
    return [(1.0, node)]


def pass_key(node: GradNode, stored, facts) -> tuple:
    """The key of the pass that reads ``node``'s rows: ``("memory", token)`` for rows kept
    in memory (``stored`` tokens, a group mean's), ``("captured", token)``, or
    ``("data", task token, data token, task name, n)`` for a read of a dataset."""
    x = node
    while True:
        if x.token in stored:
            return ("memory", x.token)
        if not isinstance(x, ROW_WISE):
            break
        x = x.grads
    if isinstance(x, Source):
        return ("data", facts.task_token(x), x.data.token, x.task.name, x.data.n)
    if isinstance(x, Captured):
        return ("captured", x.token)
    return ("memory", x.token)  # GroupMean, filled by its group job
