"""Sharding a pass over data: restrict a plan's nodes to a range of examples.

A pass reads one dataset; split it into index ranges and each shard is the same pass
over a sub-dataset. ``node.restrict(data_token, start, stop)`` (the row-wise protocol)
rebuilds a node with every source over that dataset replaced by the same source over
examples ``start:stop``; ``restrict_step`` rebuilds a pass with its jobs' streams so restricted;
``shard_ranges(n, shards)`` splits n examples evenly (no empty shard);
``rank_ranges(n, ranks)`` gives exactly one contiguous range per rank, in rank order
(empty ones when n < ranks), and ``batches_in(size, batch_size)`` how many batches a
range of ``size`` examples is read in.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import OptionError

__all__ = ["restrict_step", "shard_ranges", "rank_ranges", "batches_in"]


def shard_ranges(n: int, shards: int) -> list[tuple[int, int]]:
    shards = max(1, min(shards, n))
    bounds = [round(i * n / shards) for i in range(shards + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def rank_ranges(n: int, ranks: int) -> list[tuple[int, int]]:
    """One range per rank, ``[(start, stop), ...]`` in rank order, covering 0..n once;
    sizes differ by at most one (the first ``n % ranks`` ranks get one more), and a rank
    gets an empty range (start == stop) when n < ranks."""
    if ranks < 1:
        raise OptionError(f"ranks must be at least 1, got {ranks}")
    base, extra = divmod(n, ranks)
    bounds = [r * base + min(r, extra) for r in range(ranks + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def batches_in(size: int, batch_size: int) -> int:
    """Batches of at most ``batch_size`` examples that read ``size`` examples in order."""
    return -(-size // batch_size)


def restrict_step(step, data_token: str, start: int, stop: int):
    """The pass ``step`` over examples start:stop of the dataset ``data_token``: each
    job's streams restricted (:meth:`gradalg.expr.GradNode.restrict`: only the rows; operators
    inside a chain keep their full data, the same operators as in the unsharded plan)."""
    return replace(step, jobs=[replace(job, streams=tuple(s.restrict(data_token, start, stop) for s in job.streams))
                               for job in step.jobs])
