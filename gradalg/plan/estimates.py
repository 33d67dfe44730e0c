"""What each job and pass of a plan costs: the planner's estimates, in one place.

The formulas of single kernels (a ghost product, a GEMM, a Gram, an eigendecomposition)
are in :mod:`gradalg.plan.cost`; this module adds them up for the work the executor
does per pass, from shapes alone (nothing runs, no data is read beyond the first
example's shape):

``capture_cost``     a source captured batch by batch: per weight layer one forward GEMM
                     ``(B·T, out, in)`` and one input-gradient GEMM per backward (the
                     weight-gradient GEMMs are skipped), attention products, the model's
                     elementwise traffic, a fixed cost per module call, per captured batch
                     and per recorded layer, the factors written
``chunk_count``      how many chunks of which size a job sees; a job's own work on one
                     chunk is a method of its class (:meth:`gradalg.plan.jobs.Job.chunk_cost`,
                     from the kernels below and :mod:`gradalg.plan.cost`)
``apply_cost``       a resolved operator applied to n rows: the node's ``apply_cost``
                     priced by :class:`OperatorPrices`; ``resolve_cost``: what resolving it
                     costs in the pass that applies it (a dense or block eigendecomposition)
``project_cost``     a projection of n examples (Kronecker, dense Gaussian, sparse)
``rowwise_cost``     any row-wise transform a pass derives chunk by chunk (a projection,
                     Adam's preconditioning, a normalization, a preconditioner, row weights)
``kernel_costs``     ghost and dense inner products of one block (the planner prices both
                     with its device profile and picks the faster)

Every estimate is a :class:`~gradalg.plan.cost.Cost` (counts); a device profile
(:mod:`gradalg.devices`) prices it. ``benchmarks/estimates.py`` compares the
estimates with measured passes for every catalogue method (``docs/planner.md``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import islice, takewhile
from types import MappingProxyType
from typing import Mapping

import torch
from torch import nn

from ..errors import OperatorError
from ..expr import Project, Source
from ..linalg.kron import BlockEigenvalues, is_diagonal_factor
from ..linalg.labels import form_of
from ..proj.kinds import Rows
from .cost import (Cost, block_cost, bmm_cost, dense_cost, eigh_cost, gemm_cost,
                   ghost_cost, kron_project_cost, materialize_cost, svd_cost, tokens_hint)
from ..devices import UNMEASURED_CPU as NOMINAL, DeviceProfile
from .memory import positions, rows_of
from .shapes import activation_bytes, attention_shape, element_size, output_width, rows_per_example, weight_layers

__all__ = ["capture_cost", "pass_capture_cost", "chunk_count", "resolve_once", "resolve_bytes", "apply_cost",
           "OperatorPrices", "resolve_cost", "project_cost", "RowPrices", "rowwise_cost", "kernel_costs",
           "elementwise_cost", "pass_overhead", "ADAM_OPS", "factored_blocks", "made_flat_cost", "materialized_cost"]

#: no measured forward shapes (every layer at ``tokens_hint``): the prices' default outside a plan
EMPTY: Mapping = MappingProxyType({})


# ------------------------------------------------------------------ model shapes
def leaf_modules(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if not any(True for _ in m.children()))


# ------------------------------------------------------------------ capture
def capture_cost(src: Source, options, dtype=torch.float32, forward: bool = True, batch: int | None = None,
                 device: DeviceProfile = NOMINAL) -> Cost:
    """Capturing every batch of ``src``: its forward (unless shared with another source
    of the pass) and one backward to the recorded outputs per row set (one per
    Gauss-Newton term for ``objective="expected"``), with no weight-gradient GEMMs.

    Per batch of B examples of T positions, for each weight layer ``(in, out)``:
    forward GEMM (B·T, out, in), input-gradient GEMM (B·T, in, out) per backward;
    attention (a transformer config) adds per layer batched calls of B·heads (T, T,
    d_head) products, two forward and four per backward. Elementwise traffic is the layers' inputs and
    outputs (``activation_bytes``) times the ``device``'s ``elementwise_sweeps``; fixed costs are
    the module calls (each leaf module once per forward and per backward), the
    captured batches and their recorded layers.
    """
    model, data, elem = src.task.model, src.data, element_size(dtype)
    n, T = data.n, tokens_hint(src)
    B = batch or data.largest_batch(options.batch_size)   # the planned batch: already at most n
    batches = math.ceil(n / B)
    sweeps = rows_per_example(src) if src.objective == "expected" else 1     # backwards per batch
    cost = Cost(passes=1)
    for n_in, n_out in weight_layers(model):
        if forward:
            cost = cost + gemm_cost(B * T, n_out, n_in, batches, elem)
        cost = cost + gemm_cost(B * T, n_in, n_out, batches * sweeps, elem)
    layers, width, heads = attention_shape(model)
    if layers and T > 1:
        d_head = max(1, width // heads)
        calls = batches * layers * (2 * int(forward) + 4 * sweeps)
        cost = cost + bmm_cost(B * heads, T, T, d_head, calls, elem)
    act = activation_bytes(model, T, elem) * n
    sweep_forward, sweep_backward = device.elementwise_sweeps
    cost = cost + Cost(elementwise=act * (sweep_forward * int(forward) + sweep_backward * sweeps))
    # the recorded layers' factors: A kept (with its bias column), D written, per backward
    factor_bytes = sum(T * (b.shape[-1] + b.shape[0]) for b in src.space.blocks if len(b.shape) == 2) * n * elem
    cost = cost + Cost(bytes=2.0 * factor_bytes * sweeps)
    if src.objective == "sampled":   # labels drawn from the model: a float64 softmax and search over outputs
        cost = cost + Cost(bytes=n * T * (output_width(model) or 1) * 8.0 * 4)
    if src.objective == "loss" and options.check_reduction:   # the sum/mean check: 2 forwards of ≤ 4 examples
        m = min(4, B) * T
        for n_in, n_out in weight_layers(model):
            cost = cost + gemm_cost(m, n_out, n_in, 2, elem)
    calls = batches * leaf_modules(model) * (int(forward) + sweeps)
    return cost + Cost(calls=calls, batches=batches * sweeps, layer_batches=batches * sweeps * len(src.space.blocks),
                       ops=batches * device.ops_per_batch)


def pass_capture_cost(sources, options, dtype, share_key, batch: int | None = None,
                      device: DeviceProfile = NOMINAL) -> Cost:
    """Capturing all sources of a pass: those with the same ``share_key(src)`` (not
    None) share one forward per batch (:class:`~gradalg.exec.capture_pass.PassCapture`)."""
    cost, forwards = Cost(), set()
    for src in sources:
        key = share_key(src) if options.share_forward else None
        cost = cost + capture_cost(src, options, dtype, forward=key is None or key not in forwards, batch=batch,
                                   device=device)
        forwards.add(key)
    return cost


# ------------------------------------------------------------------ operators
def apply_cost(op, space, n: int, elem: int = 4, options=None, shapes: Mapping = EMPTY) -> Cost:
    """Applying the resolved ``op`` to n rows of ``space``: the node's own
    ``apply_cost`` (:mod:`gradalg.expr.operators`), priced by :class:`OperatorPrices`
    (``shapes``: the plan's measured forward shapes, :class:`~gradalg.plan.shapes.ModelFacts`). An
    operator whose structure refuses an operation costs nothing here: ``explain()``
    shows its refusal, and resolving it raises it."""
    try:
        return op.apply_cost(space, n, OperatorPrices(elem, options, shapes)) + _eigenvalues_made(op, elem)
    except OperatorError:
        return Cost()


def kron_chain(op) -> int:
    """How many Kronecker operators ``op`` is a chain of: itself and, down its operator
    operands, each Kronecker one (EK-FAC → damped → inverse: 3); 0 when ``op`` is not
    Kronecker. Resolving the chain makes one :class:`~gradalg.linalg.kron.KronOp` per
    node; each operand's reads every block's eigenvalues Λ once, in float64, for its tags
    and the checks of the step above it (min, max |·|, min |·|:
    :meth:`~gradalg.linalg.kron.BlockEigenvalues.extremes`), the top one's tags follow
    from them: chain − 1 scans per block (:func:`resolve_cost`)."""
    return sum(1 for _ in takewhile(_is_kronecker, _operands(op)))


def _operands(op):
    """``op`` and, down its chain, each node's first operand that is an operator (has
    ``labels`` and ``resolve``)."""
    while op is not None:
        yield op
        op = next((c for c in getattr(op, "children", ()) if hasattr(c, "labels") and hasattr(c, "resolve")), None)


def _is_kronecker(op) -> bool:
    try:
        return form_of(op.labels()) == "kronecker"
    except OperatorError:
        return False


def _rules(op) -> tuple:
    """The rules resolving ``op`` applies (``op.labels().rules``); none where its structure refuses."""
    try:
        return op.labels().rules
    except OperatorError:
        return ()


#: full-size ops over a block's Λ (out·in numbers, float64) of each step a Kronecker
#: chain keeps (:meth:`~gradalg.linalg.kron.BlockEigenvalues.rows`): a shift; a cast up,
#: the reciprocal or power, a cast down
_STEP_OPS = {"kronecker.damp_in_eigenbasis": 1, "kronecker.invert_eigenvalues": 3, "kronecker.eigenvalue_power": 3}


def _step_ops(op) -> int:
    return sum(_STEP_OPS.get(r, 0) for r in _rules(op))


def _eigenvalues_made(op, elem: int = 4) -> Cost:
    """A Kronecker chain's Λ made when it is applied, and the bases cast to the rows'
    precision. A damped or inverted Λ is kept as its base and steps
    (:class:`~gradalg.linalg.kron.BlockEigenvalues`), made again from them on each
    application (``mul_into``): one ``block_cost("resolve")`` per block (its fixed cost)
    and the steps' full-size ops over out·in float64 numbers (:data:`_STEP_OPS`, a read
    and a write each); float64 bases applied to float32 rows are cast on each rotation,
    in and back (``rotate_rows``, ``rotate_back``): 2·(out² + in²) numbers read as float64
    and written in the rows' ``elem`` bytes. Traffic at the profile's elementwise bandwidth."""
    if kron_chain(op) < 2:
        return Cost()
    blocks = [b for b in op.space.blocks if len(b.shape) == 2]
    ops, sweeps = _step_ops(op), 0.0
    for out_f, in_f in (b.shape for b in blocks):
        casts = 2.0 * (8 + elem) * (out_f ** 2 + in_f ** 2) if elem < 8 else 0.0
        sweeps += 2.0 * ops * 8 * out_f * in_f + casts
    return block_cost("resolve", len(blocks)) + Cost(elementwise=sweeps)


def _eigenvalues_scanned(op) -> Cost:
    """Each operand of a Kronecker chain scanned for its extremes once per block (the
    chain's resolution, :func:`kron_chain`): ``block_cost("resolve")`` each, and per scan
    the operand's Λ made from its steps and
    :data:`BlockEigenvalues.SCAN_SWEEPS <gradalg.linalg.kron.BlockEigenvalues.SCAN_SWEEPS>`
    float64 sweeps over out·in numbers, at the elementwise bandwidth."""
    chain, blocks = kron_chain(op), op.space.blocks
    scans = max(1, chain - 1)
    # the operands below the top (at most the chain's), each with the steps it keeps
    made_ops = [_step_ops(node) for node in islice(_operands(op), 1, min(chain, scans) + 1)]
    made_ops += [0] * (scans - len(made_ops))
    sweeps = sum((BlockEigenvalues.SCAN_SWEEPS + 2.0 * k) * 8 * b.dim for b in blocks for k in made_ops)
    return block_cost("resolve", len(blocks) * scans) + Cost(elementwise=sweeps)


class _Prices:
    """What every price list below offers: nothing, and GEMMs in numbers of ``elem`` bytes."""

    def free(self) -> Cost:
        return Cost()

    def gemm(self, m: int, n: int, k: int, count: int = 1) -> Cost:
        """``count`` GEMMs (m, k) @ (k, n)."""
        return gemm_cost(m, n, k, count, self.elem)


@dataclass(frozen=True)
class OperatorPrices(_Prices):
    """The prices an operator node's ``apply_cost(space, n, prices)`` is written in, for
    rows of ``elem`` bytes under ``options``: a resolved operator applied by its form
    (:meth:`by_form`), a low-rank one by its rank, and the parts of a closed form over data
    (a read of training rows, GEMMs, memory traffic). ``shapes``: the plan's measured
    forward shapes, ``{source token: ForwardShapes}`` (empty: ``tokens_hint``)."""

    elem: int = 4
    options: object = None
    shapes: Mapping = field(default_factory=dict)

    def by_form(self, labels, space, n: int) -> Cost:
        """By the form of ``labels``: a diagonal scales (n·d), block-diagonal and dense
        matrices multiply (GEMMs (n, d_b, d_b), (n, d, d)), a Kronecker eigenbasis rotates
        each (out, in) block in and back (``KronOp.apply_blocks``: twice a batched call of n
        (out, in, out) products, ``Q_S`` from the left, and one (n·out, in, in) GEMM, ``Q_A``
        from the right; an identity basis, the side of a factor wider than
        ``options.kron_diagonal_width``, costs nothing) plus each block's fixed cost
        (``block_cost("precondition", …)``: casts, scaling); a low-rank one as rank d; one
        known through products as a dense GEMM (its own ``apply_cost`` says better). A
        dense or block matrix adds its cast to the rows' dtype (:meth:`matrix_cast`)."""
        form, elem, d = form_of(labels), self.elem, space.dim
        if form == "diagonal":
            return Cost(flops=float(n * d), bytes=3.0 * elem * n * d)
        if form == "block":
            return sum((gemm_cost(n, b.dim, b.dim, 1, elem) + self.matrix_cast(b.dim) for b in space.blocks), Cost())
        if form == "kronecker":
            return self._kronecker(space, n)
        if form == "low-rank":
            return self.low_rank(space, n, d)
        return gemm_cost(n, d, d, 1, elem) + self.matrix_cast(d)         # dense; implicit priced as dense

    def matrix_cast(self, d: int) -> Cost:
        """A resolved dense or block matrix (d, d) is kept in float64 (its inverse or power
        comes from a float64 eigendecomposition, :mod:`gradalg.linalg.explicit`) and cast to
        the rows' dtype on each application: 8·d² bytes read, elem·d² written (nothing for
        float64 rows; the copy is fresh memory, faulted in). On a few rows this is most of the work (TrackStar's R^-1/2 at
        k = 4096: 0.2 GB per application, where the GEMM's FLOPs price 2 ms)."""
        return Cost() if self.elem == 8 else Cost(bytes=(8.0 + self.elem) * d * d, faulted=float(self.elem) * d * d)

    def _kronecker(self, space, n: int) -> Cost:
        elem, diagonal_width = self.elem, getattr(self.options, "kron_diagonal_width", None)
        cost = block_cost("precondition", sum(1 for b in space.blocks if len(b.shape) == 2))
        for b in space.blocks:
            if len(b.shape) != 2:
                cost = cost + gemm_cost(n, b.dim, b.dim, 1, elem)
                continue
            out_f, in_f = b.shape
            if not is_diagonal_factor(out_f, diagonal_width):
                cost = cost + bmm_cost(n, out_f, in_f, out_f, 2, elem)
            if not is_diagonal_factor(in_f, diagonal_width):
                cost = cost + gemm_cost(n * out_f, in_f, in_f, 2, elem)
            cost = cost + Cost(bytes=4.0 * elem * n * b.dim)
        return cost

    def low_rank(self, space, n: int, rank: int) -> Cost:
        """V diag(μ) Vᵀ applied to n rows: 4n·d·r."""
        return gemm_cost(n, rank, space.dim, 2, self.elem)

    def rows_read(self, grads) -> Cost:
        """Reading the rows of ``grads`` again, flat: their source captured again (when
        ``options`` are known) and their factored blocks materialized."""
        root = grads
        while not isinstance(root, Source) and hasattr(root, "grads"):
            root = root.grads
        captured = isinstance(root, Source) and self.options is not None     # captured again: options known
        cost = capture_cost(root, self.options, torch.float32) if captured else Cost()
        T = positions(grads, self.shapes)
        for b in grads.space.blocks:
            if len(b.shape) == 2 and grads.representation.get(b.name) == "factored":
                cost = cost + materialize_cost(grads.n, T[b.name], b.shape[1], b.shape[0], self.elem)
        return cost

    def traffic(self, nbytes: float) -> Cost:
        """Memory traffic of ``nbytes``."""
        return Cost(bytes=float(nbytes))


#: the rules that eigendecompose an explicit matrix, and a Kronecker inverse or power
_EIGH_RULES = {"block": ("block.eigh_per_block", "block.eigh_power_per_block"),
               "dense": ("dense.eigh", "dense.eigh_power")}
_KRON_RESOLVE_RULES = ("kronecker.invert_eigenvalues", "kronecker.eigenvalue_power")
#: the rules that damp a dense or block matrix into a new (d, d) copy
_SHIFT_RULES = ("dense.shift_diagonal", "block.shift_diagonals")
#: bytes per d² of :func:`~gradalg.linalg.base.sym_eig_map` (resolve_bytes), and of a damped copy
EIGH_MAP_BYTES, SHIFTED_COPY_BYTES = 32.0, 8.0


def resolve_cost(op) -> Cost:
    """Resolving ``op`` where it is applied, read from the rules its resolution applies
    (``op.labels().rules``): an inverse or power of a dense or block matrix is a float64
    eigendecomposition per matrix and a (d, d, d) GEMM to rebuild it; of a Kronecker
    operator, each block's eigenvalues of every operand in its chain scanned for their
    tags and the inverse's checks (:func:`kron_chain`: EK-FAC → damp → inverse scans the
    EK-FAC and the damped Λ, the fixed cost ``block_cost("resolve", 2 × blocks)``; the
    inverse itself is a lazy step, made when applied: :func:`apply_cost`). K-FAC's
    eigendecompositions belong to its ``kfac`` job."""
    rules, cost = set(_rules(op)), Cost()
    if rules & set(_KRON_RESOLVE_RULES):
        return _eigenvalues_scanned(op)
    for d in _eigh_dims(rules, op.space):
        cost = cost + eigh_cost(d) + gemm_cost(d, d, d, 1, 8) + Cost(bytes=8.0 * 6 * d * d)
    return cost


def _eigh_dims(rules: set, space) -> list:
    """The widths of the matrices an operator resolved by ``rules`` eigendecomposes: each
    block's (a block matrix), the space's (a dense one), none (any other)."""
    if rules & set(_EIGH_RULES["block"]):
        return [b.dim for b in space.blocks]
    return [space.dim] if rules & set(_EIGH_RULES["dense"]) else []


# ------------------------------------------------------------------ projections
def project_cost(node: Project, n: int, T: int, elem: int = 4, chunk: int | None = None,
                 drawn: set | None = None) -> Cost:
    """``node``'s projection of n examples in chunks of ``chunk``: per block, its kind's
    formula (:meth:`gradalg.proj.kinds.ProjectionKind.cost`, in :class:`ProjectionPrices`;
    docs/projections.md) and, once per process, drawing its matrix or tables
    (:meth:`~gradalg.proj.kinds.ProjectionKind.build_cost`).

    ``drawn``: the ``(projector, block, dim)`` matrices and tables an earlier pass of the
    same plan drew (the process keeps them); those are not drawn again, and this call adds
    the ones it draws to the set."""
    n = n * rows_of(node.grads)      # every Gauss-Newton term's rows are projected
    c, chunks = chunk_count(n, chunk)
    drawn = set() if drawn is None else drawn      # a block's matrix is drawn once per call at least
    p, kind, prices = node.projector, node.projector.kind_object, ProjectionPrices(elem)
    rep, total, cost = node.grads.representation, node.grads.space.dim, Cost()
    for b in node.grads.space.blocks:
        rows = Rows(n, c, chunks, T, rep[b.name] == "factored" and len(b.shape) == 2, total)
        cost = cost + kind.cost(p, b, rows, prices)
        if (p, b.name, b.dim) not in drawn:
            cost = cost + kind.build_cost(p, b, prices)
            drawn.add((p, b.name, b.dim))
    return cost


def sparse_table_bytes(p, b) -> float:
    """Bytes the process keeps for one block's index tables (:mod:`gradalg.proj.sparse_tables`,
    cached for the run): its kind's :meth:`~gradalg.proj.kinds.ProjectionKind.table_bytes`."""
    return p.kind_object.table_bytes(p, b)


#: small ops of one block's table-based projection per chunk (index tables, gathers, einsum,
#: new_zeros, the scatter product, scaling; ``gradalg.proj.kernels``)
OPS_PER_SPARSE_BLOCK = 16


@dataclass(frozen=True)
class ProjectionPrices(_Prices):
    """The counts a projection kind's ``cost(p, b, rows, prices)`` and ``build_cost`` are
    written in (:mod:`gradalg.proj.kinds`, a floor below the planner), for rows of ``elem``
    bytes: GEMMs, factors materialized, a Kronecker projection of factors, the fixed small
    ops of a table-based kernel per chunk, and any other counts as a :class:`Cost`."""

    elem: int = 4

    def counts(self, **fields) -> Cost:
        return Cost(**fields)

    def materialize(self, n: int, T: int, n_in: int, n_out: int) -> Cost:
        return materialize_cost(n, T, n_in, n_out, self.elem)

    def kron_factors(self, n: int, T: int, n_in: int, n_out: int, k_in: int, k_out: int) -> Cost:
        return kron_project_cost(n, T, n_in, n_out, k_in, k_out, self.elem)

    def block_ops(self, chunks: int) -> Cost:
        """:data:`OPS_PER_SPARSE_BLOCK` small ops per chunk."""
        return Cost(ops=float(chunks * OPS_PER_SPARSE_BLOCK))


# ------------------------------------------------------------------ row-wise transforms
def elementwise_cost(numbers: float, reads: float, writes: float, elem: int = 4) -> Cost:
    """``writes`` full-size tensor ops over ``numbers`` numbers that read ``reads`` operands
    in all: each op reads its inputs and writes a new output, whose memory is fresh
    (a chunk's (c, d) intermediates are larger than what the allocator keeps: each is
    page-faulted in, which on a CPU costs more than the arithmetic)."""
    return Cost(bytes=float(elem) * numbers * (reads + writes), faulted=float(elem) * numbers * writes)


#: full-size ops of Adam's preconditioning per chunk, ``m / (√v + ε)`` with
#: ``m = β₁ m₀ + (1 − β₁) g`` and ``v = β₂ v₀ + (1 − β₂) g²``
#: (:meth:`gradalg.expr.grads.AdamState.direction`, tiled): addcmul(β₂v₀, g, g),
#: √, + ε, add(β₁m₀, g), ÷ — operands read, outputs written; only the result is fresh
#: memory (v is one reused tile), one block at a time
ADAM_OPS = {"reads": 9, "writes": 5, "fresh": 1}


def factored_blocks(node, layout: dict) -> dict:
    """``{block: bool}``: the block's rows arrive as factors (``layout``) and it is 2-D."""
    return {b.name: layout.get(b.name) == "factors" and len(b.shape) == 2 for b in node.space.blocks}


def made_flat_cost(b, c: int, T: dict, factored: dict, elem: int) -> Cost:
    """A block's rows of one chunk made flat (materialized when they arrive as factors:
    ``factored``, :func:`factored_blocks`; ``T``: positions per block)."""
    if factored[b.name]:
        return materialize_cost(c, T[b.name], b.shape[1], b.shape[0], elem)
    return Cost()


def materialized_cost(node, c: int, layout: dict, elem: int, shapes: Mapping) -> Cost:
    """The factored blocks of a chunk of ``node`` materialized, one at a time."""
    T, factored = positions(node, shapes), factored_blocks(node, layout)
    return sum((made_flat_cost(b, c, T, factored, elem) for b in node.space.blocks), Cost())


@dataclass(frozen=True)
class RowPrices(_Prices):
    """The prices a row-wise node's ``row_cost(n, chunk, prices)`` is written in
    (:class:`gradalg.expr.RowWise`), for input rows of ``layout`` (``{block: "factors" |
    "flat"}``) of ``elem`` bytes under ``options``. ``drawn``: the projections whose
    matrices an earlier transform drew; ``resolved``: the tokens of the operators an earlier
    pass or transform resolved (an operator is resolved once in a plan; :meth:`per_chunk`
    adds the ones it resolves); ``shapes``: the plan's measured forward shapes (empty:
    ``tokens_hint``)."""

    layout: dict
    elem: int = 4
    options: object = None
    drawn: set | None = None
    resolved: set | None = None
    shapes: Mapping = field(default_factory=dict)

    def per_chunk(self, src, n: int, chunk: int | None, per, op=None) -> Cost:
        """``per(c)``, the cost of one chunk of c rows of ``src``, over the chunks of n
        examples' rows, plus resolving ``op`` once (when given and not resolved before)."""
        c, chunks = chunk_count(n * rows_of(src), chunk)
        once = resolve_once(op, self.resolved) if op is not None else Cost()
        return per(c).scaled(chunks) + once

    def positions(self, src) -> dict:
        return positions(src, self.shapes)

    def project(self, node, n: int, chunk: int | None) -> Cost:
        return project_cost(node, n, tokens_hint(node), self.elem, chunk, self.drawn)

    def materialize(self, src, c: int) -> Cost:
        return materialized_cost(src, c, self.layout, self.elem, self.shapes)

    def materialize_block(self, c: int, T: int, d_in: int, d_out: int) -> Cost:
        return materialize_cost(c, T, d_in, d_out, self.elem)

    def flatten(self, src, c: int) -> Cost:
        """The blocks of a chunk concatenated into one (c, d) tensor, factored blocks materialized first."""
        return elementwise_cost(c * src.space.dim, 1, 1, self.elem) + self.materialize(src, c)

    def apply(self, op, space, c: int) -> Cost:
        return apply_cost(op, space, c, self.elem, self.options, self.shapes)

    def elementwise(self, count: int, reads: int, writes: int) -> Cost:
        return elementwise_cost(count, reads, writes, self.elem)

    def svd(self, c: int, d_out: int, d_in: int) -> Cost:
        return svd_cost(c, d_out, d_in, self.elem)

    def norms(self, src, c: int) -> Cost:
        """Squared norms of c rows of ``src`` (read once; factored blocks by their ghost identity)."""
        return Cost(flops=2.0 * c * src.space.dim, bytes=float(self.elem) * c * src.space.dim)

    def adam(self, src, c: int) -> Cost:
        """:data:`ADAM_OPS` full-size elementwise ops on c rows, one into fresh memory
        (block by block: no concatenated row)."""
        d, elem = src.space.dim, self.elem
        return Cost(bytes=float(elem) * c * d * (ADAM_OPS["reads"] + ADAM_OPS["writes"]),
                    faulted=float(elem) * c * d * ADAM_OPS["fresh"])

    def scale_rows(self, src, c: int) -> Cost:
        """Each block of c rows scaled: factored (out, in) blocks by their output gradients."""
        T, factored = positions(src, self.shapes), factored_blocks(src, self.layout)
        return sum((elementwise_cost(c * T[b.name] * b.shape[0] if factored[b.name] else c * b.dim, 1, 1, self.elem)
                    for b in src.space.blocks), Cost())


def rowwise_cost(node, n: int, chunk: int | None, layout: dict, elem: int = 4, options=None,
                 drawn: set | None = None, resolved: set | None = None, shapes: Mapping = EMPTY) -> Cost:
    """The row-wise transform ``node`` derived from ``node.grads`` for n examples in
    chunks of ``chunk`` (``gradalg.exec.rowwise``); ``layout`` is ``{block: "factors" |
    "flat"}`` of the input rows. Each node type prices itself (``node.row_cost``, in
    :class:`RowPrices`): a projection by :func:`project_cost`, Adam's preconditioning by
    :data:`ADAM_OPS`, a normalization or preconditioner by :func:`apply_cost` of its
    operator (resolved once: ``resolved``), a rank-r approximation by
    :func:`~gradalg.plan.cost.svd_cost`, a selection or per-token split as views (free)."""
    return node.row_cost(n, chunk, RowPrices(layout, elem, options, drawn, resolved, shapes))


# ------------------------------------------------------------------ jobs
def pass_overhead(n_jobs: int, examples: int = 0, example_bytes: float = 0.0, reads_data: bool = True,
                  device: DeviceProfile = NOMINAL) -> Cost:
    """What a pass costs beyond its kernels: opening its sinks (and their checks), and
    for a pass over data (``reads_data``) the task's fingerprint and hooks
    (the ``device``'s ``ops_per_pass`` per job, else ``ops_per_memory_pass``) and the working set
    of each of its ``examples`` captured (``example_bytes``, the planner's memory
    estimate per example), touched fresh: the executor returns a batch's pages after
    it. A batch holds the examples there are, not more (8 examples in batches of 32
    touch 8 examples' memory)."""
    per_job = device.ops_per_pass if reads_data else device.ops_per_memory_pass
    return Cost(ops=per_job * max(1, n_jobs), faulted=examples * example_bytes)


def chunk_count(n_stream: int, chunk: int | None, row_sets: int = 1) -> tuple[int, int]:
    """``(c, chunks)``: examples per chunk (``chunk`` capped at ``n_stream``; None: all)
    and chunks a job sees over ``n_stream`` examples, one per chunk and per row set (one
    per Gauss-Newton term, ``row_sets``). A job's per-chunk work is costed for one chunk
    (its GEMMs have the chunk's shapes: a Gram over 32 rows is not a Gram over 20,000) and
    counted ``chunks`` times (:meth:`gradalg.plan.jobs.Job.stream_cost`)."""
    c = max(1, min(chunk or n_stream, n_stream))
    return c, max(1, math.ceil(n_stream / c)) * row_sets


def kernel_costs(n_held: int, n_stream: int, chunk: int, TL: int, TR: int, n_in: int, n_out: int,
                 elem: int = 4) -> dict[str, Cost]:
    """``{"ghost": Cost, "dense": Cost}``: one block's inner products between ``n_held``
    held examples (TL positions) and ``n_stream`` streamed ones (TR positions) in chunks
    of ``chunk``, by either kernel, as the scores job costs them (:meth:`ScoresJob.chunk_cost <gradalg.plan.jobs.ScoresJob.chunk_cost>`):
    ghost products per chunk (:func:`~gradalg.plan.cost.ghost_cost`), or the chunk
    materialized and one GEMM with the held rows, which are materialized once
    (:func:`~gradalg.plan.cost.dense_cost`). The planner prices both with its device
    profile and picks the faster."""
    c, chunks = chunk_count(n_stream, chunk)
    return {"ghost": ghost_cost(n_held, c, TL, TR, n_in, n_out, elem).scaled(chunks),
            "dense": (dense_cost(n_held, c, TL, TR, n_in, n_out, True, elem).scaled(chunks)
                      + materialize_cost(n_held, TL, n_in, n_out, elem))}


def resolve_bytes(op) -> float:
    """Peak working bytes of resolving ``op`` where it is applied (beside what the pass
    holds): an inverse or power of a dense or block matrix is
    :func:`~gradalg.linalg.base.sym_eig_map` on each matrix, one at a time: its float64
    copy and symmetrized copy, the eigenvectors, LAPACK's workspace (syevd: ≈ 2·d² numbers),
    then the scaled eigenvectors and their product, about 32·d² bytes for the widest d
    (measured 34–35·d² at d = 3,000 in float32 and float64), and a damped operator's shifted
    copy, 8·d² more (``dense.shift_diagonal``, ``block.shift_diagonals``). Kronecker
    operators resolve per factor in their own jobs (:mod:`gradalg.plan.jobs.kron`): 0 here."""
    rules = set(_rules(op))
    d = max(_eigh_dims(rules, op.space), default=0)
    return (EIGH_MAP_BYTES + (SHIFTED_COPY_BYTES if rules & set(_SHIFT_RULES) else 0.0)) * d * d


def resolve_once(op, resolved: set | None) -> Cost:
    """:func:`resolve_cost` unless ``op`` was resolved before in the plan (``resolved``, the
    tokens resolved so far, to which ``op`` is added)."""
    if resolved is not None:
        if op.token in resolved:
            return Cost()
        resolved.add(op.token)
    return resolve_cost(op)
