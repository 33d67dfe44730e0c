"""Resolution: an operator node ↦ its numbers, a :class:`~gradalg.linalg.LinearOp`.

Leaves are read (``Identity``, ``Diagonal``, ``Dense``, a stored operator), accumulated
over the data on the executor's pull path when no pass of the plan produced them
(``Fisher``, ``KFAC``), or built from products (:mod:`gradalg.exec.curvature`).
Every other node is one operation of the protocol on its operand, done by the named
rule its structure selects (:mod:`gradalg.linalg.rules`); the rules applied are in
the result's ``rules``, the same list :func:`gradalg.plan.resolution.resolution_rules`
predicts from the expression alone.

``precondition`` applies a resolved operator to the held side of a score.
"""
from __future__ import annotations

import torch

from ..expr import (KFAC, Arnoldi, CurvatureProducts, Damp, DataInf, Dense, Diagonal, Fisher, Identity, Inverse,
                    OpNode, Power, ScaledOp, SumOp)
from ..expr.spectral import Spectral
from ..expr.stored import StoredOp
from ..linalg import LinearOp, ResolvedOp
from .accumulators import EKFACAccumulator, FisherAccumulator, KronAccumulator
from ..capture.chunks import Chunk, flatten, unflatten
from .allocator import release_free_memory
from .curvature import resolve_curvature
from .rowwise import dtype_device
from ..errors import MemoryBudgetError
from ..plan.budget import resolve_budget, with_note

__all__ = ["resolve_node", "precondition"]

CURVATURE_NODES = (CurvatureProducts, Arnoldi, DataInf)


def resolve_node(executor, node: OpNode) -> LinearOp:
    """The numbers of ``node``; operands through ``executor.resolve`` (memoized there)."""
    if isinstance(node, Identity):
        return ResolvedOp.identity(node.space, torch.float64)  # exact in any row dtype
    if isinstance(node, Diagonal):
        return ResolvedOp(node.space, "diag", node.values)
    if isinstance(node, Dense):
        return ResolvedOp(node.space, "dense", node.matrix)
    if isinstance(node, StoredOp):  # numbers kept outside the expression (ga.store, ga.compile)
        return node.store.load()
    if isinstance(node, Fisher):
        budget = resolve_budget(executor.options)    # the pull path runs without a plan
        try:
            acc = FisherAccumulator(node, budget.bytes)
        except MemoryBudgetError as err:
            err.args = (with_note(err, budget), *err.args[1:])
            raise
        for chunk in executor.iter_chunks(node.grads):
            acc.update(chunk)
        return acc.finish()
    if isinstance(node, KFAC):
        return _kfac(executor, node)
    if isinstance(node, Damp):
        return executor.resolve(node.op).damp(node.damping, relative=node.relative, what=node.op.label)
    if isinstance(node, Inverse):
        method = None if node.method == "auto" else node.method
        return executor.resolve(node.op).inverse(node.op.label, method=method, **dict(node.settings))
    if isinstance(node, Power):
        return executor.resolve(node.op).power(node.p, node.op.label)
    if isinstance(node, Spectral):
        return executor.resolve(node.op).spectral(node.fn, node.op.label)
    if isinstance(node, ScaledOp):
        return executor.resolve(node.op).scale(node.scale)
    if isinstance(node, SumOp):
        total = executor.resolve(node.ops[0])
        for op in node.ops[1:]:
            total = total.add(executor.resolve(op))
        return total
    if isinstance(node, CURVATURE_NODES):
        return resolve_curvature(executor, node)
    raise TypeError(f"the {getattr(executor, 'name', 'local')} executor cannot resolve operator "
                    f"{type(node).__name__}")


def _kfac(executor, node: KFAC) -> LinearOp:
    kfac = executor._kron.get(node.token) if hasattr(executor, "_kron") else None
    if kfac is None:
        o = executor.options
        acc = KronAccumulator(node, o.token_block, o.kron_float64_width, o.kron_float32_rtol, o.kron_diagonal_width)
        for chunk in executor.iter_chunks(node.covariance_grads):   # covariance_max_examples
            acc.update(chunk)
        kfac = acc.finish()
    if not node.eigen_correction:
        return kfac
    corr = EKFACAccumulator(node, kfac, executor.options.token_block)
    for chunk in executor.iter_chunks(node.lambda_grads):           # lambda_max_examples
        corr.update(chunk)
    return corr.finish()


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
