"""Rows of examples seen more than once (several epochs): one row per example.

Training-time capture keeps one row per (step, example): an example seen in two epochs
has two rows with the same id, each its gradient at that step's parameters. Scores
against such a set have a repeated ``train`` coordinate. :func:`combine_repeats` gives one
row per example:

* ``"sum"``: ``Σ_s g_i(θ_s)`` over the steps ``s`` that saw example ``i`` (its total
  contribution to training; TracIn's sum over checkpoints without learning rates);
* ``"mean"``: that sum divided by the number of times it was seen.

Rows are ordered by first appearance; the result's ids are the unique example ids.
"""
from __future__ import annotations

from ..errors import OptionError

from collections import Counter

import torch

__all__ = ["combine_repeats"]


def combine_repeats(G, how: str = "sum"):
    """One row per distinct id of ``G``: the ``"sum"`` or the ``"mean"`` of its rows."""
    from ..api import GradientSet
    from ..capture.chunks import Chunk, flat_block
    from ..exec.local import LocalExecutor
    from ..expr.stored import Stored
    from ..store.rows import MemoryRows

    if how not in ("sum", "mean"):
        raise OptionError(f"how must be 'sum' or 'mean', got {how!r}")
    M = G.group_mean(G.ids)
    if how == "mean":
        return M
    counts = Counter(G.ids)
    chunk = LocalExecutor().gradients(M.expr)
    w = torch.tensor([counts[i] for i in chunk.ids], dtype=torch.float64)
    blocks = {}
    for b in M.space.blocks:
        rows = flat_block(chunk.blocks[b.name])                       # (n_unique, dim)
        blocks[b.name] = rows * w.to(rows).unsqueeze(1)
    rep = tuple(M.expr.representation.items())
    store = MemoryRows(Chunk(chunk.ids, blocks), f"repeats-sum-{M.expr.token}", f"sum of repeats of {G.expr.label}")
    return GradientSet(Stored(store, M.space, rep))
