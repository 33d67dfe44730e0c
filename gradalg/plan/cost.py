"""Cost estimates of expression nodes, from shapes alone (no data is touched but one
example's shape, no model is run).

A :class:`Cost` counts multiply-adds (``flops``), the largest tensor held at once
(``peak_bytes``) and ``passes`` over datasets (a forward+backward over the training set
dominates everything else, so passes are reported separately). Counts follow the
kernels in :mod:`gradalg.capture.factors` and :mod:`gradalg.exec.local`; shared
sub-expressions are counted once, as the executor computes them once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capture.factors import dense_flops, ghost_flops
from ..expr import (Captured, Damp, Fisher, GradNode, Identity, Inner, Inverse, Node, Normalize,
                    OpNode, Power, Precondition, Project, ScaleRows, ScoreSum, Select, Source, SumOp)

__all__ = ["Cost", "estimate", "tokens_hint"]


@dataclass(frozen=True)
class Cost:
    flops: float = 0.0
    peak_bytes: float = 0.0
    passes: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, max(self.peak_bytes, other.peak_bytes), self.passes + other.passes)

    def describe(self) -> str:
        return f"~{_si(self.flops)}FLOP, peak ~{_si(self.peak_bytes)}B, {self.passes} pass(es) over data"


def _si(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def tokens_hint(node: GradNode) -> int:
    """Positions per example T, read off the first example's shape (1 when unknown)."""
    src = node.source
    if not isinstance(src, Source):
        return 1
    cached = getattr(src, "_tokens_hint", None)
    if cached is not None:
        return cached
    T = 1
    try:
        batch = src.data.first_example_batch()
        first = batch
        while not isinstance(first, torch.Tensor):
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        if first.dim() == 2 and not first.is_floating_point():
            T = int(first.shape[1])
    except Exception:
        T = 1
    object.__setattr__(src, "_tokens_hint", T)
    return T


def estimate(node: Node) -> Cost:
    """Estimated cost of computing ``node`` (each shared sub-expression once)."""
    return _estimate(node, set())


def _estimate(node: Node, seen: set) -> Cost:
    if node.token in seen:
        return Cost()
    seen.add(node.token)
    below = Cost()
    for child in node.children:
        below = below + _estimate(child, seen)
    return below + _own(node)


def _own(node: Node) -> Cost:
    if isinstance(node, Source):
        T = tokens_hint(node)
        params = sum(b.dim for b in node.space.blocks)
        per_block = max(b.shape[0] * T + (b.shape[-1] * T) for b in node.space.blocks)
        return Cost(flops=4.0 * params * T * node.n, peak_bytes=4.0 * 32 * per_block, passes=1)
    if isinstance(node, Captured):
        return Cost()
    if isinstance(node, Project):
        T = tokens_hint(node)
        flops = 0.0
        for src in node.grads.space.blocks:
            if node.projector.kind == "kron":
                k_out, k_in = node.projector.kron_shape(*src.shape)
                flops += node.n * T * (src.shape[1] * k_in + src.shape[0] * k_out + k_out * k_in)
            else:
                flops += node.n * (T * src.dim + src.dim * node.projector.k)
        return Cost(flops=flops)
    if isinstance(node, (Normalize, ScaleRows, Select)):
        return Cost(flops=float(node.n * node.space.dim))
    if isinstance(node, Precondition):
        return Cost(flops=float(node.n * node.space.dim * node.space.dim))
    if isinstance(node, Fisher):
        d = node.space.dim
        if node.structure == "dense":
            return Cost(flops=float(node.grads.n * d * d), peak_bytes=8.0 * d * d)
        if node.structure == "block":
            sq = sum(b.dim ** 2 for b in node.space.blocks)
            return Cost(flops=float(node.grads.n * sq), peak_bytes=8.0 * sq)
        return Cost(flops=float(node.grads.n * d), peak_bytes=8.0 * d)
    if isinstance(node, (Inverse, Power)):
        if node.structure == "dense":
            return Cost(flops=float(node.space.dim) ** 3)
        if node.structure == "block":
            return Cost(flops=float(sum(b.dim ** 3 for b in node.space.blocks)))
        return Cost(flops=float(node.space.dim))
    if isinstance(node, (Damp, SumOp)):
        return Cost(flops=float(node.space.dim))
    if isinstance(node, Inner):
        return _inner_cost(node)
    if isinstance(node, ScoreSum):
        return Cost(flops=float(len(node.terms) * node.shape[0] * node.shape[1]))
    if isinstance(node, OpNode):
        return Cost()
    return Cost()


def _inner_cost(node: Inner) -> Cost:
    left, right = (node.left, node.right) if node.left.n <= node.right.n else (node.right, node.left)
    TL, TR = tokens_hint(left), tokens_hint(right)
    flops = 0.0
    lrep, rrep = left.representation, right.representation
    if not isinstance(node.op, Identity):
        flops += left.n * left.space.dim * left.space.dim
    for b in left.space.blocks:
        both_factored = lrep[b.name] == rrep[b.name] == "factored" and isinstance(node.op, Identity)
        if both_factored and len(b.shape) == 2:
            args = (left.n, right.n, TL, TR, b.shape[1], b.shape[0])
            flops += min(ghost_flops(*args), dense_flops(*args))
        else:
            flops += left.n * right.n * b.dim
    return Cost(flops=flops, peak_bytes=4.0 * left.n * left.space.dim)
