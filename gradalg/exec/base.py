"""The executor: one compute path for every result, and the registry of executors.

Every result is computed the same way, :meth:`Executor.compute`:

1. **plan** (:func:`gradalg.plan.planner.plan`): the passes, their jobs and kernels, and
   for each pass where its shards run (``plan.placement``, answered by the shard strategy
   from the pass alone, :meth:`~gradalg.exec.runner.ShardStrategy.place`, and recorded
   by the plan's place stage, :mod:`gradalg.plan.placement`, as a ``PLACEMENT`` decision
   in ``plan.decisions``);
2. **run** (:class:`~gradalg.exec.runner.PassRunner`): each pass's jobs fed, by the
   strategy (``run_shards``) or in this process, their results published into the
   :class:`~gradalg.exec.state.RunState`;
3. **assemble**: the result read from the run state.

The entry points are that path with their reader: ``scores(node)`` (n_query, n_train),
``diagonal(node)`` (n,) self-scores, ``topk(node, spec)`` ``(values, positions)`` each
(n_query, k), ``gradients(node)`` all rows (a Chunk), ``operator(node)`` the resolved
:class:`~gradalg.linalg.LinearOp`. Executors differ only in their shard strategy:
:class:`~gradalg.exec.LocalExecutor` (this process), :class:`~gradalg.exec.DaskExecutor`
(shards on Dask workers), :class:`~gradalg.exec.TorchDistributed` (ranks of a torchrun
job). Work outside the plan being run is planned too: an operator resolved on its own has
its statistics (products included) planned and run as passes
(:meth:`Executor.run_statistics`); rows read outside a pass (a store's chunk, the training
rows of DataInf applied by itself) are *windows* of rows, each the plan of its rows
(:meth:`Executor.window`, :meth:`Executor.windows`: sized against the memory budget and
refused by the plan where a window does not fit). Operators known only through products
run them through the products pass their plan published (one pass over their data per
call of the solver, :mod:`gradalg.plan.jobs.products`).

Executors are picked by object or by name (``get_executor("local")``,
``get_executor("dask")``); a missing optional dependency is reported with the command
that installs it.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace
from importlib import import_module
from typing import Callable, Iterator

import torch

from ..capture.chunks import Chunk, concat_chunks
from ..errors import MissingLibraryError, OptionError
from ..expr import GradNode, OpNode, ScoreDiagonal, ScoreNode
from ..expr.windows import by_examples, freeze_ops, restrict_rows
from ..options import Options, get_options
from ..plan.blocks import window_rows
from ..plan.budget import resolve_budget
from ..plan.choices import Choices
from ..plan.placement import place_passes
from ..plan.planner import Plan, model_device, plan as make_plan
from .allocator import FreedBytes
from .phases import PhaseClock
from .resolve import Resolution, precondition
from .runner import InProcess, PassRunner, ShardStrategy
from .state import RunState

__all__ = ["Executor", "get_executor", "EXECUTORS"]


class Executor:
    """Runs expression nodes: plan, run the passes with a shard strategy, assemble.

    One executor serves one ``compute()``. ``rewrites=False`` disables the planner's
    rewrite rules and ``choices`` (:class:`~gradalg.plan.Choices`) forces the held side
    and store-vs-recompute decisions (differential tests compare all of them). When free
    memory is returned to the system follows the options (``ga.options(release_memory_above=...,
    release_growth=...)``, shown in the plan's header): after a pass's batches where its
    plan says (``Pass.trim_after_batches``, a ``TRIM`` decision). ``shards``: the
    :class:`~gradalg.exec.runner.ShardStrategy` (default: the whole pass in this process).
    ``state``: a :class:`~gradalg.exec.state.RunState` to start from (a Dask worker's:
    the resolved operators its shard needs).

    After a run, ``last_plan`` is the plan that ran, ``pass_stats`` the measured seconds
    and memory of each pass (one entry per pass of ``last_plan``, in order; the passes of
    plans run during one of its passes, windows of rows or an operator's statistics, are
    in ``nested_stats``, their time inside that pass's), ``trace`` the counts of the kernels that ran and
    ``phase_seconds`` the wall seconds per phase (:mod:`gradalg.exec.phases`).
    """

    name = "local"

    def __init__(self, options: Options | None = None, *, rewrites: bool = True, choices: Choices | None = None,
                 shards: ShardStrategy | None = None, state: RunState | None = None):
        self.options = options or get_options()
        self.rewrites = rewrites
        self.choices = choices
        self.shards = shards if shards is not None else InProcess()
        self.reset(state)

    def reset(self, state: RunState | None = None) -> None:
        """Forget every resolved operator, kept row and result of earlier runs.

        An executor memoizes by node identity, which does not see model weights changed
        in place: call ``reset()`` (or use a new executor) after a training step."""
        self.trace: Counter = Counter()
        self.state = state if state is not None else RunState()
        self.last_plan: Plan | None = None
        self.pass_stats: list[dict] = []
        self.nested_stats: list[dict] = []     # passes of plans run during another's pass (_aside)
        self._running = 0                      # plans being run (nested: > 1)
        self.clock = PhaseClock()

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Wall seconds per phase of this executor's runs (:mod:`gradalg.exec.phases`)."""
        return self.clock.report()

    # ------------------------------------------------------------------ the compute path
    def plan(self, node, topk=None, budget=None) -> Plan:
        """The plan this executor would run for ``node``, under its options, rewrites and
        forced choices (row counts measured from the data; nothing is computed), each
        pass placed by the shard strategy (the place stage,
        :func:`~gradalg.plan.placement.place_passes`); ``topk`` (:class:`~gradalg.plan.jobs.TopK`):
        the plan of its top-k; ``budget`` (:class:`~gradalg.plan.budget.Budget`): a memory
        budget other than the strategy's (:meth:`ShardStrategy.budget`) or the options'."""
        with self.clock.phase("planning"):
            budget = budget or self.shards.budget(self.options, node)
            p = make_plan(node, options=self.options, rewrites=self.rewrites, choices=self.choices,
                          measure_shapes=True, topk=topk, budget=budget, keep_held_rows=self.shards.keeps_held_rows)
            return place_passes(p, self.shards)

    def run(self, p: Plan) -> Plan:
        """Run every pass of ``p`` where it is placed (:class:`~gradalg.exec.runner.PassRunner`);
        a plan made elsewhere (``ga.plan``, without placement) is placed first by the plan's
        place stage (:func:`~gradalg.plan.placement.place_passes`), so that where each pass ran is a decision of the plan that
        ran (``last_plan``)."""
        if len(p.placement) != len(p.passes):
            p = place_passes(p, self.shards)
        self.shards.before_run(p)
        self.last_plan = p
        self._running += 1
        try:
            return PassRunner(self, self.shards).run(p)   # made per run: kept on self, it held a cycle (self.runner.ctx is self)
        finally:
            self._running -= 1

    def compute(self, node, read: Callable, topk=None):
        """Plan ``node``, run the plan, and assemble: ``read(plan.simplified)``."""
        p = self.run(self.plan(node, topk=topk))
        with self.clock.phase("assembly"):
            return read(p.simplified)

    def scores(self, node: ScoreNode):
        """The (n_left, n_right) score matrix of ``node`` (score terms as the strategy
        returns them: tensors here, Dask arrays of the shards' blocks on Dask)."""
        return self.compute(node, lambda n: self.state.scores(n, as_array=self.shards.as_array))

    def diagonal(self, node: ScoreDiagonal) -> torch.Tensor:
        """S_ii of a square score expression, without its off-diagonal entries.   (n,)"""
        return self.compute(node, lambda n: self.state.diagonal(n.scores))

    def topk(self, node: ScoreNode, spec):
        """The ``spec.k`` best scores per query of ``node`` and their training positions,
        ``(values, positions)`` each (n_query, k), by one top-k plan
        (:class:`~gradalg.plan.jobs.TopKJob`)."""
        return self.compute(node, lambda n: self.state.results[("topk", n.token)], topk=spec)

    def gradients(self, node: GradNode) -> Chunk:
        """All rows of ``node`` in one chunk (for inspection and tests; holds n × dim)."""
        return self.compute(node, lambda n: concat_chunks(self.state.rows[n.token]))

    def operator(self, node: OpNode):
        """The resolved numbers of an operator node."""
        return self.compute(node, self.resolve)

    def page_returner(self) -> FreedBytes:
        """A counter of dropped bytes that returns free pages to the operating system each
        time ``ga.options(release_memory_above)`` bytes were dropped (rows joined block by block)."""
        return FreedBytes(self.options.release_memory_above)

    def precondition_held(self, op: OpNode, held: Chunk, space, *, consume: bool = False) -> Chunk:
        """The held rows of a score with the resolved ``op`` applied (once per pass; rows a
        planned :class:`~gradalg.plan.jobs.apply.ApplyJob` preconditioned are read by its
        key, ``ScoresJob.applied``); ``consume`` empties ``held`` block by block, returning
        pages per ``ga.options(release_memory_above)`` bytes dropped
        (:func:`~gradalg.exec.resolve.precondition`)."""
        resolved = self.resolve(op)
        with self.clock.phase("scoring"):
            return precondition(resolved, held, space, consume=consume,
                                release_above=self.options.release_memory_above)

    # ------------------------------------------------------------------ windows of rows
    def window(self, node: GradNode, start: int | None = None, stop: int | None = None) -> Chunk:
        """Rows ``start:stop`` of ``node`` in one chunk (None: every row): the rows of its
        window (:func:`~gradalg.expr.windows.restrict_rows`), planned and run like any
        gradient node (:meth:`gradients`: priced, shown by ``explain()``, a window over the
        memory budget refused by its plan), unless a plan of this executor kept them. They
        are not kept in the run state, and ``last_plan`` stays the plan being run, if any
        (a window read during a pass)."""
        sub = node if start is None else restrict_rows(node, start, stop)
        if sub.token in self.state.rows:      # rows a plan of this executor kept: read, not computed again
            return concat_chunks(self.state.rows[sub.token])
        with self._aside():
            return self.compute(sub, lambda n: concat_chunks(self.state.rows.pop(n.token)))

    def windows(self, node: GradNode) -> Iterator[Chunk]:
        """Every row of ``node`` in order, window by window (:meth:`window`), each of
        :meth:`window_rows` rows, the operators of its row chain resolved once
        (:func:`~gradalg.expr.windows.freeze_ops`); one window of all its rows where they
        cannot be computed by ranges of examples (rows captured in memory, group means,
        Gauss-Newton terms: :func:`~gradalg.expr.windows.by_examples`)."""
        if not by_examples(node):
            yield self.window(node)
            return
        node = freeze_ops(self.resolve, node)
        size = self.window_rows(node)
        for start in range(0, node.n, size):
            yield self.window(node, start, min(start + size, node.n))

    def window_rows(self, node: GradNode) -> int:
        """Rows per window of :meth:`windows`: the most whose kept rows fit
        ``ga.options(store_fraction)`` of the memory budget (rows kept for a later use,
        the plan's store cap), at least one (a window still over the budget is refused by
        its plan); the bytes of a row from the facts of the plan of all of ``node``'s rows,
        sized without a budget (:func:`~gradalg.plan.blocks.window_rows`, which the plan's
        ``WINDOWS`` decision shows)."""
        budget = self.shards.budget(self.options, node) or resolve_budget(self.options, model_device(node))
        whole = self.plan(node, budget=replace(budget, bytes=2**62))
        return window_rows(whole.simplified, whole.facts, budget.bytes)[0]

    def run_statistics(self, op: OpNode) -> None:
        """Plan and run the passes of ``op``'s statistics (an operator resolved outside a
        plan that computed them): planned, placed by the shard strategy and run like any
        pass; the jobs publish them into the run state. ``last_plan`` stays the plan being
        run, if any (else it is this one)."""
        with self._aside():
            self.run(self.plan(op))

    @contextlib.contextmanager
    def _aside(self):
        """Plans run beside the one being run (a window, an operator's statistics):
        ``last_plan`` stays the plan being run, if any (else it is the one run here). Run
        during a pass of another plan, their measured passes go to ``nested_stats``, so that
        ``pass_stats`` keeps one entry per pass of ``last_plan``, in its order
        (``explain(analyze=True)`` reads them by position), and the outer pass's measured
        time includes the work it asked for (its estimate prices it)."""
        outer_plan, outer_stats = self.last_plan, self.pass_stats
        nested = self._running > 0
        if nested:
            self.pass_stats = []
        try:
            yield
        finally:
            if nested:
                self.nested_stats += self.pass_stats
                self.pass_stats = outer_stats
            self.last_plan = outer_plan or self.last_plan

    def resolve(self, node: OpNode):
        """The numbers of an operator node (memoized; by the node's rules from what the
        passes of the plan published, or from passes planned and run now,
        :class:`~gradalg.exec.resolve.Resolution`)."""
        ops = self.state.ops
        if node.token not in ops:
            with self.clock.phase("statistics"):
                ops[node.token] = node.resolve(Resolution(self))   # by the named rules of the operator protocol
        return ops[node.token]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the strategy's resources (clusters, files)."""
        self.shards.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


#: executors by name: (module of gradalg.exec, class, (the package it imports, how to install it) or None)
EXECUTORS = {"local": ("local", "LocalExecutor", None),
             "dask": ("dask", "DaskExecutor", ("distributed", "pip install 'gradalg[dask]'")),
             "torch_distributed": ("distributed", "TorchDistributed", None)}


def get_executor(executor=None, **kwargs) -> Executor:
    """An executor from a name ("local", "dask", "torch_distributed"), an Executor, or None (local)."""
    if executor is not None and not isinstance(executor, str):
        return executor
    name = executor or "local"
    if name not in EXECUTORS:
        raise OptionError(f"unknown executor {name!r}; choose one of {sorted(EXECUTORS)}")
    module, cls, needs = EXECUTORS[name]
    if needs is not None:
        try:
            import_module(needs[0])
        except ImportError as err:
            raise MissingLibraryError(f"the {name} executor needs {needs[0]}: {needs[1]}") from err
    return getattr(import_module(f"{__package__}.{module}"), cls)(**kwargs)
