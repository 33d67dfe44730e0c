"""The sinks of :mod:`gradalg.plan.pull_jobs`: an operator applied to a score's held rows
in a planned pass over the operator's own rows (DataInf's inverse).

The :class:`ApplySink` resolves the operator (no data read: its rows are a lazy stream),
asks it for the sums of its application to the held rows (``resolved.sums(q)``,
:class:`~gradalg.linalg.datainf.DataInfSums`), feeds them the pass's chunks, and publishes
``(operator token, q, H⁻¹q)`` into ``state.results`` under the job's key, where
:meth:`~gradalg.exec.base.Executor.precondition_held` finds the preconditioned rows of
exactly these held rows (compared element by element) instead of reading the data again.
"""
from __future__ import annotations

from ..capture.chunks import concat_chunks, flatten
from ..plan.pull_jobs import ApplyJob
from .sinks import Sink, sink_for

__all__ = ["ApplySink", "applied"]


@sink_for(ApplyJob)
class ApplySink(Sink):
    phase = "statistics"

    def __init__(self, job, acc, coef: float, q):
        super().__init__(job, acc)
        self.coef, self.q = coef, q

    @classmethod
    def open(cls, job, ctx):
        resolved = ctx.resolve(job.target.op)
        q = flatten(concat_chunks(ctx.state.rows[job.held.token]), job.held.space)      # (m, dim)
        return cls(job, resolved.sums(q), resolved.coef, q)

    def feed(self, chunks, state):
        for chunk in chunks[0]:
            self.acc.update(chunk.blocks)

    def finish(self):
        return self.coef * self.acc.finish()

    def publish(self, result, state):
        state.results[self.job.key] = (self.job.target.op.token, self.q, result)


def applied(state, op, q):
    """The rows ``op`` (a node) applied to ``q`` (m, dim) that a planned
    :class:`~gradalg.plan.pull_jobs.ApplyJob` left in ``state``, or None: its held rows
    must equal ``q`` exactly (same shape, dtype and values)."""
    for key, value in state.results.items():
        if key[0] == ApplyJob.kind and value[0] == op.token:
            _, held, result = value
            if held.shape == q.shape and held.dtype == q.dtype and bool((held == q).all()):
                return result
    return None
