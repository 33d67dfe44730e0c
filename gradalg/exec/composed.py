"""An executor composed with a :class:`~gradalg.exec.LocalExecutor` that plans, keeps the
run state and runs the pass runner, while the composing executor is the runner's shard
strategy (``run_shards``, ``describe_pass``): the Dask executor (passes sharded over
workers) and :class:`~gradalg.exec.TorchDistributed` (passes split over ranks).

:class:`ComposedExecutor` gives them the members they delegate alike, so each of them
writes only what it does differently; neither writes the local executor's private state.
"""
from __future__ import annotations

from .base import Executor
from .state import RunState

__all__ = ["ComposedExecutor"]


class ComposedExecutor(Executor):
    """The delegating members of an executor that holds ``self.local``, a
    :class:`~gradalg.exec.LocalExecutor` built with ``shards=self``."""

    local = None   # set by the subclass's constructor: LocalExecutor(..., shards=self)

    @property
    def options(self):
        """The composed LocalExecutor's ``ga.options`` (settable)."""
        return self.local.options

    @options.setter
    def options(self, value):
        self.local.options = value

    @property
    def rewrites(self) -> bool:
        """Whether the planner applies its rewrite rules (settable)."""
        return self.local.rewrites

    @rewrites.setter
    def rewrites(self, value):
        self.local.rewrites = value

    @property
    def choices(self):
        """Forced planner decisions, :class:`~gradalg.plan.Choices` (settable)."""
        return self.local.choices

    @choices.setter
    def choices(self, value):
        self.local.choices = value

    @property
    def trace(self):
        """Counts of the kernels that ran (tests use it to prove routing)."""
        return self.local.trace

    @property
    def state(self) -> RunState:
        """What the run keeps: rows, resolved operators, K-FAC bases, results."""
        return self.local.state

    @property
    def last_plan(self):
        """The plan that ran last."""
        return self.local.last_plan

    @property
    def pass_stats(self) -> list:
        """Measured seconds and memory of each pass of the last run (in this process)."""
        return self.local.pass_stats

    @property
    def clock(self):
        """Seconds per phase of this process's share of the runs (:mod:`gradalg.exec.phases`)."""
        return self.local.clock

    @property
    def phase_seconds(self) -> dict[str, float]:
        return self.local.phase_seconds

    def reset(self) -> None:
        """Forget every resolved operator, kept row and result (``LocalExecutor.reset``)."""
        self.local.reset()

    def plan(self, node, topk=None):
        """The plan for ``node`` (as :meth:`LocalExecutor.plan`); with ``topk``, one top-k
        job whose shards keep their own top-k (positions offset by their range), merged in
        shard order."""
        return self.local.plan(node, topk=topk)

    def resolve(self, node):
        """The resolved operator of ``node`` (:class:`~gradalg.linalg.LinearOp`), memoized."""
        return self.local.resolve(node)

    def iter_chunks(self, node):
        """The rows of ``node`` chunk by chunk, read in this process (pull path)."""
        return self.local.iter_chunks(node)
