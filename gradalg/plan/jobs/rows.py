"""Jobs whose output is rows kept in memory (a held side, rows stored for a later pass,
group means), with their accumulators. Their footprint is the rows they keep (:func:`~gradalg.plan.memory.rows_bytes`): per
example ``rows · Σ_b T_b·(in_b + out_b)`` numbers for a block kept as factors, ``rows ·
Σ_b dim_b`` for a block kept flat.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...capture.chunks import Chunk, RowBuffers, block_bytes, flat_block, flatten, unflatten
from ...capture.factors import Factors
from ...expr import GroupMean
from ..cost import Cost
from ..estimates import factored_blocks, made_flat_cost
from ..memory import positions, rows_bytes, rows_of
from .base import Job

__all__ = ["RowsJob", "CollectJob", "StoreJob", "GroupJob", "Collector", "GroupAccumulator"]


@dataclass(eq=False, frozen=True)
class RowsJob(Job):
    """A job whose output is rows kept in memory: their bytes are its footprint."""

    phase: ClassVar[str] = "capture"

    def chunk_cost(self, node, c, layout, facts) -> Cost:
        """Rows kept from one chunk of ``c`` examples: factors copied where ``storage``
        keeps factors, else the rows made flat and copied (read + write)."""
        T, factored, elem = positions(node, facts.shapes), factored_blocks(node, layout), facts.elem
        storage = self.storage or {}

        def kept(b) -> Cost:
            if factored[b.name] and storage.get(b.name, "flat") == "factors":
                return Cost(bytes=2.0 * elem * c * T[b.name] * sum(b.shape))
            return made_flat_cost(b, c, T, factored, elem) + Cost(bytes=2.0 * elem * c * b.dim)
        return sum(map(kept, node.space.blocks), Cost())

    def collects(self, token: str) -> bool:
        """It keeps the rows of its target (``state.rows[target.token]``; a group job the
        group means: a held side that is a group mean is read from there, not collected again)."""
        return token == self.target.token

    def fixed_bytes(self, facts) -> float:
        return rows_bytes(self.target, self.storage, facts)

    def example_bytes(self, facts) -> float:
        return 0.0

    def output_bytes(self, n: int) -> float:
        return 4.0 * self.target.n * self.target.space.dim

    def publish(self, result, state) -> None:
        state.rows[self.target.token] = result


@dataclass(eq=False, frozen=True)
class CollectJob(RowsJob):
    """Keep every row of ``target`` (a held side, or the rows of a gradient node)."""

    kind: ClassVar[str] = "collect"
    per_row_set: ClassVar[bool] = True

    def describe(self) -> str:
        return f"{self.kind} {self.target.label!r} ({self.target.n:,} rows)"

    def can_wait(self) -> bool:
        """A held side collected in a pass of its own waits for the wave before its scores
        job (not carried through the passes that build the preconditioner)."""
        return True

    def accumulator(self, ctx) -> "Collector":
        """A held side is read whole by its scores job: kept as one chunk, its pieces
        freed as it is made (stored rows are streamed back chunk by chunk)."""
        return Collector(self.storage, whole=True, release=ctx.page_returner())


@dataclass(eq=False, frozen=True)
class StoreJob(CollectJob):
    """Keep rows that a later pass reads after this pass's statistics (stored, not re-read)."""

    kind: ClassVar[str] = "store"
    shrinks_with_queries: ClassVar[bool] = False     # training rows
    streamed_back: ClassVar[bool] = True

    def accumulator(self, ctx) -> "Collector":
        """Its rows written into buffers of all of them (:class:`~gradalg.capture.chunks.RowBuffers`)."""
        node = self.streams[0] if self.streams else self.target
        return Collector(self.storage, rows=node.n * rows_of(node))


@dataclass(eq=False, frozen=True)
class GroupJob(RowsJob):
    """Group means of the rows of ``target.grads`` (a :class:`~gradalg.expr.GroupMean`)."""

    kind: ClassVar[str] = "group"
    ops_per_block: ClassVar[int] = 6

    @classmethod
    def for_statistic(cls, statistic, deps: set, options=None, vectors: int | None = None) -> "GroupJob":
        """The job of a group mean's ``"group"`` statistic (:meth:`GroupMean.statistics
        <gradalg.expr.GroupMean.statistics>`): its means are kept flat (a mean of factors
        is not factors; :class:`GroupAccumulator` makes flat rows)."""
        node = statistic.node
        return cls(node, (statistic.rows,), set(deps), storage={b.name: "flat" for b in node.space.blocks})

    def accumulator(self, ctx) -> "GroupAccumulator":
        return GroupAccumulator(self.target)

    def for_shard(self, acc, start: int) -> None:
        acc.start = start


class Collector:
    """Keeps the chunks (a held side, or rows stored for a later pass).

    ``storage[block] == "flat"`` keeps that block materialized when it is smaller than
    its factors (a Kronecker-projected block over long sequences). ``whole``: ``finish``
    joins the chunks into one, block by block, telling ``release.freed(nbytes)`` the
    bytes of each block's pieces once they are dropped (the executor's
    :class:`~gradalg.exec.allocator.FreedBytes`: freed pages go back to the operating
    system once enough bytes were dropped). ``rows``: how many rows it will keep, written
    into buffers of them all (:class:`~gradalg.capture.chunks.RowBuffers`).
    """

    def __init__(self, storage: dict | None = None, whole: bool = False, release=None, rows: int | None = None):
        self.flat = {name for name, how in (storage or {}).items() if how == "flat"}
        self.chunks: list[Chunk] = []
        self.whole, self.release = whole, release
        self.buffers = RowBuffers(rows) if rows else None

    def update(self, chunk: Chunk) -> None:
        # kept rows drop the batch and task they came from: they are data now; and own
        # their memory (a view would keep its whole base alive: a batch's concatenated
        # rows, or an activation shared by every Gauss-Newton term of the batch)
        blocks = {n: flat_block(v) if n in self.flat else v for n, v in chunk.blocks.items()}
        kept = self.buffers.keep(blocks) if self.buffers is not None else None
        self.chunks.append(Chunk(chunk.ids, kept or {n: _owned(v) for n, v in blocks.items()}))

    def export(self) -> list[Chunk]:
        """The chunks, each owning its memory (views of the buffers would send them whole)."""
        return [Chunk(c.ids, {n: _owned(v) for n, v in c.blocks.items()}) for c in self.chunks]

    def absorb(self, chunks: list[Chunk]) -> None:
        self.chunks.extend(chunks)

    def finish(self) -> list[Chunk]:
        """The kept chunks; with ``whole``, concatenated into one (a held side is read whole:
        its consumer would otherwise concatenate a second copy)."""
        if not self.whole or len(self.chunks) < 2:
            return self.chunks
        chunks, self.chunks = self.chunks, []
        ids = tuple(i for c in chunks for i in c.ids)
        blocks = {}
        for name in list(chunks[0].blocks):   # block by block, each block's pieces freed once joined
            parts = [c.blocks.pop(name) for c in chunks]
            blocks[name] = Factors.concat_examples(parts) if isinstance(parts[0], Factors) else torch.cat(parts, 0)
            dropped = sum(block_bytes(p) for p in parts)
            del parts
            # the pieces' pages back to the OS: glibc keeps freed batch-sized pieces in its heap,
            # where the joined block (larger) cannot reuse them (full Grad-Dot on GPT-2: the
            # 471 MB of held queries were resident twice)
            if self.release is not None:
                self.release.freed(dropped)
        return [Chunk(ids, blocks)]


def _owned(value):
    """``value`` with tensors that are views of larger storage copied out."""
    if isinstance(value, Factors):
        return Factors(_owned(value.A), _owned(value.D))
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.numel() * value.element_size():
        return value.clone()
    return value


class GroupAccumulator:
    """Group means of the rows (GroupMean): one flat row per group label."""

    def __init__(self, node: GroupMean, start: int = 0):
        self.node = node
        where = {g: i for i, g in enumerate(node.ids)}
        self.index = torch.tensor([where[g] for g in node.groups])
        self.total, self.start = None, start   # start: first row of the shard fed here

    def update(self, chunk: Chunk) -> None:
        x = flatten(chunk, self.node.space)
        if self.total is None:
            self.total = x.new_zeros(self.node.n, x.shape[1])
        self.total.index_add_(0, self.index[self.start:self.start + chunk.n].to(x.device), x)
        self.start += chunk.n

    def export(self):
        return self.total

    def absorb(self, total) -> None:
        if total is not None:
            self.total = total if self.total is None else self.total + total

    def finish(self) -> list[Chunk]:
        counts = torch.bincount(self.index, minlength=self.node.n).to(self.total)
        return [Chunk(self.node.ids, unflatten(self.total / counts.unsqueeze(1), self.node.space))]
