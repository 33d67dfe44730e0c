"""Routing rules made from shapes alone, for callers outside a plan.

Inside a plan the planner decides every block's kernel before the run (a recorded
decision, :mod:`gradalg.plan.planner`) and the executor follows it.

``choose_kernel``: ghost (factored) vs materialize-then-GEMM for one block's inner
products between a held chunk ``L`` (nL examples, TL positions) and a streamed chunk
``R``. Multiply-adds:

    ghost  = nL·nR·TL·TR·(in + out + 1)
    dense  = nL·TL·in·out (once per run; ignored here) + nR·TR·in·out + nL·nR·in·out

Ghost wins when sequences are short relative to the layer's width (roughly
T < in·out / (in+out) when both sides have T positions and the streamed side is
materialized once per example); dense wins for long sequences and many queries.
"""
from __future__ import annotations

from collections import Counter

from ..capture.factors import Factors, dense_flops, ghost_flops
from ..expr import GradNode, Node, Source

__all__ = ["choose_kernel", "shared_grad_nodes"]


def choose_kernel(L: Factors, R: Factors, mode: str = "auto") -> str:
    """"ghost" or "dense" for the inner products of two factored chunks."""
    if mode == "always":
        return "ghost"
    if mode == "never":
        return "dense"
    args = (L.n, R.n, L.T, R.T, L.in_features, L.out_features)
    return "ghost" if ghost_flops(*args) <= dense_flops(*args, left_ready=True) else "dense"


def shared_grad_nodes(root: Node, budget_bytes: int) -> set[str]:
    """Tokens of non-factored gradient nodes used more than once under ``root``, small enough to cache.

    Example: in ``P(Q) @ fisher(P(G)).inv() @ P(G).T`` the node ``P(G)`` feeds both the
    Fisher and the scores; caching its (n, k) rows saves a second pass over the data.
    """
    uses: Counter = Counter()

    def visit(node: Node):
        for child in node.children:
            uses[child.token] += 1
            if uses[child.token] == 1:
                visit(child)

    visit(root)
    keep = set()
    for node in root.walk():
        if not isinstance(node, GradNode) or uses[node.token] < 2:
            continue
        if isinstance(node, Source) or "factored" in node.representation.values():
            continue
        if node.n * node.space.dim * 4 <= budget_bytes:
            keep.add(node.token)
    return keep
