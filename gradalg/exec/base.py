"""The executor interface and the registry of executors.

An executor runs expression nodes. Required entry points:

``scores(node)``     (n_query, n_train) scores of a score node
``diagonal(node)``   self-scores of a :class:`~gradalg.expr.ScoreDiagonal`
``gradients(node)``  all rows of a gradient node (a Chunk)
``operator(node)``   the resolved numbers of an operator node

Optional: ``plan(node)`` (the plan it would run), ``topk(node, spec)`` (the best scores
per query, from ``plan(node, topk=spec)``) and ``close()``. Executors are picked
by object or by name (``get_executor("local")``, ``get_executor("dask")``); a missing
optional dependency is reported with the command that installs it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["Executor", "get_executor", "EXECUTORS"]


class Executor(ABC):
    """Runs expression nodes: the interface every executor implements.

    ``S.compute(executor=...)`` hands its node to :meth:`scores`; the other entry points
    serve self-scores (:meth:`diagonal`), gradient rows and resolved operators. Subclasses:
    :class:`~gradalg.exec.LocalExecutor` (this process) and
    :class:`~gradalg.exec.DaskExecutor` (passes sharded over Dask workers)."""
    name: str = "executor"

    @abstractmethod
    def scores(self, node):
        """(n_left, n_right) scores of ``node``."""

    @abstractmethod
    def diagonal(self, node):
        """Self-scores (n,) of a ScoreDiagonal node."""

    @abstractmethod
    def gradients(self, node):
        """All rows of a gradient node."""

    @abstractmethod
    def operator(self, node):
        """Resolved numbers of an operator node."""

    def topk(self, node, spec):
        """The ``spec.k`` best scores per query of the score node ``node`` and their training
        positions, ``(values, positions)`` each (n_query, k), by one top-k plan
        (:class:`~gradalg.plan.jobs.TopKJob`); for executors with ``plan``, ``run`` and ``state``."""
        p = self.run(self.plan(node, topk=spec))
        return self.state.results[("topk", p.simplified.token)]

    def close(self) -> None:
        """Release resources (clusters, files)."""


def _local(**kwargs):
    from .local import LocalExecutor
    return LocalExecutor(**kwargs)


def _dask(**kwargs):
    try:
        import distributed  # noqa: F401
    except ImportError as err:
        raise ImportError("the Dask executor needs dask.distributed: pip install 'gradalg[dask]'") from err
    from .dask import DaskExecutor
    return DaskExecutor(**kwargs)


def _torch_distributed(**kwargs):
    from .distributed import TorchDistributed
    return TorchDistributed(**kwargs)


EXECUTORS = {"local": _local, "dask": _dask, "torch_distributed": _torch_distributed}


def get_executor(executor=None, **kwargs) -> Executor:
    """An executor from a name ("local", "dask", "torch_distributed"), an Executor, or None (local)."""
    if executor is None:
        return _local(**kwargs)
    if isinstance(executor, str):
        if executor not in EXECUTORS:
            raise ValueError(f"unknown executor {executor!r}; choose one of {sorted(EXECUTORS)}")
        return EXECUTORS[executor](**kwargs)
    return executor
