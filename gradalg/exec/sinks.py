"""Sinks: what the executor does with each job of a pass, registered by job type.

A job type is its class in :mod:`gradalg.plan.jobs` (streams, cost, bytes) and its sink
here: the plan's floor does not import the executor's, so ``open`` (the job's
:class:`~gradalg.exec.accumulators.Accumulator`, made from the job's fields) lives on
the sink. A sink wraps that accumulator and knows three things it does not:

``fed``               the gradient nodes whose chunks the pass hands it (the job's streams,
                      or the rows below a normalization the kernel applies itself)
``feed(chunks)``      how those chunks reach the accumulator (one stream, two in lockstep,
                      or a held side aligned by example id)
``publish(r, state)`` where the finished result goes in the run's :class:`RunState`

``SINKS`` maps each job class of :mod:`gradalg.plan.jobs` to its sink class
(``@sink_for(FisherJob)``); :func:`open_sink` looks a job's class up. A new job type
registers a sink; the pass runner has no list of job kinds. Everything a sink needs to
decide was decided by the planner and is a field of its job (kernels, storage,
normalization, slice and buffer sizes); ``ctx`` (the executor) gives the trace of
kernels that ran, the run state and resolved operators, never options.

For sharded passes, ``export()`` / ``absorb(state)`` move partial states between
processes and ``for_shard(start)`` tells a sink the first example of its shard.
"""
from __future__ import annotations

import torch

from ..errors import DataError
from ..plan.rules import PlanError
from ..expr import Identity
from ..plan.jobs import (CollectJob, DiagJob, EKFACJob, FisherJob, GroupJob, Job, KFACJob, ScoresJob, StoreJob,
                         TopKJob)
from .accumulators import (Accumulator, Collector, DiagAccumulator, EKFACAccumulator, FisherAccumulator, GroupAccumulator,
                           KronAccumulator, ScoreAccumulator, TopKAccumulator)
from ..capture.chunks import Chunk, concat_chunks, flatten, unflatten
from .state import RunState

__all__ = ["SINKS", "Sink", "sink_for", "open_sink"]

SINKS: dict[type[Job], type["Sink"]] = {}


def sink_for(*job_types: type[Job]):
    """Register the decorated sink class for ``job_types``."""
    def register(cls):
        for t in job_types:
            SINKS[t] = cls
        return cls
    return register


def open_sink(job: Job, ctx) -> "Sink":
    """The sink of ``job`` (by its class), ready for the chunks of its pass."""
    try:
        cls = SINKS[type(job)]
    except KeyError:
        raise PlanError(f"no sink is registered for {type(job).__name__} jobs "
                        f"(gradalg.exec.sinks.sink_for); registered: {sorted(t.__name__ for t in SINKS)}") from None
    return cls.open(job, ctx)


class Sink:
    """One job's consumer of a pass: ``feed`` every batch, then ``publish(finish())``.

    ``phase``: where its time is counted (:mod:`gradalg.exec.phases`)."""

    phase = "scoring"

    def __init__(self, job: Job, acc: Accumulator):
        self.job, self.acc = job, acc

    @classmethod
    def open(cls, job: Job, ctx) -> "Sink":
        """The sink of ``job`` with its accumulator, ready for the pass."""
        raise NotImplementedError(f"{cls.__name__} does not say how it opens (Sink.open)")

    @property
    def fed(self) -> tuple:
        return self.job.streams

    def feed(self, chunks: list[list[Chunk]], state: RunState) -> None:
        for chunk in chunks[0]:
            self.acc.update(chunk)

    def for_shard(self, start: int) -> None:
        """This sink will see the examples of a shard starting at ``start``."""

    def export(self):
        return self.acc.export()

    def absorb(self, part) -> None:
        self.acc.absorb(part)

    def finish(self):
        return self.acc.finish()

    def publish(self, result, state: RunState) -> None:
        """Put the finished result where the run's later passes and assembly read it."""
        raise NotImplementedError(f"{type(self).__name__} does not say where its result goes (Sink.publish)")


@sink_for(CollectJob, StoreJob)
class RowsSink(Sink):
    """Keeps rows (a held side, stored rows) as the job's storage says."""

    phase = "capture"

    @classmethod
    def open(cls, job, ctx):
        # a held side is read whole by its scores job: one chunk (its pieces freed as it is
        # made); stored rows are streamed back chunk by chunk by a later pass
        return cls(job, Collector(job.target, job.storage, whole=type(job) is CollectJob))

    def publish(self, result, state):
        state.rows[self.job.target.token] = result


@sink_for(GroupJob)
class GroupSink(RowsSink):
    @classmethod
    def open(cls, job, ctx):
        return cls(job, GroupAccumulator(job.target))

    def for_shard(self, start):
        self.acc.start = start


@sink_for(FisherJob)
class FisherSink(Sink):
    phase = "statistics"

    @classmethod
    def open(cls, job, ctx):
        return cls(job, FisherAccumulator(job.target))

    def publish(self, result, state):
        state.ops[self.job.target.token] = result


@sink_for(KFACJob)
class KronSink(Sink):
    """K-FAC's factors; an EK-FAC operator's eigenbases wait in ``state.kron`` for its correction."""

    phase = "statistics"

    @classmethod
    def open(cls, job, ctx):
        return cls(job, KronAccumulator(job.target, job.token_block, job.kron_float64_width,
                                        job.kron_float32_rtol, job.kron_diagonal_width))

    def publish(self, result, state):
        where = state.kron if self.job.target.eigen_correction else state.ops
        where[self.job.target.token] = result


@sink_for(EKFACJob)
class EKFACSink(FisherSink):
    @classmethod
    def open(cls, job, ctx):
        return cls(job, EKFACAccumulator(job.target, ctx.state.kron[job.target.token], job.token_block))


@sink_for(ScoresJob)
class ScoresSink(Sink):
    """Scores of each streamed chunk against the held rows, preconditioned once here."""

    @classmethod
    def open(cls, job, ctx):
        return cls(job, _score_accumulator(job, ctx))

    @property
    def fed(self):
        return (_fed_node(self.job),)

    def publish(self, result, state):
        state.results[self.job.key] = result.T if self.job.transposed else result


def _score_accumulator(job: ScoresJob, ctx) -> ScoreAccumulator:
    """The accumulator of a scores job: its held rows, preconditioned once here."""
    space = job.held.space
    if isinstance(job.target.op, Identity):
        held = concat_chunks(ctx.state.rows[job.held.token])
    else:
        # no other job reads the raw rows (planner): dropped block by block as they are
        # preconditioned; a shard strategy that opens the sink again per shard (Dask,
        # torch.distributed: keeps_held_rows) reads them: kept there
        release = job.release_held and not ctx.shards.keeps_held_rows
        held = concat_chunks(ctx.state.rows.pop(job.held.token) if release else ctx.state.rows[job.held.token])
        held = held.replace(dict(held.blocks))      # its own dict: a store's chunk is never emptied
        held = ctx.precondition_held(job.target.op, held, space, consume=release)
    return ScoreAccumulator(held, space, job.kernels, ctx.trace, normalize_streamed=job.normalize_streamed,
                            slice_elements=job.slice_elements, buffer_bytes=job.buffer_bytes,
                            token_block=job.token_block)


def _fed_node(job: ScoresJob):
    """The node whose chunks feed a scores job: a normalization the kernel applies is
    read below it (the unnormalized rows)."""
    return job.streams[0].grads if job.normalize_streamed else job.streams[0]


@sink_for(TopKJob)
class TopKSink(Sink):
    """The k best scores per query: each term's block of a streamed chunk (its own held
    rows and kernels, :class:`ScoreAccumulator` ``.block``), summed with its coefficient,
    merged into a :class:`TopKAccumulator`; no block outlives its chunk.

    Training positions count the streamed examples from the shard's first
    (``for_shard``); a single term holding the training side ranks each streamed
    chunk of queries over all training rows (``rows`` mode)."""

    def __init__(self, job: TopKJob, acc: TopKAccumulator, terms: list, below: list):
        super().__init__(job, acc)
        self.terms = terms          # [(coef, ScoreAccumulator, index into job.streams)]
        self.below = below          # per stream: read below its normalization (the kernel applies it)
        self.start = 0
        self.rows_mode = len(job.terms) == 1 and job.terms[0][1].transposed

    @classmethod
    def open(cls, job, ctx):
        tokens = [s.token for s in job.streams]
        terms = [(c, _score_accumulator(t, ctx), tokens.index(t.streams[0].token)) for c, t in job.terms]
        below = [False] * len(tokens)
        for (_, t), (_, _, i) in zip(job.terms, terms):
            below[i] = below[i] or t.normalize_streamed
        return cls(job, TopKAccumulator(job.k, job.largest), terms, below)

    @property
    def fed(self):
        # by position in job.streams: a Dask shard's job has the same streams restricted to its rows
        return tuple(s.grads if b else s for s, b in zip(self.job.streams, self.below))

    def for_shard(self, start):
        self.start = start

    def feed(self, chunks, state):
        for j in range(len(chunks[0])):
            block = None
            for coef, acc, i in self.terms:
                part = acc.block(chunks[i][j])
                part = part if coef == 1.0 else coef * part
                block = part if block is None else block + part
            if self.rows_mode:                  # (n_train, chunk) → whole query rows
                self.acc.update_rows(block.T)
            else:                               # (n_query, chunk) of training positions start:start+chunk
                self.acc.update(block, self.start)
                self.start += block.shape[1]

    def publish(self, result, state):
        state.results[self.job.key] = result


@sink_for(DiagJob)
class DiagSink(Sink):
    @classmethod
    def open(cls, job, ctx):
        inner = job.target.scores
        resolved = None if isinstance(inner.op, Identity) else ctx.resolve(inner.op)
        return cls(job, DiagAccumulator(inner.left.space, resolved, inner.left == inner.right,
                                        job.slice_elements, job.token_block))

    def feed(self, chunks, state):
        if self.job.held is not None:
            for right in chunks[0]:
                self.acc.update(_aligned_held(state, self.job.held, right), right)
        elif len(chunks) == 2:
            for left, right in zip(*chunks):
                self.acc.update(left, right)
        else:
            for chunk in chunks[0]:
                self.acc.update(chunk)

    def publish(self, result, state):
        state.results[self.job.key] = result


def _aligned_held(state: RunState, held, right: Chunk) -> Chunk:
    """The held rows of a self-score, in the order of the streamed chunk's example ids."""
    rows = concat_chunks(state.rows[held.token])
    position = {i: k for k, i in enumerate(rows.ids)}
    if len(position) != len(rows.ids):
        raise DataError(
            "the rows of a self-score (a diagonal S_zz) repeat example ids (e.g. training-time rows "
            "of an example seen in several epochs), so they cannot be aligned by id: combine them "
            "first, ga.integrations.combine_repeats(G, 'sum' or 'mean')")
    index = torch.tensor([position[i] for i in right.ids])
    return Chunk(right.ids, unflatten(flatten(rows, held.space)[index], held.space))
