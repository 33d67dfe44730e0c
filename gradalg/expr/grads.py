"""Gradient-set nodes: rows are examples, columns a :class:`ParamSpace`.

Every node knows, without computing anything, its space, its number of rows, the ids
of its rows and the representation of each block:

``factored``  G_i = D_iᵀ A_i kept as the factors (hook capture)
``dense``     the full per-example gradient (torch.func capture, or after an operator)
``projected`` P(G_i), a few coordinates per example
"""
from __future__ import annotations

from abc import abstractmethod

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable

import torch

from ..capture.chunks import flat_block, flatten, row_sq_norms, unflatten
from ..capture.hooks import resolve_layers
from ..data import DataRef
from ..space import Block, ParamSpace
from ..errors import GradalgError, OptionError
from ..fingerprint import callable_fingerprint
from ..linalg.quadratic import row_quadratic
from .base import Node
from .projection import Projector

__all__ = ["GradNode", "RowWise", "Source", "Captured", "Project", "Normalize", "Select", "Precondition",
           "ScaleRows", "RowWeights", "GroupMean", "AdamState", "AdamPrecondition", "first_examples"]


class GradNode(Node):
    """Base of gradient-set nodes."""

    @property
    @abstractmethod
    def space(self) -> ParamSpace:
        """Defined by each node type."""

    @property
    @abstractmethod
    def n(self) -> int:
        """Defined by each node type."""

    @property
    @abstractmethod
    def ids(self) -> tuple:
        """Defined by each node type."""

    @property
    @abstractmethod
    def representation(self) -> dict[str, str]:
        """Defined by each node type."""

    @abstractmethod
    def restrict(self, data_token: str, start: int, stop: int) -> "GradNode":
        """This node with its rows read from data ``data_token`` limited to examples
        start:stop (a shard); itself when its rows are not read from that data."""

    @abstractmethod
    def first_examples(self, n: int) -> "GradNode":
        """This node over the first ``n`` examples of its data, ``n`` < ``self.n``
        (:func:`first_examples`); raises ValueError when its rows are not a pass of their own."""

    @property
    def source(self) -> "Source | Captured":
        """The leaf this gradient set is computed from."""
        return self.grads.source  # type: ignore[attr-defined]

    def statistics(self) -> tuple:
        """The statistics a plan computes before this node's rows exist, as an operator's
        (:class:`~gradalg.expr.Statistic`): none for rows a pass reads or derives chunk by
        chunk; a group mean's rows are a job's (the planner asks, never the node's type)."""
        return ()


def _not_from_data(node: GradNode, n: int):
    raise OptionError(
        f"statistics on the first {n} examples need gradients computed from data (ga.grads, "
        f"optionally projected or selected); {node.label!r} is not: compute them on all rows "
        "(covariance_max_examples=None, lambda_max_examples=None)")


class RowWise(GradNode):
    """A node computed row by row from its input ``grads``: a chunk of the input's rows
    gives the chunk of this node for the same examples. The row-wise protocol, which the
    planner and the executors call instead of asking a node its type:

    ``apply(chunk, ctx)``           the chunk of this node from the matching chunk of
                                    ``grads`` (``ctx``: :class:`gradalg.exec.rowwise.RowContext`,
                                    the executor's resolved operators, projections, options)
    ``row_cost(n, chunk, prices)``  the :class:`~gradalg.plan.cost.Cost` of that for n
                                    examples of the input in chunks of ``chunk`` rows
                                    (``prices``: :class:`gradalg.plan.estimates.RowPrices`)
    ``restrict(data, a, b)``        the same transform of the input's rows a:b (shards)
    ``representation``              each block's representation after the transform

    ``apply`` and ``row_cost`` are abstract: a row-wise type that forgets one fails when built.
    """

    @abstractmethod
    def apply(self, chunk, ctx):
        """The chunk of this node computed from ``chunk``, the same rows of ``grads``."""

    @abstractmethod
    def row_cost(self, n: int, chunk: int | None, prices):
        """The Cost of :meth:`apply` over ``n`` examples of ``grads`` in chunks of ``chunk``."""

    def restrict(self, data_token, start, stop):
        """Only the rows are restricted: operators inside the chain (a preconditioner, the
        metric of a normalization) keep their full data, the same operators as unsharded."""
        inner = self.grads.restrict(data_token, start, stop)
        return self if inner is self.grads else replace(self, grads=inner)

    def first_examples(self, n):
        return replace(self, grads=first_examples(self.grads, n))


def _module_blocks(task, layers, backend) -> tuple[Block, ...]:
    """The blocks of ``layers`` in ``task.model``, from the layer rules (module shapes only)."""
    refs = resolve_layers(task.model, list(layers), backend=backend)
    blocks = []
    for ref in refs:
        if backend == "func":
            dim = sum(ref.module.get_parameter(p).numel() for p in ref.param_names())
            blocks.append(Block(ref.name, (dim,), "param", aliases=ref.aliases))
        else:
            blocks.append(ref.block())
    return tuple(blocks)


@dataclass(frozen=True, eq=False)
class Source(GradNode):
    """Per-example gradients of ``task`` on ``data``, captured when computed.

    backend "hooks" records factors of supported layers; "func" uses torch.func on
    any module and yields dense blocks (slow: the reference path).
    """

    task: Any
    data: DataRef
    layers: tuple[str, ...]
    backend: str = "hooks"
    objective: str = "loss"
    seed: int = 0

    @cached_property
    def space(self) -> ParamSpace:
        return ParamSpace(_module_blocks(self.task, self.layers, self.backend))

    @property
    def n(self) -> int:
        return self.data.n

    @property
    def ids(self) -> tuple:
        return self.data.ids

    @property
    def representation(self):
        rep = "factored" if self.backend == "hooks" else "dense"
        return {b.name: rep for b in self.space.blocks}

    @property
    def source(self):
        return self

    def restrict(self, data_token, start, stop):
        if self.data.token != data_token:
            return self
        return Source(self.task, self.data.subset(start, stop), self.layers, self.backend, self.objective, self.seed)

    def first_examples(self, n):
        return replace(self, data=self.data.prefix(n))

    @property
    def label(self):
        extra = "" if self.objective == "loss" else f", objective={self.objective}"
        return f"grads({self.task.name}, n={self.n}{extra}, backend={self.backend})"


@dataclass(frozen=True, eq=False)
class Captured(GradNode):
    """Per-example gradients recorded by ``ga.capture`` around a user's loop (in memory)."""

    store: Any  # gradalg.capture.session.CaptureStore, or any object with chunks() and token
    space_: ParamSpace

    @property
    def space(self):
        return self.space_

    @property
    def n(self):
        return self.store.n

    @property
    def ids(self):
        ids = getattr(self.store, "ids", None)  # training-time capture labels rows with dataset indices
        return tuple(range(self.store.n)) if ids is None else ids

    @property
    def representation(self):
        return {b.name: "factored" for b in self.space.blocks}

    @property
    def source(self):
        return self

    def restrict(self, data_token, start, stop):
        return self        # recorded rows, not read from data

    def first_examples(self, n):
        _not_from_data(self, n)

    @property
    def label(self):
        return f"captured(n={self.n})"


@dataclass(frozen=True, eq=False)
class Project(RowWise):
    """``P(G)``: each example's gradient projected by ``projector``."""

    grads: GradNode
    projector: Projector

    @cached_property
    def space(self) -> ParamSpace:
        """One ``projected`` block of k coordinates (min(k, dim) for a global mask), or per
        block: (k_out, k_in) for "kron", (min(k, dim),) for "mask", (k,) otherwise."""
        p = self.projector
        if not p.per_block:        # the whole space as one flat block
            return ParamSpace((Block("projected", p.block_shape((self.grads.space.dim,)), "projected", p.token),))
        blocks = []
        for b in self.grads.space.blocks:
            p.check_block(b)           # kron and factgrass: (out, in) layer blocks only
            blocks.append(Block(b.name, p.block_shape(b.shape), "projected", p.token))
        return ParamSpace(tuple(blocks))

    @property
    def n(self):
        return self.grads.n

    @property
    def ids(self):
        return self.grads.ids

    @property
    def representation(self):
        return {b.name: "projected" for b in self.space.blocks}

    def apply(self, chunk, ctx):
        return chunk.replace(ctx.project(self, chunk))

    def row_cost(self, n, chunk, prices):
        return prices.project(self, n, chunk)

    @property
    def label(self):
        return f"project {self.projector!r}"


class _RowMap(RowWise):
    """A node that keeps its input's rows and space."""

    @property
    def space(self):
        return self.grads.space

    @property
    def n(self):
        return self.grads.n

    @property
    def ids(self):
        return self.grads.ids

    @property
    def representation(self):
        return self.grads.representation


@dataclass(frozen=True, eq=False)
class Normalize(_RowMap):
    """G_i / ‖G_i‖ (norm over all blocks; a zero gradient stays zero).

    With an operator ``op`` the norm is ‖G_i‖_H = √⟨G_i, H G_i⟩ (RelatIF's
    normalization by self-influence when H is an inverse curvature).
    """

    grads: GradNode
    op: Node | None = None

    @property
    def representation(self):
        """The rows' own: each row is scaled, factored blocks by their output gradients
        (with H too: ⟨g, H g⟩ is computed block by block, the rows are not kept flat)."""
        return self.grads.representation

    def apply(self, chunk, ctx):
        """Rows scaled by 1/‖G_i‖ (0 for a zero row); factored blocks by their output
        gradients. With H: ⟨g, H g⟩ by :func:`~gradalg.linalg.quadratic.row_quadratic`,
        a block at a time where H acts per block (K-FAC / EK-FAC: a few (c, d_b) arrays of
        the widest block, not the (c, d) flat rows and their image), then the rows scaled
        the same way."""
        o = ctx.options
        if self.op is None:
            sq = row_sq_norms(chunk, o.ghost_slice_elements, o.token_block)
        else:
            sq = row_quadratic(ctx.resolve(self.op), chunk.blocks, self.space)
            if bool((sq < 0).any()):
                raise GradalgError("the normalizing operator gave a negative ⟨g, H g⟩: it must be "
                                   "positive semi-definite (damp it)")
        norms = sq.sqrt()
        inv = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))
        return chunk.replace({n: ctx.scale_rows(v, inv) for n, v in chunk.blocks.items()})

    def row_cost(self, n, chunk, prices):
        """Squared norms (one read; factored blocks by their ghost identity) and the rows
        scaled; with H: the rows flattened, H applied, ⟨g, Hg⟩ and the scaled rows (4 reads,
        2 writes), H resolved once."""
        src = self.grads
        if self.op is None:
            return prices.per_chunk(src, n, chunk, lambda c: prices.norms(src, c) + prices.scale_rows(src, c))
        return prices.per_chunk(src, n, chunk, lambda c: (prices.flatten(src, c) + prices.apply(self.op, src.space, c)
                                                          + prices.elementwise(c * src.space.dim, 4, 2)), self.op)

    @property
    def label(self):
        return "normalize" if self.op is None else "normalize in the metric of an operator"


@dataclass(frozen=True, eq=False)
class GroupMean(GradNode):
    """Rows averaged within groups: row g = mean of G_i over the rows i with ``groups[i] == g``.

    Groups appear in order of first occurrence; the result's ids are the group labels.
    (LESS averages the gradients of each target task's validation examples this way.)
    """

    grads: GradNode
    groups: tuple

    def __post_init__(self):
        if len(self.groups) != self.grads.n:
            raise OptionError(f"got {len(self.groups)} group labels for {self.grads.n} rows: give one per row")

    @property
    def space(self):
        return self.grads.space

    @property
    def ids(self):
        return tuple(dict.fromkeys(self.groups))

    @property
    def n(self):
        return len(self.ids)

    @property
    def representation(self):
        return {k: ("projected" if v == "projected" else "dense") for k, v in self.grads.representation.items()}

    def statistics(self):
        """The group means, computed over every row of ``grads`` by a ``"group"`` job
        before a pass reads them (they are kept in memory)."""
        from .operators import Statistic      # operators import this module
        return (Statistic("group", self, self.grads),)

    def restrict(self, data_token, start, stop):
        return self        # a group's mean needs every row of its group

    def first_examples(self, n):
        _not_from_data(self, n)

    @property
    def label(self):
        return f"mean over {self.n} groups"


#: columns of a block's rows that :meth:`AdamState.direction` computes at a time on the CPU
#: (a tile of 4 examples is 1 MiB a buffer in float32: in L2). Speed only: the numbers do not
#: depend on it.
ADAM_TILE = 1 << 16


@dataclass(frozen=True)
class AdamState:
    """Adam's moments in a gradient space's canonical coordinates (see ``ga.adam_state``).

    exp_avg, exp_avg_sq : (dim,) tensors, or ``ga.adam_state``'s views of the optimizer's
        own tensors (read a block's slice at a time; any other tensor use works on a copy
        of the whole vector); betas, eps as in ``torch.optim.Adam``.
    """

    exp_avg: Any
    exp_avg_sq: Any
    beta1: float
    beta2: float
    eps: float

    def direction(self, value, coords: slice) -> torch.Tensor:
        """Adam's direction ``m / (√v + ε)`` of one block's rows, with ``m = β₁ m₀ + (1 − β₁) g``
        and ``v = β₂ v₀ + (1 − β₂) g²`` (m₀, v₀: the entries ``coords`` of the space).
        value : factors or (n, d_b) rows   returns (n, d_b)"""
        g = flat_block(value)
        # the (d_b,) terms β₁m₀ and β₂v₀ are formed once per block, not per example; then,
        # ADAM_TILE columns at a time (the tile's g, v and m stay in cache), five fused
        # passes (addcmul, sqrt, + ε, add, div: three fewer than the expression's eight
        # elementwise ops) into the result and one tile-sized buffer. Bit-identical to the
        # same five ops on whole rows; 1.6× faster on GPT-2 c_fc rows (2.36 M columns, 4 examples).
        bm = self.beta1 * self.exp_avg[coords].to(g)
        bv = self.beta2 * self.exp_avg_sq[coords].to(g)
        n, d = g.shape
        tile = ADAM_TILE if g.device.type == "cpu" else max(d, 1)    # on a GPU: one tile, fewer launches
        out = torch.empty_like(g)
        buf = torch.empty(n, min(d, tile), dtype=g.dtype, device=g.device)
        for s in range(0, d, tile):
            e = min(d, s + tile)
            gs, v, m = g[:, s:e], buf[:, :e - s], out[:, s:e]
            torch.addcmul(bv[s:e], gs, gs, value=1 - self.beta2, out=v)
            v.sqrt_().add_(self.eps)
            torch.add(bm[s:e], gs, alpha=1 - self.beta1, out=m)
            m.div_(v)
        return out

    @property
    def token(self):
        from .base import tokenize
        return f"adam-{tokenize(self.exp_avg)}-{tokenize(self.exp_avg_sq)}-{self.beta1}-{self.beta2}-{self.eps}"


@dataclass(frozen=True, eq=False)
class AdamPrecondition(_RowMap):
    """LESS's Adam transform of each row (Xia et al. 2024), elementwise:

        m = β₁ m₀ + (1 − β₁) g,   v = β₂ v₀ + (1 − β₂) g²,   Γ(g) = m / (√v + ε)

    the direction Adam would step in after seeing this one example. Non-linear, so
    factored blocks are materialized.
    """

    grads: GradNode
    state: AdamState

    def __post_init__(self):
        d = self.grads.space.dim
        if tuple(self.state.exp_avg.shape) != (d,) or tuple(self.state.exp_avg_sq.shape) != (d,):
            raise OptionError(f"Adam state has shapes {tuple(self.state.exp_avg.shape)}, "
                             f"{tuple(self.state.exp_avg_sq.shape)}; the space has {d} coordinates")

    @property
    def representation(self):
        return {k: ("projected" if v == "projected" else "dense") for k, v in self.grads.representation.items()}

    def apply(self, chunk, ctx):
        """Elementwise, one block at a time: never the whole model's rows flat."""
        offsets = self.space.offsets()
        return chunk.replace({b.name: self.state.direction(chunk.blocks[b.name], offsets[b.name])
                              for b in self.space.blocks})

    def row_cost(self, n, chunk, prices):
        """Each block materialized (from factors) and Adam's elementwise ops (``prices.adam``)."""
        return prices.per_chunk(self.grads, n, chunk,
                                lambda c: prices.materialize(self.grads, c) + prices.adam(self.grads, c))

    @property
    def label(self):
        return "adam transform"


@dataclass(frozen=True, eq=False)
class Select(_RowMap):
    """Only the blocks ``names``."""

    grads: GradNode
    names: tuple[str, ...]

    @cached_property
    def space(self):
        return self.grads.space.select(self.names)

    @property
    def representation(self):
        rep = self.grads.representation
        return {n: rep[n] for n in self.names}

    def apply(self, chunk, ctx):
        return chunk.replace({n: chunk.blocks[n] for n in self.names})

    def row_cost(self, n, chunk, prices):
        return prices.free()      # a view

    @property
    def label(self):
        return f"select {list(self.names)}"


@dataclass(frozen=True, eq=False)
class Precondition(_RowMap):
    """Rows mapped by a (symmetric) operator: G_i ↦ H G_i. Factored blocks become dense."""

    grads: GradNode
    op: Node

    def __post_init__(self):
        # refused when built, not at compute time (a same-sized operator of another
        # projection would otherwise be applied silently)
        self.grads.space.check_same(self.op.space, "the operator and the gradients")
        from .models import check_same_models
        check_same_models(self.grads, self.op, "the operator and the gradients")

    @property
    def representation(self):
        rep = self.grads.representation
        return {k: ("projected" if v == "projected" else "dense") for k, v in rep.items()}

    def apply(self, chunk, ctx):
        resolved = ctx.resolve(self.op)
        return chunk.replace(unflatten(resolved.apply(flatten(chunk, self.space)), self.space))

    def row_cost(self, n, chunk, prices):
        """The rows flattened and H applied; H resolved once."""
        src = self.grads
        return prices.per_chunk(src, n, chunk,
                                lambda c: prices.flatten(src, c) + prices.apply(self.op, src.space, c), self.op)

    @property
    def label(self):
        return "precondition"


@dataclass(frozen=True)
class RowWeights:
    """A per-example scalar ``fn(model, batch) -> (B,)`` computed with the task's model."""

    fn: Callable
    name: str

    @cached_property
    def token(self):
        # the function's code, defaults and closure (a bound method's object included), not its
        # address: the same in every process, and never shared by two functions alive at different times
        return f"rowweights-{self.name}-{callable_fingerprint(self.fn)}"


@dataclass(frozen=True, eq=False)
class ScaleRows(_RowMap):
    """G_i ↦ w_i G_i with w_i a constant or a per-example :class:`RowWeights`."""

    grads: GradNode
    weights: Any  # float or RowWeights

    def apply(self, chunk, ctx):
        w = ctx.row_weights(self.weights, chunk)
        return chunk.replace({n: ctx.scale_rows(v, w) for n, v in chunk.blocks.items()})

    def row_cost(self, n, chunk, prices):
        return prices.per_chunk(self.grads, n, chunk, lambda c: prices.scale_rows(self.grads, c))

    @property
    def label(self):
        w = self.weights
        return f"scale rows by {w.name if isinstance(w, RowWeights) else w}"


def first_examples(node: GradNode, n: int | None) -> GradNode:
    """``node`` over the first ``n`` examples of its data (``node`` itself when ``n`` is
    None or covers every example).

    The row-wise chain (projections, normalizations, selections, preconditioners, row
    scales) is kept; only its Source reads a prefix, ``data.prefix(n)``: a DataRef of its
    own, so the planner gives the prefix its own pass, which reads ``n`` examples only.
    Operators inside the chain keep their full data (they are the same operators). With
    ``objective="expected"`` the prefix keeps every Gauss-Newton row of its ``n`` examples.

    Raises ValueError for gradients that are not computed from data (``ga.capture``'s
    rows, stored rows): their first examples are not a pass of their own.
    """
    if n is None or n >= node.n:
        return node
    return node.first_examples(n)
