"""Resolution: an operator node ↦ its numbers, a :class:`~gradalg.linalg.LinearOp`.

Each node resolves itself (``node.resolve(ctx)``, :mod:`gradalg.expr.operators`); this
module is the executor's side of it, :class:`Resolution`, the context a node asks for its
operands' numbers, its statistics (from a pass of the plan, else accumulated over the
data here, on the pull path), a stream of rows, or products with the loss curvature.
The rules applied are in the result's ``rules``, the same list the node's ``labels()``
predicts from the expression alone.

``precondition`` applies a resolved operator to the held side of a score.
"""
from __future__ import annotations

from ..capture.chunks import Chunk, flatten, unflatten
from ..curvature.hvp import dataset_matvec
from ..errors import MemoryBudgetError, OperatorError
from ..expr import OpNode, Statistic
from ..linalg import LinearOp
from ..plan.budget import resolve_budget, with_note
from ..plan.jobs import EKFACAccumulator, FisherAccumulator, KronAccumulator
from .allocator import release_free_memory
from .rowwise import dtype_device

__all__ = ["resolve_node", "precondition", "Resolution"]


def resolve_node(executor, node: OpNode) -> LinearOp:
    """The numbers of ``node``; operands through ``executor.resolve`` (memoized there)."""
    return node.resolve(Resolution(executor))


class Resolution:
    """The :class:`~gradalg.expr.operators.ResolveContext` of one executor."""

    def __init__(self, executor):
        self.executor, self.options = executor, executor.options

    def resolve(self, op: OpNode) -> LinearOp:
        return self.executor.resolve(op)

    def accumulate(self, statistic: Statistic, *prior: LinearOp) -> LinearOp:
        """The statistic's numbers, accumulated over its rows on the pull path (a pass of
        the plan that computed them left them where ``executor.resolve`` finds them)."""
        if statistic.job not in _ACCUMULATE:
            raise OperatorError(f"{statistic.node.label} asks for a statistic of job kind {statistic.job!r}; the "
                            f"executors accumulate {sorted(_ACCUMULATE)}: return one of those from its statistics(), "
                            "or read the rows in resolve(ctx) with ctx.rows(grads)")
        return _ACCUMULATE[statistic.job](self.executor, statistic, *prior)

    def rows(self, grads):
        return lambda: (chunk.blocks for chunk in self.executor.iter_chunks(grads))

    def products(self, task, data, layers, kind):
        return dataset_matvec(task, data, layers, kind=kind, batch_size=self.options.batch_size)


def _fisher(executor, statistic: Statistic) -> LinearOp:
    budget = resolve_budget(executor.options)    # the pull path runs without a plan
    try:
        acc = FisherAccumulator(statistic.node, budget.bytes)
    except MemoryBudgetError as err:
        err.args = (with_note(err, budget), *err.args[1:])
        raise
    return _run(acc, executor.iter_chunks(statistic.rows))


def _kfac(executor, statistic: Statistic) -> LinearOp:
    """K-FAC's eigenbasis: the one a pass left awaiting its EK-FAC correction, else accumulated."""
    node, o = statistic.node, executor.options
    kfac = executor.state.kron.get(node.token)
    if kfac is not None:
        return kfac
    acc = KronAccumulator(node, o.token_block, o.kron_float64_width, o.kron_float32_rtol, o.kron_diagonal_width)
    return _run(acc, executor.iter_chunks(statistic.rows))      # covariance_max_examples


def _ekfac(executor, statistic: Statistic, kfac: LinearOp) -> LinearOp:
    acc = EKFACAccumulator(statistic.node, kfac, executor.options.token_block)
    return _run(acc, executor.iter_chunks(statistic.rows))      # lambda_max_examples


def _run(acc, chunks) -> LinearOp:
    for chunk in chunks:
        acc.update(chunk)
    return acc.finish()


#: the accumulation of each statistics job kind on the pull path
_ACCUMULATE = {"fisher": _fisher, "kfac": _kfac, "ekfac": _ekfac}


def precondition(resolved: LinearOp, held: Chunk, space, *, consume: bool = False) -> Chunk:
    """The held side of a score with the operator applied: block by block for operators
    that act per block on factored rows (Kronecker), else on the concatenated rows.

    consume : the caller owns ``held.blocks`` (no other reader): each raw block is dropped
        from it once its preconditioned rows exist, so the two copies of the rows are not
        all in memory together (``held`` is left with no blocks), and its pages are
        returned to the operating system (:func:`~gradalg.exec.allocator.release_free_memory`).
    """
    if hasattr(resolved, "apply_block"):
        out = {}
        for name in list(held.blocks):
            value = held.blocks.pop(name) if consume else held.blocks[name]
            dtype = dtype_device(value)[0]
            out[name] = resolved.apply_block(name, value).to(dtype)
            del value
            if consume:   # the raw block's pages back to the OS: the next, larger output cannot reuse them
                release_free_memory()
        return Chunk(held.ids, out, held.batch, held.task, held.meta)
    return held.replace(unflatten(resolved.apply(flatten(held, space)), space))
