"""Bytes the jobs of a plan share: kept rows, a captured example, a Fisher's matrix, a
projection's workspace (each job type adds its own in its class, :mod:`gradalg.plan.jobs`;
the Kronecker statistics' in :mod:`gradalg.plan.jobs.kron`).

Rows of a gradient node, kept in memory (a held side, stored rows), take per example

    rows · Σ_b  T_b·(in_b + out_b)   numbers  for a block kept as factors (A, D)
    rows · Σ_b  dim_b                 numbers  for a block kept flat

with ``rows`` the rows per example (one per Gauss-Newton term for
``objective="expected"``), ``T_b`` the block's positions per example (tokens, or a
convolution's output pixels: :mod:`gradalg.plan.shapes`) and numbers of the model's
dtype. Capturing one example of a source keeps its activations for the backward and,
per block, the factors of each row (and autograd's copy of them). A Fisher's statistics
are float64: dense 8·d², block 8·Σ_b d_b², diag 8·d.

Kernels over factors work on blocks of ``b = min(T, token_block)`` positions
(``ga.options(token_block=...)``, :mod:`gradalg.capture.factors`), so their temporaries
are counted with b, not T: K-FAC statistics b·(in + out) per example, EK-FAC's rotation
the same, and the ghost kernel's three (nL', nR', bL, bR) intermediates at most
``max(ghost_slice_elements, bL·bR)`` elements each (:meth:`gradalg.plan.jobs.ScoresJob.ghost_workspace_bytes`).
"""
from __future__ import annotations

import itertools
from typing import Mapping

from ..capture.factors import Factors
from ..errors import MemoryBudgetError
from ..expr import AdamPrecondition, Captured, Normalize, Precondition, Project, Source
from ..expr.stored import Stored
from ..expr.lowrank import lowrank_below
from ..expr.tokens import token_rows
from ..linalg.labels import form_of
from .cost import tokens_hint
from .decisions import Decision, DecisionKind
from ..devices import physical_memory
from ..units import format_bytes, format_bytes_alike
from .shapes import ModelFacts, activation_bytes, element_size, forward_shapes, output_bytes, rows_per_example

__all__ = ["positions", "rows_of", "rows_bytes", "capture_bytes_per_example", "stream_workspace_bytes",
           "statistics_bytes", "check_statistics_fit", "projection_map_decisions",
           "projection_workspace_bytes", "flattened_rows_bytes", "quadratic_form_bytes"]


def positions(node, shapes: Mapping) -> dict[str, int]:
    """``{block: T_b}`` of a gradient node (its source's layers, measured in ``shapes``,
    ``{source token: ForwardShapes}`` of the plan's facts, else ``tokens_hint``;
    projections keep T; rows recorded by ``ga.capture``: the most positions of any of
    their chunks, in memory; rows of a rank-r approximation: r factor positions per
    truncated block)."""
    if (low := lowrank_below(node)) is not None:
        below = low.positions(positions(low.grads, shapes))
        return {b.name: below.get(b.name, 1) for b in node.space.blocks}
    src, T = node.source, tokens_hint(node)
    known = forward_shapes(src, shapes).positions if isinstance(src, Source) else {}
    if isinstance(src, Captured) and not isinstance(src, Stored) and token_rows(node) == 1:
        # ga.capture's rows, in memory (stored rows are flat): the longest factors of each block
        for chunk in src.store.chunks():
            for name, value in chunk.blocks.items():
                if isinstance(value, Factors):
                    known[name] = max(known.get(name, 1), value.T)
    # blocks a projection made (one flat block of a Gaussian projection) are rows, T unused
    return {b.name: known.get(b.name, T) for b in node.space.blocks}


def rows_of(node) -> int:
    """Rows per example of a gradient node (its source's objective)."""
    src = node.source
    return rows_per_example(src) if isinstance(src, Source) else 1


def rows_bytes(node, storage: dict, facts: ModelFacts) -> float:
    """Bytes of all rows of ``node`` kept as ``storage[block]`` ("factors" or "flat"), in
    ``facts.dtype`` at ``facts.shapes``' positions."""
    T = positions(node, facts.shapes)
    per_row = sum((T[b.name] * (b.shape[0] + b.shape[1]) if storage.get(b.name) == "factors" else b.dim
                   for b in node.space.blocks), 0.0)
    return node.n * rows_of(node) * per_row * facts.elem


def capture_bytes_per_example(src: Source, facts: ModelFacts, forward_shared: bool = False) -> float:
    """Bytes one example of ``src`` holds while its batch is captured: activations
    (forward outputs kept for the backward, and their gradients), and per row the
    factors of every block with autograd's copy.

    forward_shared : another source of the pass already runs this forward (same model
        and layers, another objective: one forward per batch, ``PassCapture``): its
        activations and input factors A are counted there; only this source's output
        factors D (and per-row blocks) are added."""
    shapes, elem, rows, total = forward_shapes(src, facts.shapes), facts.elem, rows_per_example(src), 0.0
    for b in src.space.blocks:
        T = shapes.positions[b.name]
        if len(b.shape) == 2:
            out_f, in_f = b.shape
            a_bytes = 0 if forward_shared else 3 * in_f   # A: unfolded, with its bias column, kept
            total += T * (a_bytes + 2 * rows * out_f) * elem   # D per row
        else:
            total += rows * b.dim * elem
    if forward_shared:
        return total
    T = tokens_hint(src)
    if shapes.measured and shapes.activations and any(t != T for b, t in shapes.positions.items()
                                                      if b not in shapes.routed):
        # layers see other position counts than the data's shape tells (convolutions):
        # the measured outputs of every module, kept for the backward, and their gradients
        total += 2.0 * shapes.activations * elem
    else:   # positions known from the data: the same formula with or without a measurement
        total += activation_bytes(src.task.model, T, elem)
    return total + output_bytes(src.task.model, T, elem)    # the loss's copies of the output


def projection_map_decisions(node, options) -> list[Decision]:
    """A ``PROJECTION_MAP`` :class:`~gradalg.plan.decisions.Decision` (its subject the
    projector's token) for each distinct projection of ``node`` with a flat-row map
    (:attr:`~gradalg.expr.projection.Projector.map`: dense, sparse JL, TensorSketch): the
    map it applies, what each map would hold and do per example, and the two
    thresholds the methods' defaults choose by (:func:`~gradalg.expr.projection.dense_or_sparse`):
    a dense (k, d) float64 matrix against ``options.dense_projection_bytes``, SJLT tables
    (5·d bytes) against ``options.sjlt_table_bytes``. Every map is applied block by block
    (each block's own seeded matrix or table; a global map is the sum of the blocks')."""
    rows, seen = [], set()
    for x in (x for x in node.walk() if isinstance(x, Project) and x.projector.map is not None):
        p, space, d = x.projector, x.grads.space, x.grads.space.dim
        if (p.token, d) in seen:
            continue
        seen.add((p.token, d))
        dense, tables = 8.0 * p.k * d, 5.0 * p.s * d
        sides = sum(sum(b.shape) if len(b.shape) == 2 else 1 + b.dim for b in space.blocks)
        alternatives = {"dense": f"{format_bytes(dense)} matrix, {p.k * d:.3g} multiply-adds per example",
                        "sparse JL": f"{format_bytes(tables)} tables, {p.s * d:.3g} additions per example (each "
                                     "layer's gradient formed from its factors)",
                        "tensorsketch": f"{format_bytes(9.0 * sides)} tables, FFTs of k per position (no layer's "
                                        "gradient formed)"}
        verdict = []
        for what, n, option in ((f"a dense ({p.k}, {d}) matrix takes", dense, "dense_projection_bytes"),
                                ("SJLT tables", tables, "sjlt_table_bytes")):
            shown, cap = format_bytes_alike(n, getattr(options, option))
            verdict.append(f"{what} {shown}, {'over' if n > getattr(options, option) else 'within'} "
                           f"ga.options({option}='{cap}')")
        rows.append(Decision(
            DecisionKind.PROJECTION_MAP, p.token, p.map, alternatives,
            "; ".join(verdict) + " (trak and less default to the dense map within the first, the SJLT "
            "within the second, a TensorSketch above it; less keeps the SJLT: its Adam rows are flat); "
            f"applied to {len(space.blocks)} block(s) one at a time, each with its own seeded "
            + ("matrix" if p.map == "dense" else "tables")
            + (", summed into k coordinates" if not p.per_block else ""), label=f"{p!r} of {d:,} coordinates"))
    return rows


def _chain(node):
    """``node`` and the nodes below it through ``.grads`` (its row-wise chain and root)."""
    while node is not None and hasattr(node, "grads"):
        yield node
        node = node.grads


def projection_workspace_bytes(node, facts: ModelFacts) -> float:
    """Working bytes per example of the projections in ``node``'s row-wise chain, beyond
    their outputs: a dense or sparse-JL projection forms one block's rows at a time (from
    its factors, or Adam-preconditioned: ``exec/rowwise.py``) and the product reads a
    transposed copy, so it holds 2·d_b numbers per example of its largest block b (a
    sparse projection's slices are capped by ``projection_slice_elements``: this is an
    upper bound); Adam's preconditioning adds two more temporaries of the block; a
    TensorSketch holds two count sketches of k and their FFTs per position (T positions:
    an upper bound)."""
    out = 0.0
    for x in (x for x in _chain(node) if isinstance(x, Project) and x.projector.map is not None):
        if x.projector.map == "tensorsketch":
            T = max(positions(x.grads, facts.shapes).values(), default=1)
            out = max(out, 4.0 * facts.elem * T * (x.projector.k + 2))
        else:
            widest = max((b.dim for b in x.grads.space.blocks), default=0)
            out = max(out, (4.0 if isinstance(x.grads, AdamPrecondition) else 2.0) * facts.elem * widest)
    return out


def flattened_rows_bytes(streams, dtype) -> float:
    """Working bytes per example of an operator applied to rows below a projection
    (``Precondition`` under a ``Project``: TrackStar's 1/(√v̂ + ε) before its projection):
    ``Precondition.apply`` flattens the whole space of its input and writes the product,
    2·d numbers per example (d: the whole space's dimension, 10⁸ on a real-size LM, where
    a projection alone holds 2·d_b of one block). Jobs of one pass that read the same rows
    derive them once, so a pass counts the largest over all its jobs' streams, once."""
    elem = element_size(dtype)
    below = (itertools.islice(itertools.dropwhile(lambda x: not isinstance(x, Project), _chain(node)), 1, None)
             for node in streams)    # each chain's nodes below its first projection
    return max((2.0 * elem * x.space.dim for chain in below for x in chain if isinstance(x, Precondition)), default=0.0)


def quadratic_form_bytes(op, space, elem: float) -> float:
    """Working bytes per row of ``q_i = ⟨L_i, H R_i⟩``
    (:func:`~gradalg.linalg.quadratic.row_quadratic`: RelatIF's ``normalize(metric=H)``, a
    self-influence's diagonal), H = ``op``: for a Kronecker H (K-FAC / EK-FAC), applied a
    block at a time, 5·d_b numbers of the widest block b (its rows rotated in, scaled,
    rotated back through one intermediate, the flat rows and their product); for any other
    H, applied to the concatenated rows, 3·d (the flat rows, their image, the product).
    (Before, the flat path ran for every H: 3·d per row at 85 M coordinates, 8 rows a chunk,
    was 8 GB the plans of RelatIF and self-influence on GPT-2 small did not count.)"""
    if form_of(op.labels().labels) == "kronecker":
        return 5.0 * elem * max((b.dim for b in space.blocks), default=0)
    return 3.0 * elem * space.dim


def stream_workspace_bytes(streams, facts: ModelFacts) -> float:
    """Working bytes per example of the projections a job's ``streams`` apply
    (:func:`projection_workspace_bytes`, the largest); rows of one example's Gauss-Newton
    terms arrive as separate chunks: counted once. Plus the metric normalizations
    (``Normalize`` with an operator) in their row-wise chains: :func:`quadratic_form_bytes`
    per row, the largest; each row is then scaled in place of the rows (factored ones by
    their output gradients), so nothing of d is kept. Every job's
    :meth:`~gradalg.plan.jobs.Job.per_example_bytes` adds its own on top."""
    normalize = max((rows_of(x) * quadratic_form_bytes(x.op, x.space, facts.elem) for node in streams
                     for x in _chain(node) if isinstance(x, Normalize) and x.op is not None), default=0.0)
    return max((projection_workspace_bytes(s, facts) for s in streams), default=0.0) + normalize


def statistics_bytes(space, structure: str) -> float:
    """Float64 bytes of a Fisher's accumulated matrix over ``space``: d² (``structure``
    "dense"), Σ_b d_b² ("block"), d ("diag")."""
    return 8.0 * {"dense": space.dim ** 2, "block": sum(b.dim ** 2 for b in space.blocks),
                  "diag": space.dim}[structure]


def inverse_bytes(space, structure: str) -> float:
    """Peak working bytes of inverting a Fisher damped, where it is applied
    (:func:`~gradalg.plan.estimates.resolve_bytes`): (32 + 8)·d² for the widest matrix of a
    dense or block structure, its d float64 numbers for a diagonal."""
    from .estimates import EIGH_MAP_BYTES, SHIFTED_COPY_BYTES
    per = EIGH_MAP_BYTES + SHIFTED_COPY_BYTES
    return {"dense": per * space.dim ** 2, "block": per * max(b.dim ** 2 for b in space.blocks),
            "diag": 8.0 * space.dim}[structure]


def check_statistics_fit(node, memory_budget: int) -> None:
    """Refuse a Fisher whose matrix alone exceeds the budget, naming the fixes that fit: a
    Kronecker curvature (always: its factors are per layer), a projection small enough, the
    other structures whose matrix fits, and a larger budget only where the machine has the
    memory (``err.fits_under``, else None: the planner's note, :func:`~gradalg.plan.budget.refusal_note`,
    names a budget that fits, written the way the budget was given); ``err.needed`` is the larger
    of the matrix and the peak of inverting it. A fix is named only where the matrix *and* its damped inverse
    (:func:`inverse_bytes`, what the methods do with it) fit the budget it names. The
    projection: ga.proj.kron(k) leaves at most k² coordinates per block (k_out·k_in), so a
    dense Fisher of d ≤ n_blocks·k² whose inverse, (32 + 8)·d², fits the budget."""
    space, need = node.space, statistics_bytes(node.space, node.structure)
    if need <= memory_budget:
        return
    fixes = ["a Kronecker curvature, ga.ekfac(G) or ga.kfac(G) (in ga.methods.influence / relatif: "
             "curvature='ekfac')"]
    from .estimates import EIGH_MAP_BYTES, SHIFTED_COPY_BYTES
    k = int(((memory_budget / (EIGH_MAP_BYTES + SHIFTED_COPY_BYTES)) ** 0.5 / len(space.blocks)) ** 0.5)
    if k >= 1:
        fixes.append(f"project first, ga.fisher(P(G)) with P = ga.proj.kron(k={k}) (in the methods: "
                     f"projector=ga.proj.kron(k={k}))")
    fitting = {s: b for s in ("block", "diag") if s != node.structure
               and (b := max(statistics_bytes(space, s), inverse_bytes(space, s))) <= memory_budget}
    fixes += [f"structure={s!r} ({b})" for s, b in zip(fitting, format_bytes_alike(*fitting.values()))]
    inverted = max(need, inverse_bytes(space, node.structure))
    roomy = inverted <= physical_memory()
    if roomy:   # the plan's note names the budget, written the way it was given (budget.refusal_note)
        fixes.append("a larger memory budget")
    raise MemoryBudgetError(
        f"a {node.structure} Fisher over {space.dim:,} coordinates", inverted, memory_budget,
        parts=[("its matrix", need), ("inverting it (the peak)", inverse_bytes(space, node.structure))],
        fixes=fixes, fits_under=inverted if roomy else None)
