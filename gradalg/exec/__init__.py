"""Executors: run expression nodes (plan, run the passes with a shard strategy, assemble)."""
from .base import Executor, get_executor
from .distributed import RankShards, TorchDistributed
from .clusters import gpu_cluster, pinned_worker_specs, visible_gpus
from .local import LocalExecutor
from .models import WorkerModel
from .runner import InProcess, ShardStrategy

__all__ = ["Executor", "get_executor", "LocalExecutor", "DaskExecutor", "TorchDistributed", "WorkerModel",
           "ShardStrategy", "InProcess", "DaskShards", "RankShards", "gpu_cluster", "pinned_worker_specs",
           "visible_gpus"]


def __getattr__(name):  # the Dask executor imports dask only when asked for
    if name in ("DaskExecutor", "DaskShards"):
        from . import dask
        return getattr(dask, name)
    raise AttributeError(name)
