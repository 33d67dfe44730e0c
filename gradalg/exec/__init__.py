"""Executors: run expression nodes."""
from .base import Executor, get_executor
from .distributed import TorchDistributed
from .local import LocalExecutor
from .operators import ResolvedOp

__all__ = ["Executor", "get_executor", "LocalExecutor", "DaskExecutor", "TorchDistributed", "ResolvedOp"]


def __getattr__(name):  # the Dask executor imports dask only when asked for
    if name == "DaskExecutor":
        from .dask import DaskExecutor
        return DaskExecutor
    raise AttributeError(name)
