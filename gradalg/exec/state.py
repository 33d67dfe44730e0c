"""What a run keeps between the passes of a plan (and between plans of one executor).

:class:`RunState` holds, by identity token:

``rows``     collected, stored and group-mean rows   {gradient node token: [Chunk, ...]}
``ops``      resolved operators                       {operator node token: resolved}
``kron``     K-FAC eigenbases awaiting their EK-FAC correction    {KFAC token: KronOp}
``results``  score and self-score results             {job key (kind, token): array}
             and held rows with an operator applied by a planned pass
             {("apply", score token): applied rows (m, dim)}, read by the scores job naming that key
``checked``  tasks whose loss reduction was checked   {task token}

The jobs of a pass publish into it (``job.publish``), the pass runner reads held rows
and stored rows from it, and a distributed executor builds a worker's state from the
part a pass needs (``RunState(ops=..., kron=...)``): no executor writes another's
attributes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..expr import ScoreDiagonal, ScoreSum
from ..capture.chunks import Chunk, block_bytes

__all__ = ["RunState"]


@dataclass
class RunState:
    rows: dict[str, list[Chunk]] = field(default_factory=dict)
    ops: dict[str, object] = field(default_factory=dict)
    kron: dict[str, object] = field(default_factory=dict)
    results: dict[tuple, object] = field(default_factory=dict)
    checked: set[str] = field(default_factory=set)

    def scores(self, node, as_array=lambda r: r):
        """The (n_left, n_right) scores of a score node from its jobs' results: a
        :class:`~gradalg.expr.ScoreSum` is the weighted sum of its terms' (``as_array``
        converts each term, e.g. to NumPy beside Dask arrays)."""
        if isinstance(node, ScoreSum):
            return sum(c * self.scores(t, as_array) for c, t in zip(node.coefs, node.terms))
        return as_array(self.results[("scores", node.token)])

    def diagonal(self, node):
        """Self-scores (n,) of the score node under a ScoreDiagonal, summed over ScoreSum terms."""
        if isinstance(node, ScoreSum):
            return sum(c * self.diagonal(t) for c, t in zip(node.coefs, node.terms))
        return self.results[("diag", ScoreDiagonal(node).token)]

    def held_bytes(self) -> int:
        """Bytes of every kept row."""
        return sum(block_bytes(v) for chunks in self.rows.values() for c in chunks for v in c.blocks.values())
