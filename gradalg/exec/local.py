"""The local executor: runs a physical plan with PyTorch on the model's device, every
pass whole in this process.

A plan (:mod:`gradalg.plan.planner`) is a list of passes. Each pass reads one dataset
(or rows kept in memory) once, batch by batch; every batch is captured once per
source and fed to all the jobs of the pass — curvature statistics, collections of
held or stored rows, and scores against a held side that was preconditioned before
the pass started. Per-example training gradients exist one batch at a time. The
compute path (plan, run, assemble) is :class:`~gradalg.exec.base.Executor`'s; this
executor's shard strategy is :class:`~gradalg.exec.runner.InProcess`.

Per block, the inner product of a batch with the held side uses the kernel the plan
chose (``ghost``: ⟨D_iᵀA_i, D_jᵀA_j⟩ = Σ_{t,s}(a_it·a_js)(d_it·d_js) from the factors;
``dense``: materialize, then one GEMM); ``executor.trace`` counts which ran.
"""
from __future__ import annotations

from .base import Executor

__all__ = ["LocalExecutor"]


class LocalExecutor(Executor):
    """Runs expression nodes with PyTorch in this process (:class:`~gradalg.exec.base.Executor`
    with the in-process shard strategy; parameters and ``name`` there)."""
