"""The local executor: runs a physical plan with PyTorch on the model's device.

A plan (:mod:`gradalg.plan.planner`) is a list of passes. Each pass reads one dataset
(or rows kept in memory) once, batch by batch; every batch is captured once per
source and fed to all the jobs of the pass — curvature statistics, collections of
held or stored rows, and scores against a held side that was preconditioned before
the pass started. Per-example training gradients exist one batch at a time. The
passes are run by a :class:`~gradalg.exec.runner.PassRunner` (one sink per job,
registered by job class in :mod:`gradalg.exec.sinks`); what runs a pass's shards is
the executor's shard strategy: here, :class:`~gradalg.exec.runner.InProcess`; the
Dask executor composes a LocalExecutor with its own.

Per block, the inner product of a batch with the held side uses the kernel the plan
chose (``ghost``: ⟨D_iᵀA_i, D_jᵀA_j⟩ = Σ_{t,s}(a_it·a_js)(d_it·d_js) from the factors;
``dense``: materialize, then one GEMM); ``executor.trace`` counts which ran.

Besides plans, the executor offers a pull path (``iter_chunks``, ``resolve``) that
computes one node at a time; iterative solvers and other operators known only through
products use it from inside a pass.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterator

import torch

from ..expr import Captured, GradNode, GroupMean, OpNode, ScoreDiagonal, ScoreNode, Source
from ..data import batch_size_of, move_batch
from ..options import Options, get_options
from ..plan.choices import Choices
from ..plan.planner import ROW_WISE, Plan, plan as make_plan
from .base import Executor
from .accumulators import GroupAccumulator
from .capture_pass import SourceCapture, eval_mode, model_device_dtype
from .phases import PhaseClock
from ..capture.chunks import Chunk, concat_chunks
from .resolve import precondition, resolve_node
from .rowwise import apply_rowwise, fuses_blocks, project_blockwise
from .runner import PassRunner
from .state import RunState

__all__ = ["LocalExecutor"]


class LocalExecutor(Executor):
    """Runs expression nodes with PyTorch in this process.

    One executor serves one ``compute()``. ``rewrites=False`` disables the planner's
    rewrite rules and ``choices`` (:class:`~gradalg.plan.Choices`) forces the held side
    and store-vs-recompute decisions (differential tests compare all of them).
    ``release_memory_above``: after each batch of a pass whose planned working set is
    at least this many bytes, free memory is returned to the system
    (:mod:`gradalg.exec.allocator`; smaller batches free too little to be worth the call;
    ``float("inf")`` never). After a run, ``last_plan`` is the
    plan that ran and ``pass_stats`` the measured seconds and memory of each pass.

    ``shards``: the strategy that runs a pass's shards (default
    :class:`~gradalg.exec.runner.InProcess`; :class:`~gradalg.exec.dask.DaskExecutor`
    passes itself). ``state``: a :class:`~gradalg.exec.state.RunState` to start from (a
    Dask worker's: the resolved operators and bases its shard needs).
    """

    name = "local"

    def __init__(self, options: Options | None = None, *, rewrites: bool = True, choices: Choices | None = None,
                 release_memory_above: float = 2**20, shards=None, state: RunState | None = None):
        self.options = options or get_options()
        self.rewrites = rewrites
        self.choices = choices
        self.release_memory_above = release_memory_above
        self.shards = shards
        self.reset(state)

    def reset(self, state: RunState | None = None) -> None:
        """Forget every resolved operator, kept row and result of earlier runs.

        An executor memoizes by node identity, which does not see model weights changed
        in place: call ``reset()`` (or use a new executor) after a training step."""
        self.trace: Counter = Counter()
        self.state = state if state is not None else RunState()
        # the state's tables under the names the pull path (resolve) uses
        self._ops, self._kron, self._cache = self.state.ops, self.state.kron, self.state.rows
        self._checked_tasks = self.state.checked
        self.runner = PassRunner(self, self.shards)
        self.last_plan: Plan | None = None
        self.pass_stats: list[dict] = []
        self.clock = PhaseClock()

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Wall seconds per phase of this executor's runs (:mod:`gradalg.exec.phases`)."""
        return self.clock.report()

    # ------------------------------------------------------------------ entry points
    def plan(self, node, topk=None, budget=None) -> Plan:
        """The plan this executor would run for ``node``, under its options, rewrites and
        forced choices (row counts measured from the data; nothing is computed);
        ``topk`` (:class:`~gradalg.plan.jobs.TopK`): the plan of its top-k; ``budget``
        (:class:`~gradalg.plan.budget.Budget`): a memory budget other than the options'."""
        with self.clock.phase("planning"):
            return make_plan(node, options=self.options, rewrites=self.rewrites, choices=self.choices,
                             measure_shapes=True, topk=topk, budget=budget)

    def scores(self, node: ScoreNode) -> torch.Tensor:
        """The (n_left, n_right) score matrix of ``node``."""
        p = self.run(self.plan(node))
        with self.clock.phase("assembly"):
            return self.state.scores(p.simplified)

    def diagonal(self, node: ScoreDiagonal) -> torch.Tensor:
        """S_ii of a square score expression, without its off-diagonal entries.   (n,)"""
        p = self.run(self.plan(node))
        with self.clock.phase("assembly"):
            return self.state.diagonal(p.simplified.scores)

    def gradients(self, node: GradNode) -> Chunk:
        """All rows of ``node`` in one chunk (for inspection and tests; holds n × dim)."""
        p = self.run(self.plan(node))
        return concat_chunks(self.state.rows[p.simplified.token])

    def operator(self, node: OpNode):
        """The resolved numbers of an operator node."""
        p = self.run(self.plan(node))
        return self.resolve(p.simplified)

    # ------------------------------------------------------------------ running plans
    def run(self, p: Plan) -> Plan:
        """Run every pass of ``p`` (:class:`~gradalg.exec.runner.PassRunner`)."""
        self.last_plan = p
        return self.runner.run(p)

    def precondition_held(self, op: OpNode, held: Chunk, space, *, consume: bool = False) -> Chunk:
        """The held rows of a score with the resolved ``op`` applied (once per pass);
        ``consume`` empties ``held`` block by block (:func:`~gradalg.exec.resolve.precondition`)."""
        resolved = self.resolve(op)
        with self.clock.phase("scoring"):
            return precondition(resolved, held, space, consume=consume)

    # ------------------------------------------------------------------ pull path
    def iter_chunks(self, node: GradNode) -> Iterator[Chunk]:
        """Chunks of rows of ``node``, in order, one node at a time (no fusion)."""
        if node.token in self._cache:
            yield from self._cache[node.token]
            return
        if isinstance(node, Source):
            capture = SourceCapture(node, self.options, self._checked_tasks)
            device, _ = model_device_dtype(node.task.model)
            start = 0
            with eval_mode(node.task.model):
                for batch in node.data.loader(self.options.batch_size):
                    batch = move_batch(batch, device)
                    b = batch_size_of(batch)
                    ids = node.data.ids[start:start + b]
                    start += b
                    node.task.validate_batch(batch, ids)   # bad batches name their example ids here too
                    yield from capture.capture(batch, ids)
        elif isinstance(node, Captured):
            yield from node.store.chunks()
        elif isinstance(node, GroupMean):
            acc = GroupAccumulator(node)
            for chunk in self.iter_chunks(node.grads):
                acc.update(chunk)
            self._cache[node.token] = acc.finish()
            yield from self._cache[node.token]
        elif fuses_blocks(node) and node.grads.token not in self._cache:   # P(G.adam(·)) a block at a time
            for chunk in self.iter_chunks(node.grads.grads):
                yield project_blockwise(self, node, chunk)
        elif isinstance(node, ROW_WISE):
            for chunk in self.iter_chunks(node.grads):
                yield apply_rowwise(self, node, chunk)
        else:
            raise TypeError(f"the local executor cannot compute {type(node).__name__}")

    def resolve(self, node: OpNode):
        """The numbers of an operator node (memoized; computed on the pull path if no
        pass of the plan produced them)."""
        if node.token not in self._ops:
            with self.clock.phase("statistics"):
                self._ops[node.token] = self._resolve(node)
        return self._ops[node.token]

    def _resolve(self, node: OpNode):
        return resolve_node(self, node)   # by the named rules of the operator protocol
