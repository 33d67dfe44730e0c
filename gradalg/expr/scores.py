"""Score nodes: (n_left, n_right) matrices of bilinear forms between gradient sets.

``Inner(L, H, R)``: S_ij = ⟨L_i, H R_j⟩ summed over blocks.
``ScoreSum``: Σ_k c_k S_k (ensembles, checkpoints, differences).
"""
from __future__ import annotations

from abc import abstractmethod

from dataclasses import dataclass

from ..errors import ShapeMismatchError
from .base import Node
from .grads import GradNode
from .operators import Identity, OpNode

__all__ = ["ScoreNode", "Inner", "ScoreSum", "Diagonal"]


class ScoreNode(Node):
    @property
    @abstractmethod
    def shape(self) -> tuple[int, int]:
        """Defined by each node type."""

    @property
    @abstractmethod
    def row_ids(self) -> tuple:
        """Defined by each node type."""

    @property
    @abstractmethod
    def col_ids(self) -> tuple:
        """Defined by each node type."""


@dataclass(frozen=True, eq=False)
class Inner(ScoreNode):
    """S = L H Rᵀ: S_ij = Σ_blocks ⟨L_i, H R_j⟩.   (left.n, right.n)"""

    left: GradNode
    op: OpNode
    right: GradNode

    def __post_init__(self):
        self.left.space.check_same(self.right.space, "the two sides of a score")
        self.left.space.check_same(self.op.space, "the operator and the gradients")
        from .models import check_same_models
        check_same_models(self.left, self.right, "the two sides of a score")
        check_same_models(self.left, self.op, "the operator and the gradients")

    def adjust_rebuild(self, changes: dict) -> dict:
        # I lives on the space of its operands: rebuilt operands (another projection
        # size) take a rebuilt identity
        if isinstance(self.op, Identity) and "op" not in changes and "left" in changes:
            changes = dict(changes, op=Identity(changes["left"].space))
        return changes

    @property
    def shape(self):
        return (self.left.n, self.right.n)

    @property
    def row_ids(self):
        return self.left.ids

    @property
    def col_ids(self):
        return self.right.ids

    @property
    def label(self):
        return "scores" if isinstance(self.op, Identity) else "scores (preconditioned)"


@dataclass(frozen=True, eq=False)
class ScoreSum(ScoreNode):
    """Σ_k coefs[k] · terms[k]; all terms have equal shapes and ids."""

    terms: tuple[ScoreNode, ...]
    coefs: tuple[float, ...]

    def __post_init__(self):
        first = self.terms[0]
        for t in self.terms[1:]:
            if t.shape != first.shape:
                raise ShapeMismatchError(f"cannot add scores of shapes {first.shape} and {t.shape}")
            if t.row_ids != first.row_ids or t.col_ids != first.col_ids:
                raise ShapeMismatchError("cannot add scores over different examples (their ids differ); "
                                         "compute both over the same query and training sets")

    @property
    def shape(self):
        return self.terms[0].shape

    @property
    def row_ids(self):
        return self.terms[0].row_ids

    @property
    def col_ids(self):
        return self.terms[0].col_ids

    @property
    def label(self):
        return "sum of " + ", ".join(f"{c:g}·[{i}]" for i, c in enumerate(self.coefs))


@dataclass(frozen=True, eq=False)
class Diagonal(Node):
    """The diagonal of a square score matrix: d_i = S_ii (self-influence), shape (n,).

    Computed without the off-diagonal entries, streaming both sides in lockstep.
    """

    scores: ScoreNode

    def __post_init__(self):
        if self.scores.row_ids != self.scores.col_ids:
            raise ShapeMismatchError(
                "the diagonal needs the same examples on both sides: build the scores with "
                "the training set as the queries, e.g. method(task, train, train)"
            )

    @property
    def n(self):
        return self.scores.shape[0]

    @property
    def ids(self):
        return self.scores.row_ids

    @property
    def label(self):
        return "diagonal (self-scores)"
