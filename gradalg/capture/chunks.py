"""A chunk of rows of a gradient set, as the executor streams it.

Each block is either :class:`~gradalg.capture.factors.Factors` (factored) or a flat
``(n, dim)`` tensor (dense or projected). Helpers convert between them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .factors import HALF_DTYPES, Factors, materialize, self_inner
from ..space import ParamSpace

__all__ = ["Chunk", "block_bytes", "flat_block", "flatten", "unflatten", "row_sq_norms", "concat_chunks",
           "RowBuffers"]


@dataclass
class Chunk:
    """Rows ``ids`` of a gradient set: ``blocks[name]`` is Factors or an (n, dim) tensor.

    ``batch`` and ``task`` are the raw batch and task the rows were captured from
    (None for stored rows); per-example weights are computed from them.
    """

    ids: tuple
    blocks: dict[str, Any]
    batch: Any = None
    task: Any = None
    meta: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.ids)

    def replace(self, blocks) -> "Chunk":
        return Chunk(self.ids, blocks, self.batch, self.task, self.meta)


def block_bytes(value) -> int:
    """Bytes of one block of a chunk: its factors (:meth:`Factors.nbytes`) or its flat rows."""
    return value.nbytes() if isinstance(value, Factors) else value.numel() * value.element_size()


def flat_block(value) -> torch.Tensor:
    """A block as an (n, dim) tensor (materializing factors; half precision as float32)."""
    if isinstance(value, Factors):
        return materialize(value).flatten(1)
    return value.float() if value.dtype in HALF_DTYPES else value


def flatten(chunk: Chunk, space: ParamSpace) -> torch.Tensor:
    """All blocks concatenated in space order.   Returns (n, dim)."""
    return torch.cat([flat_block(chunk.blocks[name]) for name in space.names], dim=1)


def unflatten(rows: torch.Tensor, space: ParamSpace) -> dict[str, torch.Tensor]:
    return {name: rows[:, s] for name, s in space.offsets().items()}


def row_sq_norms(chunk: Chunk, max_elements: int = 2**26, token_block: int | None = None) -> torch.Tensor:
    """‖G_i‖² summed over blocks (ghost identity for factored blocks, in token blocks of
    ``token_block`` positions and slices of ``max_elements``).   Returns (n,)."""
    total = None
    for value in chunk.blocks.values():
        part = (self_inner(value, max_elements, token_block) if isinstance(value, Factors)
                else (value * value).sum(1))
        total = part if total is None else total + part
    return total


def concat_chunks(chunks: list[Chunk]) -> Chunk:
    """One chunk holding all rows (factors padded to the longest T)."""
    if len(chunks) == 1:
        return chunks[0]
    ids = tuple(i for c in chunks for i in c.ids)
    blocks = {}
    for name in chunks[0].blocks:
        parts = [c.blocks[name] for c in chunks]
        if isinstance(parts[0], Factors):
            blocks[name] = Factors.concat_examples(parts)
        else:
            blocks[name] = torch.cat(parts, 0)
    return Chunk(ids, blocks)


class RowBuffers:
    """Rows kept for a later pass, written into one buffer per tensor of each block, of
    ``capacity`` rows, ``(capacity, *row shape)``, made when the first chunk comes; each
    chunk kept is a view of its rows of them (:meth:`keep`).

    Kept as pieces of their own, a pass's rows are allocated batch by batch among the
    batch's activations, which are freed: each surviving piece then keeps pages of the
    heap resident around it (glibc). Measured on LoGra's first pass (a 2-layer GPT-2,
    T = 32, 20 pieces of 4 KiB per batch of 8): 27 KiB resident per stored row of 10 KiB;
    with one buffer per tensor, the rows' own bytes. A chunk that does not fit (another
    row shape or dtype, past ``capacity``, a block that is not tensors) is not kept here
    (``keep`` returns None)."""

    def __init__(self, capacity: int):
        self.capacity, self.used, self.buffers = int(capacity), 0, None

    def keep(self, blocks: dict) -> dict | None:
        """``blocks`` (Factors or (n, dim) rows) copied into the buffers: the same blocks
        as views of them, or None where they do not fit."""
        parts = {(name, i): t for name, v in blocks.items()
                 for i, t in enumerate((v.A, v.D) if isinstance(v, Factors) else (v,))}
        if not parts or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in parts.values()):
            return None
        n = next(iter(parts.values())).shape[0]
        if self.buffers is None:
            self.buffers = {k: t.new_empty((self.capacity, *t.shape[1:])) for k, t in parts.items()}
        if self.used + n > self.capacity or parts.keys() != self.buffers.keys() or any(
                t.shape != (n, *self.buffers[k].shape[1:]) or t.dtype != self.buffers[k].dtype
                or t.device != self.buffers[k].device for k, t in parts.items()):
            return None
        views = {k: self.buffers[k][self.used:self.used + n].copy_(t) for k, t in parts.items()}
        self.used += n
        return {name: Factors(views[(name, 0)], views[(name, 1)]) if isinstance(v, Factors) else views[(name, 0)]
                for name, v in blocks.items()}
