"""Executors: run expression nodes."""
from .base import Executor, get_executor
from .distributed import TorchDistributed
from .clusters import gpu_cluster, pinned_worker_specs, visible_gpus
from .local import LocalExecutor
from .models import WorkerModel

__all__ = ["Executor", "get_executor", "LocalExecutor", "DaskExecutor", "TorchDistributed", "WorkerModel",
           "gpu_cluster", "pinned_worker_specs", "visible_gpus"]


def __getattr__(name):  # the Dask executor imports dask only when asked for
    if name == "DaskExecutor":
        from .dask import DaskExecutor
        return DaskExecutor
    raise AttributeError(name)
