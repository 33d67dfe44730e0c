"""Bytes of a plan's jobs: every size the planner compares with the memory budget.

Rows of a gradient node, kept in memory (a held side, stored rows), take per example

    rows · Σ_b  T_b·(in_b + out_b)   numbers  for a block kept as factors (A, D)
    rows · Σ_b  dim_b                 numbers  for a block kept flat

with ``rows`` the rows per example (one per Gauss-Newton term for
``objective="expected"``), ``T_b`` the block's positions per example (tokens, or a
convolution's output pixels: :mod:`gradalg.plan.shapes`) and numbers of the model's
dtype. Capturing one example of a source keeps its activations for the backward and,
per block, the factors of each row (and autograd's copy of them). Statistics are float64:
a dense Fisher 8·d², Kronecker factors 8·(out² + in²) per block.

Kernels over factors work on blocks of ``b = min(T, token_block)`` positions
(``ga.options(token_block=...)``, :mod:`gradalg.capture.factors`), so their temporaries
are counted with b, not T: K-FAC statistics b·(in + out) per example, EK-FAC's rotation
the same, and the ghost kernel's three (nL', nR', bL, bR) intermediates at most
``max(ghost_slice_elements, bL·bR)`` elements each (:func:`ghost_workspace_bytes`).
"""
from __future__ import annotations

import os

from ..capture.factors import Factors, compute_dtype, ghost_workspace_elements
from ..errors import MemoryBudgetError
from ..expr import Captured, Project, Source
from ..expr.stored import Stored
from ..expr.lowrank import lowrank_below
from ..expr.tokens import token_rows
from .budget import suggest_budget
from .cost import _si, activation_bytes, output_bytes, tokens_hint
from .decisions import Decision, DecisionKind
from .shapes import element_size, forward_shapes, rows_per_example

__all__ = ["positions", "rows_of", "rows_bytes", "capture_bytes_per_example", "stream_workspace_bytes", "flat_example_bytes",
           "kfac_example_bytes", "ekfac_rotated_bytes",
           "kron_bytes", "kron_output_bytes", "ekfac_example_bytes", "ekfac_bytes", "kron_factor_bytes", "kron_precision_decisions", "kron_bytes_arithmetic",
           "statistics_bytes", "check_statistics_fit", "captured_positions", "ghost_workspace_bytes",
           "ghost_norm_bytes_per_example", "token_block_of", "projection_map_decisions",
           "projection_workspace_bytes"]


def positions(node) -> dict[str, int]:
    """``{block: T_b}`` of a gradient node (its source's layers; projections keep T; rows
    recorded by ``ga.capture``: the most positions of any of their chunks, in memory;
    rows of a rank-r approximation: r factor positions per truncated block)."""
    low = lowrank_below(node)
    if low is not None:
        below = low.positions(positions(low.grads))
        return {b.name: below.get(b.name, 1) for b in node.space.blocks}
    src = node.source
    T = tokens_hint(node)
    if isinstance(src, Source):
        known = forward_shapes(src).positions
    elif isinstance(src, Captured) and not isinstance(src, Stored) and token_rows(node) == 1:
        known = captured_positions(src)   # ga.capture's rows, in memory; stored rows are flat
    else:
        known = {}
    # blocks a projection made (one flat block of a Gaussian projection) are rows, T unused
    return {b.name: known.get(b.name, T) for b in node.space.blocks}


def captured_positions(src: Captured) -> dict[str, int]:
    """``{block: T_b}`` of captured rows: the longest factors of each block (their shapes,
    read from the chunks held in memory)."""
    out: dict[str, int] = {}
    for chunk in src.store.chunks():
        for name, value in chunk.blocks.items():
            if isinstance(value, Factors):
                out[name] = max(out.get(name, 1), value.T)
    return out


def rows_of(node) -> int:
    """Rows per example of a gradient node (its source's objective)."""
    src = node.source
    return rows_per_example(src) if isinstance(src, Source) else 1


def rows_bytes(node, storage: dict, dtype) -> float:
    """Bytes of all rows of ``node`` kept as ``storage[block]`` ("factors" or "flat")."""
    T, elem = positions(node), element_size(dtype)
    per_row = 0.0
    for b in node.space.blocks:
        if storage.get(b.name) == "factors":
            per_row += T[b.name] * (b.shape[0] + b.shape[1])
        else:
            per_row += b.dim
    return node.n * rows_of(node) * per_row * elem


def capture_bytes_per_example(src: Source, dtype, forward_shared: bool = False) -> float:
    """Bytes one example of ``src`` holds while its batch is captured: activations
    (forward outputs kept for the backward, and their gradients), and per row the
    factors of every block with autograd's copy.

    forward_shared : another source of the pass already runs this forward (same model
        and layers, another objective: one forward per batch, ``PassCapture``): its
        activations and input factors A are counted there; only this source's output
        factors D (and per-row blocks) are added."""
    elem = element_size(dtype)
    shapes = forward_shapes(src)
    rows = rows_per_example(src)
    total = 0.0
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
    if shapes.measured and shapes.activations and any(t != T for t in shapes.positions.values()):
        # layers see other position counts than the data's shape tells (convolutions):
        # the measured outputs of every module, kept for the backward, and their gradients
        total += 2.0 * shapes.activations * elem
    else:   # positions known from the data: the same formula with or without a measurement
        total += activation_bytes(src.task.model, T, elem)
    return total + output_bytes(src.task.model, T, elem)    # the loss's copies of the output


def _factor_widths(space):
    """``(out, in)`` of each Kronecker-factored (2-D) block."""
    return [(b.shape[0], b.shape[-1]) for b in space.blocks]


def kron_factor_bytes(d: int, float64_width: int | None, diagonal_width: int | None = None) -> dict:
    """Bytes of one d-wide Kronecker factor: ``sum`` (float64, or float32 with its Kahan
    compensation: 8·d² either way), ``basis`` (its eigenvectors: 8·d² or 4·d²) and ``eigh``
    (the peak of its eigendecomposition beyond the basis: the symmetrized input and
    LAPACK's workspace, 24·d² in float64; 12·d² in float32, with the float64 check's
    three (d, 512) column blocks). float32 beyond ``float64_width``. Beyond
    ``diagonal_width`` the factor is its diagonal: a float64 sum of 8·d bytes, no basis
    (the identity) and no eigendecomposition (``"dtype": "diagonal"``)."""
    if diagonal_width is not None and d > diagonal_width:
        return {"dtype": "diagonal", "sum": 8.0 * d, "basis": 0.0, "eigh": 0.0}
    wide = float64_width is not None and d > float64_width
    elem = 4.0 if wide else 8.0
    return {"dtype": "float32" if wide else "float64", "sum": 8.0 * d * d, "basis": elem * d * d,
            "eigh": 3.0 * elem * d * d + (3 * 8.0 * d * 512 if wide else 0.0)}


def _eigenvalue_bytes(o: int, i: int, parts) -> float:
    """An (out, in) eigenvalue grid (EK-FAC's re-fitted Λ): float32 when a factor is
    float32, else float64."""
    return o * i * _eigenvalue_element(parts)


def _kfac_eigenvalue_bytes(o: int, i: int, parts) -> float:
    """K-FAC's eigenvalues Λ = λ_S λ_Aᵀ, kept as the two vectors (out + in numbers; the grid
    is made a slice at a time where it is applied: :class:`~gradalg.linalg.kron.BlockEigenvalues`)."""
    return (o + i) * _eigenvalue_element(parts)


def _eigenvalue_element(parts) -> float:
    return 4.0 if any(p["dtype"] == "float32" for p in parts) else 8.0


def _dense_widths(space, diagonal_width: int | None) -> list[int]:
    """The widths of the factors kept as d × d matrices."""
    return [d for o, i in _factor_widths(space) for d in (o, i)
            if diagonal_width is None or d <= diagonal_width]


def kron_bytes(space, float64_width: int | None = None, diagonal_width: int | None = None) -> float:
    """K-FAC's statistics and eigendecompositions, the larger of two moments:

    * a chunk's update: every block's two factor sums, and the widest dense factor's
      d × d product with its float64 copy or the Kahan sum's new total (12·d²);
    * finishing, block by block (``KronAccumulator.finish``): a block's sums are freed as
      its covariances are formed and eigendecomposed, so each block holds the larger of
      its sums and its eigenbases; beside them every block's two eigenvalue vectors
      (λ_S, λ_A: K-FAC's Λ = λ_S λ_Aᵀ is never kept as a grid), and the larger of one
      block's covariance copies and one eigendecomposition's workspace.

    Factors wider than ``float64_width`` in float32, wider than ``diagonal_width``
    diagonal (8·d bytes, no basis: :func:`kron_factor_bytes`)."""
    sums, held, lam, eigh, copies = 0.0, 0.0, 0.0, 0.0, 0.0
    for o, i in _factor_widths(space):
        parts = [kron_factor_bytes(d, float64_width, diagonal_width) for d in (o, i)]
        block_sums = sum(p["sum"] for p in parts)
        sums += block_sums
        held += max(block_sums, sum(p["basis"] for p in parts))
        lam += _kfac_eigenvalue_bytes(o, i, parts)
        eigh = max([eigh] + [p["eigh"] for p in parts])
        copies = max(copies, block_sums)
    widest = max(_dense_widths(space, diagonal_width) or [0])
    return max(sums + 12.0 * widest * widest, held + lam + max(eigh, copies))


def ekfac_bytes(space, float64_width: int | None = None, diagonal_width: int | None = None) -> float:
    """EK-FAC's correction pass: the K-FAC eigenbases and eigenvalue vectors it rotates
    into, its float64 sums of squares (one (out, in) grid per block) and, when it
    finishes, the corrected eigenvalues (one grid per block) beside them."""
    total = 0.0
    for o, i in _factor_widths(space):
        parts = [kron_factor_bytes(d, float64_width, diagonal_width) for d in (o, i)]
        total += (sum(p["basis"] for p in parts) + _kfac_eigenvalue_bytes(o, i, parts)
                  + _eigenvalue_bytes(o, i, parts) + 8.0 * o * i)
    return total


def kron_output_bytes(space, float64_width: int | None = None, diagonal_width: int | None = None,
                      refit: bool = False) -> float:
    """Bytes of the Kronecker operator a job produces: eigenbases and eigenvalues — K-FAC's
    two vectors per block, or with ``refit`` EK-FAC's (out, in) grid per block. The
    operators a score derives from it (damped, inverted, powers) share these numbers
    (:class:`~gradalg.linalg.kron.BlockEigenvalues`): the scores pass holds no other
    copy, and makes Λ a slice of rows at a time (``gradalg.linalg.kron._SLICE_ELEMENTS`` numbers)."""
    total = 0.0
    for o, i in _factor_widths(space):
        parts = [kron_factor_bytes(d, float64_width, diagonal_width) for d in (o, i)]
        lam = _eigenvalue_bytes(o, i, parts) if refit else _kfac_eigenvalue_bytes(o, i, parts)
        total += sum(p["basis"] for p in parts) + lam
    return total


def kron_bytes_arithmetic(space, float64_width: int | None = None, diagonal_width: int | None = None) -> str:
    """:func:`kron_bytes` spelled out: the sums, bases and eigenvalues of the blocks, and
    the largest eigendecomposition, with the widest factor's size and precision; when a
    dense factor is wider than ``float64_width``, the option that keeps it diagonal and
    what the statistics then take (the fix a refusal names)."""
    sums = bases = lam = 0.0
    widest, eigh = 0, 0.0
    diagonal = []
    for o, i in _factor_widths(space):
        parts = [kron_factor_bytes(d, float64_width, diagonal_width) for d in (o, i)]
        sums += sum(p["sum"] for p in parts)
        bases += sum(p["basis"] for p in parts)
        lam += _kfac_eigenvalue_bytes(o, i, parts)
        for d, p in zip((o, i), parts):
            if p["dtype"] == "diagonal":
                diagonal.append(d)
            elif p["eigh"] > eigh:
                widest, eigh = d, p["eigh"]
    update = 12.0 * max(_dense_widths(space, diagonal_width) or [0]) ** 2
    text = (f"Kronecker statistics of {len(space.blocks)} block(s): factor sums {_gb(sums)} GB + a chunk's update "
            f"({_gb(update)} GB), or, finishing block by block, each block's larger of its sums and eigenbases "
            f"(eigenbases {_gb(bases)} GB in all) + eigenvalues {_gb(lam)} GB")
    if widest:
        dtype = kron_factor_bytes(widest, float64_width)["dtype"]
        text += f" + the largest eigendecomposition ({widest}×{widest}, {dtype}) {_gb(eigh)} GB"
    if diagonal:
        text += f"; {len(diagonal)} factor(s) of width {max(diagonal):,} kept diagonal"
    text += f" = {_gb(kron_bytes(space, float64_width, diagonal_width))} GB"
    if widest and float64_width is not None and widest > float64_width:
        narrower = max([d for d in _dense_widths(space, diagonal_width) if d < widest] or [1])
        text += (f"; to keep the {widest}×{widest} factor (and any wider) diagonal instead, "
                 f"ga.options(kron_diagonal_width={narrower}): "
                 f"{_gb(kron_bytes(space, float64_width, narrower))} GB")
    return text


def kron_precision_decisions(op, options) -> list[Decision]:
    """A :class:`~gradalg.plan.decisions.Decision` about the K-FAC operator ``op`` for each
    block with a factor wider than ``options.kron_float64_width`` (``KRON_PRECISION``, with
    the bytes of both precisions) or wider than ``options.kron_diagonal_width``
    (``KRON_DIAGONAL``: diagonal, with the bytes of the dense factor it replaces)."""
    width, diagonal_width = options.kron_float64_width, options.kron_diagonal_width
    rows = []
    for b in op.space.blocks:
        if len(b.shape) != 2:
            continue
        o, i = b.shape[0], b.shape[-1]
        diag = [(label, d) for label, d in (("S", o), ("A", i)) if d > diagonal_width]
        if diag:
            rows.append(_diagonal_decision(op, b, diag, options))
        wide = [(label, d) for label, d in (("S", o), ("A", i)) if width < d <= diagonal_width]
        if not wide:
            continue
        d = max(dd for _, dd in wide)
        f32, f64 = kron_factor_bytes(d, width), kron_factor_bytes(d, None)
        peak32, peak64 = f32["sum"] + f32["basis"] + f32["eigh"], f64["sum"] + f64["basis"] + f64["eigh"]
        factors = " and ".join(f"{label} ({dd}×{dd})" for label, dd in wide)
        rows.append(Decision(
            DecisionKind.KRON_PRECISION, op.token, "float32",
            {"float32": f"{_gb(peak32)} GB at its eigendecomposition",
             "float64": f"{_gb(peak64)} GB at its eigendecomposition"},
            f"{factors} wider than ga.options(kron_float64_width={width}): summed in float32 with a Kahan "
            f"compensation ({_gb(f32['sum'])} GB), eigendecomposed in float32 on the device "
            f"(basis {_gb(f32['basis'])} GB, workspace {_gb(f32['eigh'])} GB; float64: {_gb(f64['basis'])} GB and "
            f"{_gb(f64['eigh'])} GB) and checked to kron_float32_rtol={options.kron_float32_rtol:g} "
            "(residual, orthogonality, the error of inverted eigenvalues)", block=b.name))
    return rows


def _diagonal_decision(op, b, diag: list, options) -> Decision:
    """The decision about block ``b`` of ``op`` whose factors ``diag`` ([(side, width)]) are kept diagonal."""
    dense = [kron_factor_bytes(d, options.kron_float64_width) for _, d in diag]
    dense_peak = sum(p["sum"] + p["basis"] for p in dense) + max(p["eigh"] for p in dense)
    kept = sum(8.0 * d for _, d in diag)
    sides = []
    for label, d in diag:
        if label == "A" and b.kind == "embedding":
            sides.append(f"A ({d:,}×{d:,}) exact: an embedding's one-hot inputs have a diagonal covariance, "
                         "the token counts")
        elif label == "S" and b.kind == "tied":
            sides.append(f"S ({d:,}×{d:,}) approximated by diag(S): the tied embedding's one-hot rows add "
                         "exactly diagonal terms, the head's output-gradient covariances lose their "
                         "off-diagonal entries")
        else:
            sides.append(f"{label} ({d:,}×{d:,}) approximated by its diagonal: the off-diagonal covariances "
                         "are dropped")
    return Decision(DecisionKind.KRON_DIAGONAL, op.token, "diagonal",
            {"diagonal": f"{_gb(kept)} GB, no eigendecomposition",
             "dense": f"{_gb(dense_peak)} GB at its eigendecomposition"},
            f"wider than ga.options(kron_diagonal_width={options.kron_diagonal_width}): "
            + "; ".join(sides)
            + ". The identity is the diagonal factor's eigenbasis (rule kronecker.diagonal_factor); EK-FAC "
              "re-fits its eigenvalues per coordinate", block=b.name)


def projection_map_decisions(node, options) -> list[Decision]:
    """A ``PROJECTION_MAP`` :class:`~gradalg.plan.decisions.Decision` (its subject the
    projector's token) for each distinct dense, sparse-JL or
    TensorSketch projection (``gaussian``, ``rademacher``, ``sparse``, ``tensorsketch``) of
    ``node``: the map it applies, what each map would hold and do per example, and the two
    thresholds the methods' defaults choose by (:func:`~gradalg.expr.projection.dense_or_sparse`):
    a dense (k, d) float64 matrix against ``options.dense_projection_bytes``, SJLT tables
    (5·d bytes) against ``options.sjlt_table_bytes``. Every map is applied block by block
    (each block's own seeded matrix or table; a global map is the sum of the blocks')."""
    names = {"gaussian": "dense", "rademacher": "dense", "sparse": "sparse JL", "tensorsketch": "tensorsketch"}
    rows, seen = [], set()
    for x in node.walk():
        if not isinstance(x, Project) or x.projector.kind not in names:
            continue
        p, space = x.projector, x.grads.space
        d = space.dim
        if (p.token, d) in seen:
            continue
        seen.add((p.token, d))
        dense, tables = 8.0 * p.k * d, 5.0 * p.s * d
        sides = sum(sum(b.shape) if len(b.shape) == 2 else 1 + b.dim for b in space.blocks)
        alternatives = {"dense": f"{_gb(dense)} GB matrix, {p.k * d:.3g} multiply-adds per example",
                        "sparse JL": f"{_gb(tables)} GB tables, {p.s * d:.3g} additions per example (each "
                                     "layer's gradient formed from its factors)",
                        "tensorsketch": f"{_gb(9.0 * sides)} GB tables, FFTs of k per position (no layer's "
                                        "gradient formed)"}
        verdict = [f"a dense ({p.k}, {d}) matrix takes {_gb(dense)} GB, "
                   + ("over" if dense > options.dense_projection_bytes else "within")
                   + f" ga.options(dense_projection_bytes={_gb(options.dense_projection_bytes)} GB)",
                   f"SJLT tables {_gb(tables)} GB, "
                   + ("over" if tables > options.sjlt_table_bytes else "within")
                   + f" ga.options(sjlt_table_bytes={_gb(options.sjlt_table_bytes)} GB)"]
        rows.append(Decision(
            DecisionKind.PROJECTION_MAP, p.token, names[p.kind], alternatives,
            "; ".join(verdict) + " (trak and less default to the dense map within the first, the SJLT "
            "within the second, a TensorSketch above it; less keeps the SJLT: its Adam rows are flat); "
            f"applied to {len(space.blocks)} block(s) one at a time, each with its own seeded "
            + ("matrix" if names[p.kind] == "dense" else "tables")
            + (", summed into k coordinates" if not p.per_block else ""), label=f"{p!r} of {d:,} coordinates"))
    return rows


def _gb(nbytes: float) -> str:
    """Bytes in GB (10⁹) to three significant digits: "0.0084", "1.64", "13.2"."""
    return f"{nbytes / 1e9:.3g}"


def projection_workspace_bytes(node, dtype) -> float:
    """Working bytes per example of the projections in ``node``'s row-wise chain, beyond
    their outputs: a dense or sparse-JL projection forms one block's rows at a time (from
    its factors, or Adam-preconditioned: ``exec/rowwise.py``) and the product reads a
    transposed copy, so it holds 2·d_b numbers per example of its largest block b (a
    sparse projection's slices are capped by ``projection_slice_elements``: this is an
    upper bound); Adam's preconditioning adds two more temporaries of the block; a
    TensorSketch holds two count sketches of k and their FFTs per position."""
    elem = element_size(dtype)
    out = 0.0
    x = node
    while x is not None and hasattr(x, "grads"):
        if isinstance(x, Project) and x.projector.kind == "tensorsketch":
            # a token block's two count sketches and their FFTs (T positions: an upper bound)
            T = max(positions(x.grads).values(), default=1)
            out = max(out, 4.0 * elem * T * (x.projector.k + 2))
        elif isinstance(x, Project) and x.projector.kind in ("gaussian", "rademacher", "sparse"):
            widest = max((b.dim for b in x.grads.space.blocks), default=0)
            adam = type(x.grads).__name__ == "AdamPrecondition"
            out = max(out, (4.0 if adam else 2.0) * elem * widest)
        x = x.grads
    return out


def stream_workspace_bytes(streams, dtype) -> float:
    """Working bytes per example of the projections a job's ``streams`` apply
    (:func:`projection_workspace_bytes`, the largest); rows of one example's Gauss-Newton
    terms arrive as separate chunks: counted once. Every job's
    :meth:`~gradalg.plan.jobs.Job.per_example_bytes` adds its own on top."""
    return max((projection_workspace_bytes(s, dtype) for s in streams), default=0.0)


def flat_example_bytes(node, dtype, copy_bytes: float) -> float:
    """One example's rows of ``node`` materialized flat, and ``copy_bytes`` more per
    coordinate (a Fisher's float64 copy and product: 16; a self-score's product: 8)."""
    return node.space.dim * (element_size(dtype) + copy_bytes)


def kfac_example_bytes(node, token_block: int | None) -> float:
    """K-FAC's sums of one example: one token block of its factors in float64 per 2-D block."""
    T = positions(node)
    return sum(_token_block(token_block, T[b.name]) * sum(b.shape) * 8.0
               for b in node.space.blocks if len(b.shape) == 2)


def ekfac_rotated_bytes(node, token_block: int | None, diagonal_width: int | None) -> float:
    """EK-FAC's correction of one example: rotated gradients, squared (float64), and one
    token block of rotated factors; a block with a diagonal factor is rotated one example
    at a time (:func:`ekfac_example_bytes`, counted in the job's fixed bytes)."""
    T = positions(node)
    diag = _diagonal_blocks(node.space, diagonal_width)
    return sum((16.0 * b.dim if b.name not in diag else 0.0)
               + (_token_block(token_block, T[b.name]) * sum(b.shape) * 8.0 if len(b.shape) == 2 else 0.0)
               for b in node.space.blocks)


def _token_block(block: int | None, T: int) -> int:
    return min(T, block) if block else T


def _diagonal_blocks(space, diagonal_width: int | None) -> set:
    """Names of the 2-D blocks of ``space`` with a factor wider than ``diagonal_width``."""
    return {b.name for b in space.blocks if len(b.shape) == 2 and diagonal_width is not None
            and max(b.shape) > diagonal_width}


def ekfac_example_bytes(space, diagonal_width: int | None) -> float:
    """EK-FAC's correction of a block with a diagonal factor, one example at a time: its
    rotated (out, in) gradient, squared in place, and their float64 copy (or the scattered
    one-hot gradient and its rotation): 16·out·in bytes for the largest such block."""
    diag = _diagonal_blocks(space, diagonal_width)
    return max([16.0 * b.dim for b in space.blocks if b.name in diag] or [0.0])


def token_block_of(job, T: int) -> int:
    """Positions per example the job's kernels take at once: ``min(T, job.token_block)``."""
    return _token_block(getattr(job, "token_block", None), T)


def ghost_norm_bytes_per_example(job, dtype) -> float:
    """Bytes per streamed example of the ghost norms ‖G_i‖² of a self-score (diag) job:
    three (bT, bS) Gram-sized intermediates per example for the widest-positioned
    factored block (b = min(T, token_block); the kernel caps a slice at
    ``max(ghost_slice_elements, b²)`` elements, so this overcounts large batches)."""
    import torch
    if not job.streams:
        return 0.0
    node = job.streams[0]
    elem = element_size(compute_dtype(dtype if isinstance(dtype, torch.dtype) else torch.float32))
    T = positions(node)
    worst = max([token_block_of(job, T[b.name]) ** 2 for b in node.space.blocks if len(b.shape) == 2] or [0])
    return 3.0 * elem * worst


def ghost_workspace_bytes(job, dtype) -> float:
    """Bytes of the ghost kernel's intermediates for a scores job: per ghost block the
    activation Gram, the gradient Gram and their product, each
    :func:`~gradalg.capture.factors.ghost_workspace_elements` numbers of the compute dtype
    (float32 for half-precision factors); the blocks run one after the other, so the
    largest counts."""
    import torch
    elem = element_size(compute_dtype(dtype if isinstance(dtype, torch.dtype) else torch.float32))
    held, streamed = job.held, job.streams[0]
    P_h, P_s = positions(held), positions(streamed)
    worst = 0
    for b in held.space.blocks:
        if job.kernels.get(b.name) == "ghost":
            worst = max(worst, ghost_workspace_elements(held.n, streamed.n, P_h[b.name], P_s[b.name],
                                                        job.slice_elements, job.token_block))
    return 3.0 * elem * worst


def statistics_bytes(node) -> float:
    """Float64 bytes of a Fisher node's accumulated matrix: d² (dense), Σ_b d_b² (block), d (diag)."""
    space = node.space
    return 8.0 * {"dense": space.dim ** 2, "block": sum(b.dim ** 2 for b in space.blocks),
                  "diag": space.dim}[node.structure]


def check_statistics_fit(node, memory_budget: int) -> None:
    """Refuse a Fisher whose matrix alone exceeds the budget, naming the fixes that fit: a
    Kronecker curvature (always: its factors are per layer), a projection, the other
    structures whose matrix fits, and a larger budget only where the machine has the memory."""
    need = statistics_bytes(node)
    if need <= memory_budget:
        return
    space = node.space
    fixes = ["a Kronecker curvature, ga.ekfac(G) or ga.kfac(G) (in ga.methods.influence / relatif: "
             "curvature='ekfac')",
             "project first, ga.fisher(P(G)) with P = ga.proj.kron(k=...) (in the methods: "
             "projector=ga.proj.kron(k=...))"]
    sizes = {"block": 8.0 * sum(b.dim ** 2 for b in space.blocks), "diag": 8.0 * space.dim}
    fixes += [f"structure={s!r} ({_si(b)}B)" for s, b in sizes.items()
              if s != node.structure and b <= memory_budget]
    if need <= _physical_memory():
        fixes.append(f"a larger budget, ga.options(memory_budget={suggest_budget(need)!r})")
    raise MemoryBudgetError(
        f"a {node.structure} Fisher over {space.dim:,} coordinates needs {_si(need)}B, over "
        f"the memory budget of {_si(memory_budget)}B. Fixes: " + "; or ".join(fixes) + ".")


def _physical_memory() -> float:
    """The machine's physical memory in bytes (inf where the platform does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return float("inf")
