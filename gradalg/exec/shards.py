"""Sharding a pass over data: restrict a plan's nodes to a range of examples.

A pass reads one dataset; split it into index ranges and each shard is the same pass
over a sub-dataset. ``restrict(node, data_token, start, stop)`` rebuilds a node with
every source over that dataset replaced by the same source over examples
``start:stop``; ``shard_ranges(n, shards)`` splits n examples evenly.
"""
from __future__ import annotations

from ..expr import Source
from ..expr.base import transform

__all__ = ["restrict", "shard_ranges"]


def shard_ranges(n: int, shards: int) -> list[tuple[int, int]]:
    shards = max(1, min(shards, n))
    bounds = [round(i * n / shards) for i in range(shards + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def restrict(node, data_token: str, start: int, stop: int):
    """``node`` with every Source over ``data_token`` limited to examples start:stop."""
    def change(x):
        if isinstance(x, Source) and x.data.token == data_token:
            return Source(x.task, x.data.subset(start, stop), x.layers, x.backend, x.objective, x.seed)
        return None
    return transform(node, change)
