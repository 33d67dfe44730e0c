"""Operator nodes: symmetric linear maps on a :class:`ParamSpace`, and their protocol.

Every operator node implements four plain methods (abstract on :class:`OpNode`, so a
node type that forgets one cannot be built); the planner and the executors only call
them, they never ask a node's type:

``labels()``                   its structure once resolved, in the one vocabulary of
                               :mod:`gradalg.linalg.labels` (a :class:`~gradalg.linalg.Labels`:
                               labels, the named rules resolving it applies, its eigenbasis);
                               an operation its structure cannot do raises the rule's refusal
``statistics()``               the statistics it needs computed over data before it
                               resolves (:class:`Statistic`: a job of the plan per statistic)
``resolve(ctx)``               its numbers, a :class:`~gradalg.linalg.LinearOp`, asking the
                               executor only through ``ctx`` (:class:`ResolveContext`)
``apply_cost(space, n, prices)``  the cost of applying the resolved operator to n rows of
                               ``space``, priced with ``prices``
                               (:class:`gradalg.plan.estimates.OperatorPrices`)

Algebra: ``A + B``, ``c * A``, ``A.damp(λ) = A + λI``, ``A.inv()``, ``A.pow(p)``; each
wrapper's labels follow from its operand's by the named rules (``Labels.damp`` ...), the
same rules the resolved operators apply. ``structure`` is the one-word name of the labels
(:func:`~gradalg.linalg.labels.short_name`: "identity", "diag", "block", "dense", "kron",
"lowrank", "implicit"). Writing a new operator: ``docs/contributing.md``.
"""
from __future__ import annotations

import functools
from abc import abstractmethod
from dataclasses import dataclass, field, replace
from functools import reduce
from typing import Any, Callable, Iterable, Protocol

import torch

from ..errors import OperatorError, OptionError, ShapeMismatchError
from ..linalg import Labels, LinearOp, ResolvedOp
from ..linalg.labels import from_short, short_name
from ..linalg.solvers import iteration_bound
from ..space import ParamSpace
from .base import Node
from .grads import GradNode

__all__ = ["OpNode", "Statistic", "ProductCalls", "ResolveContext", "Identity", "Diagonal", "Dense", "Fisher", "Damp", "AutoDamp", "Inverse",
           "Power", "ScaledOp", "SumOp"]


@dataclass(frozen=True)
class ProductCalls:
    """One group of a products statistic's calls: ``calls`` calls at most, each the products of
    H with ``vectors`` rows (None: the rows the operator is applied to), ``why`` the setting
    that bounds them (a solver's iterations, a formation's ⌈dim/chunk⌉, a probe's steps), ``dtype`` the
    vectors' as the caller passes them (a formation's and Arnoldi's and a Lanczos probe's float64 columns:
    what the products pass holds of V; None: the curvature's parameters' dtype, the products' own),
    ``held`` the bytes the caller keeps beside each call (a formation's d × d float64 rows, 8·d²: in the
    products pass's fixed bytes, where they are live while the products run)."""

    calls: int = 1
    vectors: int | None = None
    why: str = ""
    dtype: torch.dtype | None = None
    held: float = 0.0

    def solved(self, calls: int, why: str, vectors: int | None = None, dtype: torch.dtype | None = None,
               held: float = 0.0) -> "ProductCalls":
        """Each of these calls made ``calls`` times by a solver (``why``), on ``vectors`` rows of
        ``dtype`` (None: as before), beside the solver's ``held`` bytes (and the caller's own)."""
        return ProductCalls(self.calls * calls, self.vectors if vectors is None else vectors,
                            f"{why} × {self.why}" if self.why else why, dtype or self.dtype, self.held + held)


@dataclass(frozen=True)
class Statistic:
    """A statistic an operator needs before it resolves: the plan's job of kind ``job``
    (``"fisher"``, ``"kfac"``, ``"ekfac"``: :mod:`gradalg.plan.jobs`) accumulates it for
    ``node`` over the rows ``rows``, after the statistics ``after``. ``job=None``: no job
    of its own, the operator reads ``rows`` itself when applied, so only the statistics
    those rows need must be ready; ``job="apply"``: the same, except that applied to a
    score's held rows that read is a job of the plan (DataInf: :mod:`gradalg.plan.jobs.apply`);
    ``job="products"``: products with the loss curvature over raw batches of its data
    (``rows`` None: no gradient rows are read), a pass run once per call, its calls in
    ``groups`` (:class:`ProductCalls`: ``calls`` at most on ``vectors`` rows each, e.g. an
    iterative solver's iteration bound on one vector, :meth:`Inverse.statistics`,
    :meth:`~gradalg.expr.curvature.Arnoldi.statistics`; a near-minimum probe's one-vector calls
    beside a formation's 256-vector ones, :meth:`~gradalg.expr.curvature.NearMinimum.statistics`),
    each group priced at its own vectors (:mod:`gradalg.plan.jobs.products`);
    ``job="group"``: a gradient node's rows made by a job before a pass reads them (``node``
    a :class:`~gradalg.expr.GroupMean`, :meth:`GradNode.statistics`)."""

    job: str | None
    node: "OpNode | GradNode"
    rows: GradNode | None
    after: tuple = ()
    groups: tuple[ProductCalls, ...] = (ProductCalls(),)

    @property
    def calls(self) -> int:
        """The calls of every group: Σ calls."""
        return sum(g.calls for g in self.groups)

    @property
    def calls_why(self) -> str:
        """The groups' settings, `` + ``-joined."""
        return " + ".join(g.why for g in self.groups if g.why)

    @property
    def vectors(self) -> int | None:
        """The most vectors of a call (None where a group's are the rows the operator is applied to)."""
        if any(g.vectors is None for g in self.groups):
            return None
        return max(g.vectors for g in self.groups)

    def solved(self, calls: int, why: str, vectors: int | None = None, dtype: torch.dtype | None = None) -> "Statistic":
        """This statistic inside an iterative solver of ``calls`` iterations at most
        (``why``: the solver's setting; ``dtype``: its vectors', :class:`ProductCalls`): a products
        statistic's calls multiply, group by group (:meth:`ProductCalls.solved`), any other statistic
        is computed once."""
        return self.solved_in(((calls, vectors),), why, dtype)

    def solved_in(self, parts: tuple[tuple[int, int | None], ...], why: str,
                  dtype: torch.dtype | None = None, held: float = 0.0) -> "Statistic":
        """:meth:`solved` by a solver whose calls come in ``parts`` ``((calls, vectors), ...)`` (a
        formation's ⌊dim/chunk⌋ calls of ``chunk`` vectors and one of the rest), on vectors of
        ``dtype``, beside the solver's ``held`` bytes: each group of calls once per part, in order."""
        if self.job != "products":
            return self
        return replace(self, groups=tuple(g.solved(calls, why, vectors, dtype, held) for calls, vectors in parts
                                          for g in self.groups))

    def preceded(self, group: ProductCalls) -> "Statistic":
        """This products statistic with the calls of ``group`` made first (a probe before a
        formation): a group of its own, priced at its own vectors."""
        return replace(self, groups=(group, *self.groups)) if self.job == "products" else self


class ResolveContext(Protocol):
    """What :meth:`OpNode.resolve` may ask of the executor (:mod:`gradalg.exec.resolve`)."""

    options: Any

    def resolve(self, op: "OpNode") -> LinearOp:
        """An operand's numbers (memoized by the executor)."""

    def accumulate(self, statistic: Statistic, *prior: LinearOp) -> LinearOp:
        """A statistic's numbers: from the pass of the plan that computed it, else from
        its passes planned and run now; ``prior``: the statistics of ``statistic.after``,
        resolved."""

    def rows(self, grads: GradNode) -> Callable[[], Iterable[dict]]:
        """A callable giving a fresh stream of the rows of ``grads``, chunk by chunk, as
        ``{block: (c, d_b) rows or Factors}`` (each call: planned passes over windows of them)."""

    def products(self, task, data, layers: tuple, kind: str, node: "OpNode"
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
        """V (k, dim) ↦ (H v_i)_i (k, dim) with the loss curvature ``kind`` ("hessian",
        "gauss_newton") of ``task`` over ``data`` on ``layers``: one pass per call (``node``,
        whose ``"products"`` statistic asked for them: the plan's products pass runs it)."""


class OpNode(Node):
    """Base of operator nodes: the four methods of the protocol (module docs) are abstract."""

    def __init_subclass__(cls, **kwargs):
        """A subclass's own ``labels()`` may return a plain set of label strings: it is read
        as :class:`~gradalg.linalg.Labels` (:meth:`Labels.coerce`), so every caller gets Labels."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("labels")
        if own is None or getattr(own, "__isabstractmethod__", False) or getattr(own, "_coerced", False):
            return

        @functools.wraps(own)
        def labels(self):
            return Labels.coerce(own(self), type(self).__name__)

        labels._coerced = True
        cls.labels = labels

    @property
    @abstractmethod
    def space(self) -> ParamSpace:
        """Defined by each node type."""

    @abstractmethod
    def labels(self) -> Labels:
        """The structure once resolved (labels, rules, eigenbasis); raises the
        :class:`~gradalg.errors.OperatorError` of an operation the structure refuses."""

    @abstractmethod
    def statistics(self) -> tuple[Statistic, ...]:
        """The statistics over data this operator (and its operands) need before it resolves."""

    @abstractmethod
    def resolve(self, ctx: ResolveContext) -> LinearOp:
        """The numbers of this operator."""

    @abstractmethod
    def apply_cost(self, space: ParamSpace, n: int, prices):
        """The :class:`~gradalg.plan.cost.Cost` of applying the resolved operator to n rows
        of ``space`` (``prices``: :class:`gradalg.plan.estimates.OperatorPrices`)."""

    @property
    def structure(self) -> str:
        """The labels' one-word name ("identity", "diag", "block", "dense", "kron",
        "lowrank", "implicit"); a refused operation shows its operand's."""
        try:
            return short_name(self.labels())
        except OperatorError:
            operands = [c for c in self.children if isinstance(c, OpNode)]
            return operands[0].structure if operands else "implicit"

    @property
    def shape(self) -> tuple[int, int]:
        """(dim, dim): a square operator on its parameter space."""
        return (self.space.dim, self.space.dim)

    @property
    def is_identity(self) -> bool:
        """Whether the operator is exactly I, so that a score or a row-wise chain it is in
        is not preconditioned: nothing to resolve, no preconditioned copy of held rows,
        ghost kernels allowed. False but on :class:`Identity`; a multiple c·I (labels
        tagged ``"identity"``, c ≠ 1) is not: applying it changes the numbers."""
        return False


def operand_cost(node: "OpNode", op: "OpNode", space: ParamSpace, n: int, prices):
    """The apply cost of ``node``, a map of ``op`` (damped, inverted, ...): the operand's
    when ``node`` keeps its form (its rank, its eigenbases, its data), else by
    ``node``'s form (a damped identity is a diagonal)."""
    try:
        mine, theirs = node.labels(), op.labels()
    except OperatorError:
        return op.apply_cost(space, n, prices)
    if mine.form == theirs.form and "identity" not in theirs:
        return op.apply_cost(space, n, prices)
    return prices.by_form(mine, space, n)


@dataclass(frozen=True, eq=False)
class Identity(OpNode):
    """I on ``space``."""

    space_: ParamSpace

    @property
    def space(self):
        return self.space_

    def labels(self):
        return Labels({"diagonal", "identity"})

    @property
    def is_identity(self) -> bool:
        return True

    def statistics(self):
        return ()

    def resolve(self, ctx):
        return ResolvedOp.identity(self.space, torch.float64)  # exact in any row dtype

    def apply_cost(self, space, n, prices):
        return prices.free()

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

    def labels(self):
        return Labels({"diagonal"})

    def statistics(self):
        return ()

    def resolve(self, ctx):
        return ResolvedOp(self.space, "diag", self.values)

    def apply_cost(self, space, n, prices):
        return prices.by_form(self.labels(), space, n)

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

    def labels(self):
        return Labels({"dense"})

    def statistics(self):
        return ()

    def resolve(self, ctx):
        return ResolvedOp(self.space, "dense", self.matrix)

    def apply_cost(self, space, n, prices):
        return prices.by_form(self.labels(), space, n)

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
            raise OptionError(f"Fisher structure must be 'dense', 'block' or 'diag', got {self.structure_!r}: "
                              "e.g. ga.fisher(G, structure='block')")

    @property
    def space(self):
        return self.grads.space

    def labels(self):
        return Labels(from_short(self.structure_))

    def statistics(self):
        return (Statistic("fisher", self, self.grads),)

    def resolve(self, ctx):
        return ctx.accumulate(self.statistics()[0])

    def apply_cost(self, space, n, prices):
        return prices.by_form(self.labels(), space, n)

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

    def labels(self):
        return self.op.labels().damp(relative=self.relative, what=self.op.label)

    def statistics(self):
        return self.op.statistics()

    def resolve(self, ctx):
        return ctx.resolve(self.op).damp(self.damping, relative=self.relative, what=self.op.label)

    def apply_cost(self, space, n, prices):
        return operand_cost(self, self.op, space, n, prices)

    @property
    def label(self):
        text = f"damp(λ={self.damping:g}·mean eig)" if self.relative else f"damp(λ={self.damping:g})"
        return f"{text} [{self.note}]" if self.note else text


@dataclass(frozen=True, eq=False)
class AutoDamp(OpNode):
    """op + ⊕_b λ_b I_b, each λ_b chosen from block b's own eigenvalues by ``rule`` (a
    :class:`~gradalg.linalg.autodamp.DampingRule`: automatic damping, no ground truth),
    known once op is computed. The label names the rule; ``note`` where it came from."""

    op: OpNode
    rule: object
    note: str = field(default="", metadata={"identity": False})

    @property
    def space(self):
        return self.op.space

    def labels(self):
        return self.op.labels().damp(auto=True, what=self.op.label)

    def statistics(self):
        return self.op.statistics()

    def resolve(self, ctx):
        return ctx.resolve(self.op).damp(0.0, rule=self.rule, what=self.op.label)

    def apply_cost(self, space, n, prices):
        return operand_cost(self, self.op, space, n, prices)

    @property
    def label(self):
        text = f"damp(auto: {self.rule.short()})"
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
            raise OptionError(f"inverse method must be 'auto', 'cg' or 'lissa', got {self.method!r}: "
                              "e.g. H.inv(method='cg')")

    @property
    def space(self):
        return self.op.space

    def labels(self):
        return self.op.labels().inverse(None if self.method == "auto" else self.method, what=self.op.label)

    def statistics(self):
        """The operand's; solved by CG or LiSSA, its products run once per iteration, at most
        the solver's bound (:func:`~gradalg.linalg.solvers.iteration_bound`) times."""
        stats = self.op.statistics()
        try:
            rule = self.labels().rules[-1]
        except OperatorError:
            return stats
        if not rule.startswith("implicit.solve_by_"):
            return stats
        calls, why = iteration_bound(rule.removeprefix("implicit.solve_by_"), dict(self.settings), self.space.dim)
        return tuple(s.solved(calls, why) for s in stats)

    def resolve(self, ctx):
        method = None if self.method == "auto" else self.method
        return ctx.resolve(self.op).inverse(self.op.label, method=method, **dict(self.settings))

    def apply_cost(self, space, n, prices):
        return operand_cost(self, self.op, space, n, prices)

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

    def labels(self):
        return self.op.labels().power(self.p, what=self.op.label)

    def statistics(self):
        return self.op.statistics()

    def resolve(self, ctx):
        return ctx.resolve(self.op).power(self.p, self.op.label)

    def apply_cost(self, space, n, prices):
        return operand_cost(self, self.op, space, n, prices)

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

    def labels(self):
        return self.op.labels().scale()

    def statistics(self):
        return self.op.statistics()

    def resolve(self, ctx):
        return ctx.resolve(self.op).scale(self.scale)

    def apply_cost(self, space, n, prices):
        return operand_cost(self, self.op, space, n, prices)

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

    def labels(self):
        return reduce(Labels.add, (op.labels() for op in self.ops))

    def statistics(self):
        return tuple(s for op in self.ops for s in op.statistics())

    def resolve(self, ctx):
        return reduce(LinearOp.add, (ctx.resolve(op) for op in self.ops))

    def apply_cost(self, space, n, prices):
        """By the sum's form; a sum known through products applies each term: Σ costs."""
        labels = self.labels()
        if labels.form == "implicit":
            return reduce(lambda a, b: a + b, (op.apply_cost(space, n, prices) for op in self.ops))
        return prices.by_form(labels, space, n)

    @property
    def label(self):
        return "sum"


