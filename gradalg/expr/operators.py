"""Operator nodes: symmetric linear maps on a :class:`ParamSpace`.

``structure`` tells the executor how the operator is stored once resolved:

``identity``  I
``diag``      a vector v: H = diag(v)
``block``     one (d_b, d_b) matrix per block (block-diagonal across layers)
``dense``     one (dim, dim) matrix over the whole space

Algebra: ``A + B``, ``c * A``, ``A.damp(λ) = A + λI``, ``A.inv()``, ``A.pow(p)``. The
structure of a result is the coarsest of its operands' (dense ⊃ block ⊃ diag ⊃ identity).
"""
from __future__ import annotations

from abc import abstractmethod

from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..errors import ShapeMismatchError
from ..space import ParamSpace
from .base import Node
from .grads import GradNode

__all__ = ["OpNode", "Identity", "Diagonal", "Dense", "Fisher", "Damp", "Inverse", "Power",
           "ScaledOp", "SumOp", "coarsest"]

_ORDER = ("identity", "diag", "kron", "lowrank", "block", "dense", "implicit")


def coarsest(*structures: str) -> str:
    return max(structures, key=_ORDER.index)


class OpNode(Node):
    """Base of operator nodes."""

    @property
    @abstractmethod
    def space(self) -> ParamSpace:
        """Defined by each node type."""

    @property
    @abstractmethod
    def structure(self) -> str:
        """Defined by each node type."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.space.dim, self.space.dim)


@dataclass(frozen=True, eq=False)
class Identity(OpNode):
    """I on ``space``."""

    space_: ParamSpace

    @property
    def space(self):
        return self.space_

    @property
    def structure(self):
        return "identity"

    @property
    def label(self):
        return "I"


@dataclass(frozen=True, eq=False)
class Diagonal(OpNode):
    """diag(values), values: (dim,)."""

    values: torch.Tensor
    space_: ParamSpace
    #: what the values are ("weight decay per coordinate from SGD param_groups"); display only
    note: str = field(default="", metadata={"identity": False})

    def __post_init__(self):
        if tuple(self.values.shape) != (self.space_.dim,):
            raise ShapeMismatchError(f"Diagonal values have shape {tuple(self.values.shape)}; "
                                     f"the space has {self.space_.dim} coordinates: pass a ({self.space_.dim},) tensor")

    @property
    def space(self):
        return self.space_

    @property
    def structure(self):
        return "diag"

    @property
    def label(self):
        return f"diag({self.space.dim}) [{self.note}]" if self.note else f"diag({self.space.dim})"


@dataclass(frozen=True, eq=False)
class Dense(OpNode):
    """A given symmetric (dim, dim) matrix, in the order of the space's blocks."""

    matrix: torch.Tensor
    space_: ParamSpace

    def __post_init__(self):
        d = self.space_.dim
        if tuple(self.matrix.shape) != (d, d):
            raise ShapeMismatchError(f"Dense matrix has shape {tuple(self.matrix.shape)}; the space "
                                     f"has {d} coordinates: pass a ({d}, {d}) matrix")

    @property
    def space(self):
        return self.space_

    @property
    def structure(self):
        return "dense"

    @property
    def label(self):
        return f"dense({self.space.dim}×{self.space.dim})"


@dataclass(frozen=True, eq=False)
class Fisher(OpNode):
    """F = (1/n) Σ_i g_i g_iᵀ over the rows of ``grads`` (empirical Fisher of its targets).

    With gradients of labels sampled from the model (``ga.grads(..., targets="sampled")``)
    this is the Monte-Carlo true Fisher, which equals the Gauss-Newton matrix for
    cross-entropy and squared-error losses. ``structure``: "dense", "block" or "diag".
    """

    grads: GradNode
    structure_: str = "dense"

    def __post_init__(self):
        if self.structure_ not in ("dense", "block", "diag"):
            raise ValueError(f"Fisher structure must be 'dense', 'block' or 'diag', got {self.structure_!r}")

    @property
    def space(self):
        return self.grads.space

    @property
    def structure(self):
        return self.structure_

    @property
    def label(self):
        return f"fisher[{self.structure_}]"


@dataclass(frozen=True, eq=False)
class Damp(OpNode):
    """op + λ I; with ``relative``, λ = damping · tr(op)/dim (a multiple of the mean
    eigenvalue, known only once op is computed: scale-free)."""

    op: OpNode
    damping: float
    relative: bool = False
    #: where λ came from ("weight_decay=0.01 from AdamW param_groups"), shown in the label;
    #: not part of the node's identity
    note: str = field(default="", metadata={"identity": False})

    @property
    def space(self):
        return self.op.space

    @property
    def structure(self):
        return coarsest(self.op.structure, "diag")

    @property
    def label(self):
        text = f"damp(λ={self.damping:g}·mean eig)" if self.relative else f"damp(λ={self.damping:g})"
        return f"{text} [{self.note}]" if self.note else text


@dataclass(frozen=True, eq=False)
class Inverse(OpNode):
    """op⁻¹, by structure: 1/v for a diagonal, eigendecomposition of a dense or block
    matrix, inverted eigenvalues for Kronecker and low-rank operators, and an iterative
    solver (``method`` "cg" or "lissa", with ``settings``) for operators known only
    through products."""

    op: OpNode
    method: str = "auto"
    settings: tuple = ()

    def __post_init__(self):
        if self.method not in ("auto", "cg", "lissa"):
            raise ValueError(f"inverse method must be 'auto', 'cg' or 'lissa', got {self.method!r}")

    @property
    def space(self):
        return self.op.space

    @property
    def structure(self):
        return self.op.structure

    @property
    def label(self):
        return "inverse" if self.method == "auto" else f"inverse ({self.method})"


@dataclass(frozen=True, eq=False)
class Power(OpNode):
    """op^p for a symmetric positive semi-definite op (eigendecomposition)."""

    op: OpNode
    p: float

    @property
    def space(self):
        return self.op.space

    @property
    def structure(self):
        return self.op.structure

    @property
    def label(self):
        return f"pow({self.p:g})"


@dataclass(frozen=True, eq=False)
class ScaledOp(OpNode):
    """c · op."""

    op: OpNode
    scale: float

    @property
    def space(self):
        return self.op.space

    @property
    def structure(self):
        return coarsest(self.op.structure, "diag")

    @property
    def label(self):
        return f"{self.scale:g} ·"


@dataclass(frozen=True, eq=False)
class SumOp(OpNode):
    """Σ ops (all on one space)."""

    ops: tuple[OpNode, ...]

    def __post_init__(self):
        for op in self.ops[1:]:
            self.ops[0].space.check_same(op.space, "operators in a sum")

    @property
    def space(self):
        return self.ops[0].space

    @cached_property
    def structure(self):
        return coarsest(*(op.structure for op in self.ops))

    @property
    def label(self):
        return "sum"


