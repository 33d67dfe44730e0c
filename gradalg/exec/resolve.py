"""Resolution: an operator node ↦ its numbers, a :class:`~gradalg.linalg.LinearOp`.

Each node resolves itself (``node.resolve(ctx)``, :mod:`gradalg.expr.operators`); this
module is the executor's side of it, :class:`Resolution`, the context a node asks for its
operands' numbers, its statistics (left in the run state by the planned passes that
computed them: an operator resolved outside such a plan has its statistics planned and run
then, :meth:`Resolution.accumulate`), a stream of rows (planned passes over windows of
them, :meth:`Resolution.rows`), or products with the loss curvature (the matvec a planned
products pass published, :meth:`Resolution.products`).
The rules applied are in the result's ``rules``, the same list the node's ``labels()``
predicts from the expression alone.

``precondition`` applies a resolved operator to the held side of a score.
"""
from __future__ import annotations

import weakref

from ..capture.chunks import Chunk, block_bytes, flatten, unflatten
from ..errors import PlanError
from ..expr import OpNode, Statistic
from ..linalg import LinearOp
from .allocator import FreedBytes
from ..proj.kinds import dtype_device

__all__ = ["precondition", "Resolution", "published"]


def published(state, statistic: Statistic) -> LinearOp | None:
    """Where a statistic's job published its numbers in the run ``state``
    (``job.publish``), or None: a K-FAC basis awaiting its EK-FAC correction in
    ``state.kron``, every other statistic as its operator in ``state.ops``."""
    token = statistic.node.token
    if statistic.job == "kfac" and getattr(statistic.node, "eigen_correction", False):
        return state.kron.get(token)
    return state.ops.get(token)


class Resolution:
    """The :class:`~gradalg.expr.operators.ResolveContext` of one executor."""

    def __init__(self, executor):
        self.executor, self.options = executor, executor.options

    def resolve(self, op: OpNode) -> LinearOp:
        return self.executor.resolve(op)

    def accumulate(self, statistic: Statistic, *prior: LinearOp) -> LinearOp:
        """The statistic's numbers, from the pass of a plan that computed them; for an
        operator resolved outside such a plan (``executor.resolve(op)`` on its own), the
        executor plans and runs its statistics' passes now
        (:meth:`~gradalg.exec.base.Executor.run_statistics`: estimated, placed by the shard
        strategy and run like any pass). ``prior`` (the statistics of ``statistic.after``)
        were computed by the same plan."""
        return self._planned(statistic.node, lambda: published(self.executor.state, statistic),
                             f"compute its {statistic.job!r} statistic")

    def rows(self, grads):
        """A fresh stream of the rows of ``grads`` per call, by planned passes over windows
        of them (:meth:`~gradalg.exec.base.Executor.windows`) of this executor while it
        lives. The stream holds it weakly: its run state keeps the resolved operator that
        holds the stream (executor → state → operator → stream), so a strong reference
        closed a cycle that only the cyclic GC freed, with the run state in it. Once the
        executor is gone (an operator kept beyond it: ``ga.compile``'s, or
        ``ex.operator(H)``'s after ``del ex``), a spare in this process with its options and
        choices (not its shard strategy: a Dask or torch.distributed executor is its own),
        but not its run state, reads the windows (the operators of the rows' chain resolved
        again, once): the same rows."""
        from .base import Executor     # (base imports this module)
        ex = self.executor
        live, spare = weakref.ref(ex), Executor(ex.options, rewrites=ex.rewrites, choices=ex.choices)
        return lambda: (chunk.blocks for chunk in (live() or spare).windows(grads))

    def products(self, task, data, layers, kind, node):
        """The matvec of ``node``'s products: the planned products pass's
        (:class:`~gradalg.plan.jobs.products.ProductPass`, published by the plan that ran it;
        for an operator resolved outside such a plan, its products pass is planned and run
        now, :meth:`~gradalg.exec.base.Executor.run_statistics`)."""
        return self._planned(node, lambda: self.executor.state.results.get(("products", node.token)),
                             "plan its products pass")

    def _planned(self, node: OpNode, find, what: str):
        """``find()``: numbers a plan's pass left in the run state for ``node``; if none did
        (``node`` resolved outside such a plan), its statistics' passes are planned and run now."""
        found = find()
        if found is None:
            self.executor.run_statistics(node)
            found = find()
        if found is None:
            raise PlanError(f"the plan of {node.label} did not {what} (a planner bug: report it)")
        return found


def precondition(resolved: LinearOp, held: Chunk, space, *, consume: bool = False,
                 release_above: float = 2**20) -> Chunk:
    """The held side of a score with the operator applied: block by block for operators
    that act per block on factored rows (Kronecker), else on the concatenated rows.

    consume : the caller owns ``held.blocks`` (no other reader): each raw block is dropped
        from it once its preconditioned rows exist, so the two copies of the rows are not
        all in memory together (``held`` is left with no blocks), and their pages are
        returned to the operating system once the blocks dropped since the last return
        reach ``release_above`` bytes (:class:`~gradalg.exec.allocator.FreedBytes`: the
        option ``ga.options(release_memory_above)``; a return per small block costs a walk of the
        whole heap each).
    """
    if hasattr(resolved, "apply_block"):
        out = {}
        pages = FreedBytes(release_above)
        for name in list(held.blocks):
            value = held.blocks.pop(name) if consume else held.blocks[name]
            out[name] = resolved.apply_block(name, value).to(dtype_device(value)[0])
            dropped = block_bytes(value)
            del value
            if consume:   # the raw blocks' pages back to the OS: the next, larger outputs cannot reuse them
                pages.freed(dropped)
        return Chunk(held.ids, out, held.batch, held.task, held.meta)
    return held.replace(unflatten(resolved.apply(flatten(held, space)), space))
