"""Row-wise transforms of chunks: each takes a chunk of a node's input and returns the
chunk of the node (same rows), in the passes that derive a row-wise chain."""
from __future__ import annotations

from typing import Iterator

import torch

from ..capture.factors import Factors
from ..expr import AdamPrecondition, Project, RowWeights
from ..proj.kinds import BlockRun, dtype_device
from ..capture.chunks import Chunk
from ..errors import DataError
from .resolve import Resolution

__all__ = ["derive_rows", "RowContext", "dtype_device", "adam_block", "project_blockwise"]


def derive_rows(executor, node, chunks_of, have) -> Iterator[Chunk]:
    """The chunks of the row-wise ``node`` from those of its input, ``chunks_of(x)`` giving
    the chunks of a node ``x``: a projection of Adam-preconditioned rows whose input rows
    are not in ``have`` (tokens of rows already made) is computed a block at a time from
    the rows below them (:func:`project_blockwise`), any other node chunk by chunk."""
    ctx = RowContext(executor)
    if isinstance(node, Project) and isinstance(node.grads, AdamPrecondition) and node.grads.token not in have:
        return (project_blockwise(executor, node, c) for c in chunks_of(node.grads.grads))
    return (node.apply(c, ctx) for c in chunks_of(node.grads))


class RowContext(Resolution):
    """What a row-wise node's ``apply(chunk, ctx)`` asks of the executor: its options and
    resolved operators (as an operator's :class:`~gradalg.exec.resolve.Resolution`),
    projection kernels (which count into the executor's trace) and row weights (which
    replay the captured forward)."""

    def project(self, node: Project, chunk: Chunk) -> dict:
        return _project(self.executor, node, chunk)

    @staticmethod
    def scale_rows(value, w: torch.Tensor):
        """Each row of a block (factors, or (n, d) rows) times its weight.   w: (n,)"""
        if isinstance(value, Factors):
            return value.scale_rows(w)
        return value * w.to(device=value.device, dtype=value.dtype).unsqueeze(1)

    @staticmethod
    def row_weights(weights, chunk: Chunk) -> torch.Tensor:
        """Per-example weights (n,) of a chunk: a constant, or ``weights.fn`` of the model
        and the chunk's batch (the captured forward replayed when it asks for the same outputs)."""
        if not isinstance(weights, RowWeights):
            return torch.full((chunk.n,), float(weights), dtype=torch.float64)
        if chunk.batch is None or chunk.task is None:
            raise DataError(f"per-example weights {weights.name!r} need the batches the gradients "
                            "came from; apply them to gradients from ga.grads, not to stored ones")
        # replay the captured batch's forward when the weights ask for the same outputs
        # (TRAK's 1 − p): SharedForward returns them instead of running the model again
        from .capture_pass import SharedForward
        with torch.no_grad(), SharedForward(chunk.task.model, first=chunk.meta.get("forward")):
            w = weights.fn(chunk.task.model, chunk.batch)
        if w.shape != (chunk.n,):
            raise DataError(f"row weights {weights.name!r} returned shape {tuple(w.shape)}; expected "
                            f"({chunk.n},), one value per example")
        return w.detach()

def adam_block(state, value, coords: slice) -> torch.Tensor:
    """Adam's direction of one block's rows (:meth:`gradalg.expr.AdamState.direction`).
    value : factors or (n, d_b) rows   returns (n, d_b)"""
    return state.direction(value, coords)


def project_blockwise(executor, node: Project, chunk: Chunk) -> Chunk:
    """``P(G.adam(state))`` from a chunk of ``G``, one block at a time: each block's rows
    are materialized (from factors), preconditioned and projected, then dropped, so a
    chunk never holds the (n, d) preconditioned gradient of the whole model (LESS on a
    10⁸-parameter model: 2.7 GB for 8 examples). The same numbers as
    ``node.apply(node.grads.apply(chunk, ctx), ctx)``: each block's projection
    is the block's own (seeded per block), summed or kept per block as in :func:`_project`."""
    adam = node.grads
    offsets = adam.space.offsets()
    values = (adam_block(adam.state, chunk.blocks[b.name], offsets[b.name]) for b in adam.space.blocks)
    return chunk.replace(_project(executor, node, chunk, values))


def _project(executor, node: Project, chunk: Chunk, values=None) -> dict:
    """The projected blocks of ``chunk``, each by its projector's kind
    (:meth:`gradalg.proj.kinds.ProjectionKind.apply`); ``values`` (optional): an iterator of
    the input blocks' values in space order, made one at a time (:func:`project_blockwise`).
    A per-block projector keeps each block's projection, a global one sums them."""
    p = node.projector
    src_space = node.grads.space
    values = values if values is not None else (chunk.blocks[b.name] for b in src_space.blocks)
    run = BlockRun(tuple((b.name, b.dim) for b in src_space.blocks), executor.options.projection_slice_elements,
                   executor.options.token_block, executor.trace)
    out = {}
    for block, value in zip(src_space.blocks, values):
        projected = p.kind_object.apply(p, block, value, run)
        del value
        key = block.name if p.per_block else "projected"
        out[key] = out[key] + projected if key in out else projected
    return out
