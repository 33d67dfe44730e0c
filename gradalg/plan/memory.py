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
"""
from __future__ import annotations

from ..capture.factors import Factors
from ..errors import MemoryBudgetError
from ..expr import Captured, Source
from ..expr.stored import Stored
from ..expr.tokens import token_rows
from .cost import activation_bytes, tokens_hint
from .shapes import element_size, forward_shapes, rows_per_example

__all__ = ["positions", "rows_of", "rows_bytes", "capture_bytes_per_example", "consumer_bytes_per_example",
           "kron_bytes", "statistics_bytes", "check_statistics_fit", "captured_positions"]


def positions(node) -> dict[str, int]:
    """``{block: T_b}`` of a gradient node (its source's layers; projections keep T; rows
    recorded by ``ga.capture``: the most positions of any of their chunks, in memory)."""
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
    return total


def kron_bytes(space) -> float:
    """K-FAC's float64 statistics: two covariances per block, and the peak of their
    eigendecompositions (input, eigenvectors and LAPACK's 2d² workspace: 4·8·d²)."""
    return sum(8.0 * (b.shape[0] ** 2 + b.shape[-1] ** 2) + 32.0 * max(b.shape[0], b.shape[-1]) ** 2
               for b in space.blocks)


def consumer_bytes_per_example(job, dtype) -> float:
    """Working bytes per streamed example of a job, beyond the captured rows: rows it
    materializes (a flat Fisher or a dense score kernel) and their float64 copies. Rows
    of one example's Gauss-Newton terms arrive as separate chunks: counted once."""
    elem = element_size(dtype)
    if not job.streams:
        return 0.0
    node = job.streams[0]
    rows = 1
    dim = node.space.dim
    if job.kind == "fisher":
        return rows * dim * (elem + 16.0)        # materialized, cast to float64, its product/square
    if job.kind == "diag":
        return rows * dim * (elem + 8.0)
    if job.kind == "ekfac":
        return rows * sum(16.0 * b.dim for b in node.space.blocks)   # rotated gradients, squared (float64)
    if job.kind == "kfac":
        T = positions(node)
        return rows * sum(T[b.name] * sum(b.shape) * 8.0 for b in node.space.blocks if len(b.shape) == 2)
    return 0.0


def statistics_bytes(node) -> float:
    """Float64 bytes of a Fisher node's accumulated matrix: d² (dense), Σ_b d_b² (block), d (diag)."""
    space = node.space
    return 8.0 * {"dense": space.dim ** 2, "block": sum(b.dim ** 2 for b in space.blocks),
                  "diag": space.dim}[node.structure]


def check_statistics_fit(node, memory_budget: int) -> None:
    """Refuse a Fisher whose matrix alone exceeds the budget, naming the fixes."""
    need = statistics_bytes(node)
    if need > memory_budget:
        raise MemoryBudgetError(
            f"a {node.structure} Fisher over {node.space.dim:,} coordinates needs {need / 2**30:.1f} GiB, over "
            f"the memory budget of {memory_budget / 2**30:.1f} GiB. Project first "
            "(ga.fisher(P(G)) with P = ga.proj.kron(k=...)), use structure='block' or 'diag', "
            "or raise ga.options(memory_budget=...).")
