"""A local Dask cluster with one worker per GPU.

Each worker process sees one GPU, so the model a worker builds
(:class:`~gradalg.exec.WorkerModel`, ``device="auto"``) lands on that GPU as its
``cuda:0``, and the shards it runs never share a device with another worker's:

* with ``dask_cuda`` installed, its ``LocalCUDACluster`` (it also sets the worker's
  memory limits and CPU affinity per GPU);
* without it, a ``SpecCluster`` of one nanny per visible GPU, each starting its worker
  with ``CUDA_VISIBLE_DEVICES`` pinned to that GPU alone (:func:`pinned_worker_specs`);
* without GPUs, a ``LocalCluster`` of ``n_cpu_workers`` processes.

Example::

    from distributed import Client
    cluster = ga.exec.gpu_cluster()                      # one worker per visible GPU
    with ga.exec.DaskExecutor(Client(cluster), model_fn=spec) as dx:
        scores = S.compute(executor=dx)
    cluster.close()
"""
from __future__ import annotations

import importlib.util
import os

from ..errors import OptionError

__all__ = ["visible_gpus", "pinned_worker_specs", "gpu_cluster"]


def visible_gpus() -> list[str]:
    """The GPUs this process may give to workers: the entries of ``CUDA_VISIBLE_DEVICES``
    when it is set (ids or UUIDs, as written), else ``0 … torch.cuda.device_count() - 1``."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def pinned_worker_specs(devices, *, threads_per_worker: int = 1, memory_limit="auto") -> dict:
    """``SpecCluster`` worker specs: one nanny per device, its worker started with
    ``CUDA_VISIBLE_DEVICES`` set to that device alone (and ``OMP_NUM_THREADS`` to
    ``threads_per_worker``). Names are ``gpu-<device>``."""
    from distributed import Nanny

    devices = [str(d) for d in devices]
    if len(set(devices)) != len(devices):
        raise OptionError(f"devices must be distinct, got {devices}")
    return {f"gpu-{device}": {"cls": Nanny, "options": {
        "nthreads": threads_per_worker, "memory_limit": memory_limit,
        "env": {"CUDA_VISIBLE_DEVICES": device, "OMP_NUM_THREADS": str(threads_per_worker)}}} for device in devices}


def gpu_cluster(devices=None, *, threads_per_worker: int = 1, n_cpu_workers: int = 2,
                use_dask_cuda: bool | None = None, dashboard_address: str = ":0"):
    """A local cluster with one worker per GPU (module docstring); close it when done.

    devices : the GPUs to use (default :func:`visible_gpus`); empty: a CPU cluster of
        ``n_cpu_workers`` processes.
    use_dask_cuda : None (default): ``LocalCUDACluster`` when ``dask_cuda`` imports; False:
        the pinned ``SpecCluster`` even when it does.
    """
    from distributed import LocalCluster, Scheduler, SpecCluster

    devices = visible_gpus() if devices is None else [str(d) for d in devices]
    if not devices:
        return LocalCluster(n_workers=n_cpu_workers, threads_per_worker=threads_per_worker, processes=True,
                            dashboard_address=dashboard_address)
    if use_dask_cuda or (use_dask_cuda is None and importlib.util.find_spec("dask_cuda") is not None):
        from dask_cuda import LocalCUDACluster
        return LocalCUDACluster(CUDA_VISIBLE_DEVICES=",".join(devices), threads_per_worker=threads_per_worker,
                                dashboard_address=dashboard_address)
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": dashboard_address}}
    return SpecCluster(workers=pinned_worker_specs(devices, threads_per_worker=threads_per_worker),
                       scheduler=scheduler)
