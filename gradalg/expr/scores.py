"""Score nodes: (n_left, n_right) matrices of bilinear forms between gradient sets.

``Inner(L, H, R)``: S_ij = ⟨L_i, H R_j⟩ summed over blocks.
``ScoreSum``: Σ_k c_k S_k (ensembles, checkpoints, differences).
"""
from __future__ import annotations

from abc import abstractmethod

from dataclasses import dataclass

from ..errors import IdMismatchError, ShapeMismatchError
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
        if self.op.is_identity and "op" not in changes and "left" in changes:
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
        return "scores" if self.op.is_identity else "scores (preconditioned)"


@dataclass(frozen=True, eq=False)
class ScoreSum(ScoreNode):
    """Σ_k coefs[k] · terms[k]; all terms have equal shapes and ids, in the same order
    (other ids, or the same in another order: :class:`~gradalg.errors.IdMismatchError`
    naming them; the sum is taken entry by entry)."""

    terms: tuple[ScoreNode, ...]
    coefs: tuple[float, ...]

    def __post_init__(self):
        first = self.terms[0]
        for k, t in enumerate(self.terms[1:], start=1):
            for dim, mine, theirs in (("query", first.row_ids, t.row_ids), ("train", first.col_ids, t.col_ids)):
                if mine != theirs:
                    raise _id_mismatch(dim, mine, theirs, k)
            if t.shape != first.shape:
                raise ShapeMismatchError(f"cannot add scores of shapes {first.shape} and {t.shape}")

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


def _id_mismatch(dim: str, first: tuple, other: tuple, k: int) -> IdMismatchError:
    """The error for a sum whose term ``k`` has other ``dim`` ids than the first term: a
    lazy sum adds score matrices entry by entry, so their ids must agree, order included."""
    missing, extra, repeated = IdMismatchError.difference(first, other)
    what = IdMismatchError.describe(missing, extra, repeated, "the first scores", f"term {k}", dim)
    if not (missing or extra or repeated):
        what = f"the same {dim} ids in another order (first: {list(first[:5])}, term {k}: {list(other[:5])})"
    return IdMismatchError(
        f"cannot add scores over different {dim} examples: {what}. A sum of lazy scores is taken entry by entry, "
        "so every term must be built over the same data, with the same ids in the same order: build each term "
        "from the same data object (ga.grads(task, data, ids=...) with one ids order); or compute the terms and "
        "align them by id explicitly: a = S1.compute(); b = S2.compute().sel(query=a['query'], "
        "train=a['train']); a + b", dim, missing, extra, repeated)


@dataclass(frozen=True, eq=False)
class Diagonal(Node):
    """The diagonal of a square score matrix: d_i = S_ii (self-influence), shape (n,).

    Computed without the off-diagonal entries, streaming both sides in lockstep.
    """

    scores: ScoreNode

    def __post_init__(self):
        rows, cols = self.scores.row_ids, self.scores.col_ids
        if rows != cols:
            missing, extra, repeated = IdMismatchError.difference(cols, rows)
            what = IdMismatchError.describe(missing, extra, repeated, "the training side", "the query side", "example")
            if not (missing or extra or repeated):
                what = "the same ids in another order"
            raise IdMismatchError(
                f"the diagonal S_ii needs the same examples on both sides, in the same order: {what}. Build the "
                "scores with the training set as the queries, e.g. method(task, train, train) or (G @ G.T).diag()",
                "example", missing, extra, repeated)

    @property
    def n(self):
        return self.scores.shape[0]

    @property
    def ids(self):
        return self.scores.row_ids

    @property
    def label(self):
        return "diagonal (self-scores)"
