"""The top-k job: the ``k`` best training rows per query of a score expression, merged
chunk by chunk of the streamed side; the (query × train) matrix is never formed."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import reduce
from typing import ClassVar

import torch

from ...errors import DataError, OptionError
from ..cost import Cost
from ..decisions import Decision, DecisionKind
from .base import Job

__all__ = ["TopK", "TopKJob", "TopKAccumulator", "select_topk"]


@dataclass(frozen=True)
class TopK:
    """What a top-k plan keeps per query: the ``k`` largest scores (``largest=True``,
    most helpful) or the ``k`` smallest (``largest=False``, most harmful), ties broken
    by the lower training position (``plan(node, topk=TopK(k))``)."""

    k: int
    largest: bool = True

    def __post_init__(self):
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise OptionError(f"k must be a positive integer (the best training rows per query), got {self.k!r}")


@dataclass(eq=False, frozen=True)
class TopKJob(Job):
    """The ``k`` best training rows per query of a score expression.

    ``terms``: ``((coef, ScoresJob), ...)``, one per ``Inner`` of the expression (a sum
    has several), each with its held side and kernels as the planner chose them; per
    streamed chunk the job sums ``coef · scores`` of the terms (each term's
    :meth:`ScoreAccumulator.block`) and merges the block into a running top-k
    (:class:`TopKAccumulator`); no block outlives its chunk. A sum's terms all hold
    their query side; a single term may hold the training side instead, then each
    streamed chunk of queries is ranked over all training rows at once (``rows`` mode).

    Bytes: held rows of every term, plus the running (n_query, k) values and positions
    (8 + 8 bytes each); per streamed example, besides each term's own working bytes, one
    column of n_query scores per term, their sum, and in the merge its copy with an int64
    position and an int64 index (``output_bytes`` is n_query·k, not n_query·n_train)."""

    kind: ClassVar[str] = "topk"

    k: int = 1
    largest: bool = True
    terms: tuple = ()

    def describe(self) -> str:
        which = "largest" if self.largest else "smallest"
        return (f"top-{self.k} ({which}) of {self.target.label} streaming "
                f"{', '.join(repr(s.label) for s in self.streams)}")

    def stream_cost(self, n_stream, chunk, facts, layout_of, storage_of=None, options=None, resolved=None) -> Cost:
        """Its terms' score blocks (the merge is O(n_query·(k + chunk)), not counted)."""
        return sum((term.stream_cost(n_stream, chunk, facts, layout_of, storage_of, options, resolved)
                    for _, term in self.terms), Cost())

    def applied_ops(self) -> tuple:
        """Its terms' operators, resolved in this pass."""
        return tuple(op for _, t in self.terms for op in t.applied_ops())

    def store_refused(self) -> Decision | None:
        """Terms that stream several different nodes, summed block by block, are read
        together from the data: a pass over rows in memory reads one node."""
        if len(self.streams) <= 1:
            return None
        return Decision(
            DecisionKind.STORE, self.target.token, "recompute",
            {"store": "n/a: a pass over rows in memory reads one node", "recompute": "one pass over the data"},
            f"the top-k's terms stream {len(self.streams)} different nodes, summed block by block: "
            "they are read together from the data", label=f"the training sides of {self.target.label}")

    def normalized(self, decide) -> "TopKJob":
        """Each term's normalization decided (:meth:`ScoresJob.normalized`)."""
        terms = tuple((c, t.normalized(decide)) for c, t in self.terms)
        return self if all(a is b for (_, a), (_, b) in zip(terms, self.terms)) else replace(self, terms=terms)

    def fixed_bytes(self, facts) -> float:
        return sum(j.fixed_bytes(facts) for _, j in self.terms) + 16.0 * self.target.shape[0] * self.k   # (n_query, k)

    def per_example_bytes(self, facts) -> float:
        held = max((j.held.n for _, j in self.terms), default=0)
        return (sum(j.per_example_bytes(facts) for _, j in self.terms)
                + held * (facts.elem * (len(self.terms) + 2) + 16.0))

    def output_bytes(self, n: int) -> float:
        return 16.0 * self.target.shape[0] * self.k

    # ------------------------------------------------------------------ running
    def _stream_index(self) -> list[int]:
        """Per term, the position in ``streams`` of the node it streams (the streams are
        the terms' distinct streamed nodes in order: the same positions in a shard's job,
        whose streams are restricted to its rows)."""
        tokens = list(dict.fromkeys(t.streams[0].token for _, t in self.terms))
        return [tokens.index(t.streams[0].token) for _, t in self.terms]

    def accumulator(self, ctx) -> "TopKAccumulator":
        terms = [(c, t.accumulator(ctx), i) for (c, t), i in zip(self.terms, self._stream_index())]
        rows_mode = len(self.terms) == 1 and self.terms[0][1].transposed
        return TopKAccumulator(self.k, self.largest, terms, rows_mode)

    @property
    def fed(self) -> tuple:
        """Each stream, read below its normalization where a term's kernel applies it."""
        below = {i for (_, t), i in zip(self.terms, self._stream_index()) if t.normalize_streamed}
        return tuple(s.grads if i in below else s for i, s in enumerate(self.streams))

    def feed(self, acc, chunks, state) -> None:
        """Per streamed chunk, ``Σ coef · scores`` of the terms, merged into the top-k."""
        for j in range(len(chunks[0])):
            parts = ((coef, term.block(chunks[i][j])) for coef, term, i in acc.terms)
            block = reduce(torch.add, (part if coef == 1.0 else coef * part for coef, part in parts))
            if acc.rows_mode:                   # (n_train, chunk) → whole query rows
                acc.update_rows(block.T)
            else:                               # (n_query, chunk) of training positions start:start+chunk
                acc.update(block, acc.start)

    def for_shard(self, acc, start: int) -> None:
        acc.start = start

    def publish(self, result, state) -> None:
        state.results[self.key] = result


def select_topk(values: torch.Tensor, positions: torch.Tensor, k: int, largest: bool):
    """Per row, the ``k`` best of ``values`` in rank order, ties broken by the lower position.

    values : (n, m) scores; positions : (n, m) int64 training positions of those scores.
    Returns ``(values, positions)``, each (n, min(k, m)): rank 0 is the largest score
    (``largest=True``) or the smallest; equal scores rank by ascending position, so the
    result is the first k of the stable sort of all m by (score, position), whatever
    order the candidates came in. ``torch.topk`` picks the candidates; only when a row's
    k-th score is tied with one it left out (or among the k) are the tied rows resolved
    by a stable sort of the candidates, by position first, then by score.
    """
    kk = min(k, values.shape[1])
    top, idx = torch.topk(values, kk, dim=1, largest=largest, sorted=True)
    if kk == 0:
        return top, positions[:, :0]
    kth = top[:, -1:]
    if bool(((values == kth).sum(1) != (top == kth).sum(1)).any()):
        # a tie at the boundary: which tied rows are kept depends on position, so every row is a candidate
        idx = torch.arange(values.shape[1], device=positions.device).expand_as(positions)
    # the candidates by position, then stably by score: the first kk, ties in position order
    by_pos = torch.argsort(torch.gather(positions, 1, idx), dim=1, stable=True)
    v = torch.gather(values, 1, torch.gather(idx, 1, by_pos))
    order = torch.sort(v, dim=1, descending=largest, stable=True).indices[:, :kk]
    idx = torch.gather(idx, 1, torch.gather(by_pos, 1, order))
    return torch.gather(values, 1, idx), torch.gather(positions, 1, idx)


class TopKAccumulator:
    """A running top-k per query over score blocks streamed by training position.

    ``columns`` mode (the query side held): ``update(block, start)`` takes the
    (n_query, b) scores of training positions start:start+b and keeps, per query, the k
    best of what it kept and the block (:func:`select_topk`): memory n_query·(k + b),
    never n_query·n_train; ``start`` then moves past the block. ``rows`` mode
    (``rows_mode``, the training side held): ``update_rows(block)`` ranks a (b, n_train)
    block of whole query rows at once and appends them. ``terms``: ``[(coef,
    ScoreAccumulator, stream index)]`` whose blocks a :class:`TopKJob` sums per chunk.
    Shards export their kept (values, positions) and are absorbed in shard order: the
    merge is the same selection, so the result does not depend on the sharding.
    A NaN score is refused (its rank would be arbitrary).
    """

    def __init__(self, k: int, largest: bool, terms: list | None = None, rows_mode: bool = False):
        self.k, self.largest = k, largest
        self.terms, self.rows_mode, self.start = terms or [], rows_mode, 0
        self.values: torch.Tensor | None = None      # (n_query, ≤k)
        self.positions: torch.Tensor | None = None   # (n_query, ≤k) int64
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def _positions(block: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The training positions start, start + 1, ... of the block's columns, after refusing a NaN score."""
        if bool(torch.isnan(block).any()):
            raise DataError("a score is NaN, so it has no rank: find the non-finite gradients "
                            "(ga.options(check_finite=True)) or damp the operator more")
        return torch.arange(start, start + block.shape[1], dtype=torch.int64).expand(block.shape[0], -1)

    def update(self, block: torch.Tensor, start: int) -> None:
        self._merge(block, self._positions(block, start))
        self.start = start + block.shape[1]

    def update_rows(self, block: torch.Tensor) -> None:
        self.rows.append(select_topk(block, self._positions(block), self.k, self.largest))

    def _merge(self, values: torch.Tensor, positions: torch.Tensor) -> None:
        if self.values is not None:
            values = torch.cat([self.values, values.to(self.values.dtype)], dim=1)
            positions = torch.cat([self.positions, positions], dim=1)
        self.values, self.positions = select_topk(values, positions, self.k, self.largest)

    def export(self) -> dict:
        return {"values": self.values, "positions": self.positions, "rows": self.rows}

    def absorb(self, part: dict) -> None:
        if part["values"] is not None:
            self._merge(part["values"], part["positions"])
        self.rows.extend(part["rows"])

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, positions)``, each (n_query, min(k, n_train)), rank order."""
        if self.rows:
            return torch.cat([v for v, _ in self.rows]), torch.cat([p for _, p in self.rows])
        return self.values, self.positions
