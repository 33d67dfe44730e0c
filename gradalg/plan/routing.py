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

from ..capture.factors import Factors, dense_flops, ghost_flops

__all__ = ["choose_kernel"]


def choose_kernel(L: Factors, R: Factors, mode: str = "auto") -> str:
    """"ghost" or "dense" for the inner products of two factored chunks."""
    if mode == "always":
        return "ghost"
    if mode == "never":
        return "dense"
    args = (L.n, R.n, L.T, R.T, L.in_features, L.out_features)
    return "ghost" if ghost_flops(*args) <= dense_flops(*args, left_ready=True) else "dense"
