"""A sink: one job of a pass bound to its accumulator for the run.

A job type is one class (:mod:`gradalg.plan.jobs`): it says how it accumulates
(``job.accumulator(ctx)``, an :class:`~gradalg.plan.jobs.Accumulator` made from the
job's fields), what it is fed, how and where its result goes. A :class:`Sink` holds the
two together so that the pass runner and the shard strategies handle every job alike:

``fed``               the gradient nodes whose chunks the pass hands it (``job.fed``)
``feed(chunks)``      the chunks handed to the accumulator (``job.feed``)
``publish(r, state)`` the finished result put in the run's :class:`RunState` (``job.publish``)

For sharded passes, ``export()`` / ``absorb(state)`` move partial states between
processes and ``for_shard(start)`` tells a sink the first example of its shard. ``ctx``
(the executor) gives the trace of kernels that ran, the run state and resolved
operators, never options: everything a run needs to decide was decided by the planner
and is a field of the job.
"""
from __future__ import annotations

from ..capture.chunks import Chunk
from ..plan.jobs import Accumulator, Job
from .state import RunState

__all__ = ["Sink", "open_sink"]


class Sink:
    """One job's consumer of a pass: ``feed`` every batch, then ``publish(finish())``.
    ``job`` may be replaced by the same job restricted to a shard's rows (Dask)."""

    def __init__(self, job: Job, acc: Accumulator):
        self.job, self.acc = job, acc

    @property
    def phase(self) -> str:
        """Where its time is counted (:mod:`gradalg.exec.phases`)."""
        return self.job.phase

    @property
    def fed(self) -> tuple:
        return self.job.fed

    def feed(self, chunks: list[list[Chunk]], state: RunState) -> None:
        self.job.feed(self.acc, chunks, state)

    def for_shard(self, start: int) -> None:
        """This sink will see the examples of a shard starting at ``start``."""
        self.job.for_shard(self.acc, start)

    def export(self):
        return self.acc.export()

    def absorb(self, part) -> None:
        self.acc.absorb(part)

    def finish(self):
        return self.acc.finish()

    def publish(self, result, state: RunState) -> None:
        self.job.publish(result, state)


def open_sink(job: Job, ctx) -> Sink:
    """The sink of ``job`` with its accumulator, ready for the chunks of its pass."""
    return Sink(job, job.accumulator(ctx))
