"""A + B for resolved operators of any structures, by the sum rules of
:func:`gradalg.linalg.rules.choose_sum`.

    identity + identity   (a + b)·I                       identity.sum
    diag + diag           diag(u + v)                     diagonal.sum
    kron + c·I            eigenvalues + c                 kronecker.plus_identity
    kron + kron           eigenvalues add (same bases)    kronecker.sum_in_shared_eigenbasis
    implicit + c·I        the shift grows                 implicit.plus_identity
    implicit + any        lazy: (A + B)x = Ax + Bx        implicit.sum_of_products
    explicit mixtures     block by block, or dense        [kronecker|low-rank].expand_to_*, block.sum, dense.sum
"""
from __future__ import annotations

import torch

from .base import LinearOp
from .explicit import ResolvedOp, explicit
from .implicit import ImplicitOp
from .rules import choose_sum

__all__ = ["add", "same_eigenbasis"]


def same_eigenbasis(a: LinearOp, b: LinearOp) -> bool:
    """Two Kronecker operators with identical per-block eigenbases."""
    if a.form != "kronecker" or b.form != "kronecker":
        return False
    return all(_same_basis(a.bases[n][0], b.bases[n][0]) and _same_basis(a.bases[n][1], b.bases[n][1])
               for n in a.space.names)


def _same_basis(P, Q) -> bool:
    """Equal eigenbases; None is the identity (a diagonal Kronecker factor)."""
    if P is None or Q is None:
        return P is None and Q is None
    return torch.equal(P, Q)


def _identity_multiple(op: ResolvedOp) -> float:
    return float(op.data[0])


def add(a: LinearOp, b: LinearOp) -> LinearOp:
    """a + b, recording the sum rules after both operands' own rules."""
    if hasattr(a.space, "check_same"):
        a.space.check_same(b.space, "operators in a sum")
    steps, _, swapped = choose_sum(a.structure, b.structure, same_eigenbasis=same_eigenbasis(a, b))
    left, right = (b, a) if swapped else (a, b)
    first = steps[0]
    if first == "identity.sum":
        out = ResolvedOp(a.space, "diag", left.data + right.data.to(left.data.dtype), frozenset({"identity"}))
    elif first in ("kronecker.plus_identity", "implicit.plus_identity"):
        out = left._damp(_identity_multiple(right))
    elif first == "diagonal.sum":
        out = ResolvedOp(a.space, "diag", left.data + right.data.to(left.data.dtype))
    elif first == "kronecker.sum_in_shared_eigenbasis":
        out = left._with({k: v + right.eigenvalues[k] for k, v in left.eigenvalues.items()})
    elif first == "implicit.sum_of_products":
        def matvec(V, left=left, right=right):
            return left.apply(V) + right.apply(V).to(V.dtype)
        out = ImplicitOp(a.space, matvec)
    else:
        target = steps[-1].split(".")[0]   # "block" or "dense"
        l, r = explicit(left, target), explicit(right, target)
        if target == "block":
            out = ResolvedOp(a.space, "block", {n: l.data[n] + r.data[n].to(l.data[n].dtype) for n in a.space.names})
        else:
            out = ResolvedOp(a.space, "dense", l.data + r.data.to(l.data.dtype))
    tags = (set(a.tags) & set(b.tags)) & {"psd"}
    if first == "identity.sum":
        tags.add("identity")
    return out._recorded(a.rules + b.rules + tuple(steps), tags)
