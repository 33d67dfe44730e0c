"""The Dask executor: the same physical plan, each pass over data split into shards
that run on Dask workers.

For every pass that reads a dataset, the examples are split into index ranges
(``shards``, default 2 per worker). The pass's jobs — with the state they need (held
rows already preconditioned, resolved operators of the row-wise chains, K-FAC bases)
— are scattered to every worker once per pass; that sends the model once per worker.
Each shard task runs the pass over its sub-dataset with a :class:`LocalExecutor` and
returns its jobs' partial states (``export``); the client absorbs them in shard order.
Score blocks are gathered to the client as each shard finishes: the result is a Dask
array whose blocks are the shards' score columns, wrapped in an ``xarray.DataArray`` by
``Scores.compute``; it outlives worker deaths and the executor.

A worker runs one shard at a time (its threads go to torch): the shards share the
worker's copy of the model, and capture hooks its modules.

Faults (:mod:`gradalg.exec.resilience`): a worker that dies is replaced by its nanny;
shards lost with it (or with the scattered payload, when every holder died) are
submitted again from the client; every shard is a pure function of its range, so the
result is the same. ``task_timeout`` names a stalled worker. Passes over rows in memory
run on the client.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import replace

import torch

from ..data import move_batch
from ..expr import ScoreNode, ScoreSum, Source
from ..plan.planner import chain_ops, stream_root
from .capture_pass import eval_mode, model_device_dtype
from .local import LocalExecutor
from .progress import in_notebook
from .resilience import PAYLOAD, FaultPolicy, run_tasks
from .shards import restrict, shard_ranges

__all__ = ["DaskExecutor"]


def _set_threads(n: int):
    torch.set_num_threads(n)
    return n


# One shard at a time per worker process: the shards of a pass share the worker's copy of
# the model (scattered once), and capture installs hooks on its modules; two shards
# running in two threads would each record the other's forwards (rows once per shard, or
# a backward that finds no activations). A worker's threads go to torch instead.
_SHARD_LOCK = threading.Lock()


def _run_shard(payload, start: int, stop: int):
    """On a worker: run one pass over examples start:stop; return the jobs' partial states."""
    with _SHARD_LOCK:
        return _run_shard_alone(payload, start, stop)


def _run_shard_alone(payload, start: int, stop: int):
    step, sinks, state, options, data_token = payload
    if state.get("threads"):
        torch.set_num_threads(state["threads"])   # per task: OpenMP settings are per thread
    ex = LocalExecutor(options)
    ex._ops, ex._kron, ex._cache = dict(state["ops"]), dict(state["kron"]), dict(state["cache"])
    ex._checked_tasks = set(state["checked"])   # the loss reduction was checked on the client
    jobs = [replace(job, streams=tuple(restrict(s, data_token, start, stop) for s in job.streams))
            for job in step.jobs]
    shard_step = replace(step, jobs=jobs)
    local_sinks = []
    for job, sink in zip(jobs, copy.deepcopy(sinks)):
        if job.kind == "group":
            sink.start = start
        local_sinks.append((job, sink))
    ex._feed(shard_step, local_sinks)
    return [sink.export() for _, sink in local_sinks], dict(ex.trace)


def _pick(result, index):
    block = result[0][index]
    return block.detach().cpu().numpy()


class DaskExecutor(LocalExecutor):
    """Runs plans on a Dask cluster.

    Parameters
    ----------
    client : an existing ``distributed.Client`` (default: a new ``LocalCluster`` of
        ``n_workers`` processes, closed by ``close()`` or at exit).
    n_workers : for the default local cluster.
    threads_per_worker : threads of each worker of the default local cluster, and torch
        threads of every shard. A worker runs one shard at a time, whatever its thread
        count: the shards it runs share its copy of the model, whose modules capture hooks.
    shards_per_worker : shards per worker for each pass over data.
    min_shard_examples : no shard gets fewer examples than this; a pass over fewer
        examples (the queries, typically) runs in this process, where shipping the
        model and the jobs to every worker would cost more than the pass.
    retries : Dask retries of a shard that raised.
    task_timeout : seconds a shard may run on its worker before the pass stops with a
        :class:`WorkerFaultError` naming that worker (None: no limit).
    resubmits, worker_wait : see :class:`gradalg.exec.resilience.FaultPolicy`: shards
        lost with their workers are submitted again from this process (any number of
        worker deaths is survived while the scheduler lives).
    """

    name = "dask"

    def __init__(self, client=None, *, n_workers: int = 2, threads_per_worker: int = 1,
                 shards_per_worker: int = 2, min_shard_examples: int = 32, retries: int = 3, options=None,
                 rewrites: bool = True, task_timeout: float | None = None, resubmits: int = 3,
                 worker_wait: float = 60.0, choices=None):
        super().__init__(options, rewrites=rewrites, choices=choices)
        from distributed import Client, LocalCluster

        self._own = client is None
        if client is None:
            cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker, processes=True,
                                   dashboard_address=":0")
            client = Client(cluster)
        self.client = client
        self.threads_per_worker = threads_per_worker
        self.client.run(_set_threads, threads_per_worker)
        self.shards_per_worker = shards_per_worker
        if min_shard_examples < 1:
            raise ValueError(f"min_shard_examples must be at least 1, got {min_shard_examples}")
        self.min_shard_examples = min_shard_examples
        self.retries = retries
        self.faults = FaultPolicy(retries, resubmits, task_timeout, worker_wait)

    def reset(self) -> None:
        """Forget earlier results (as :meth:`LocalExecutor.reset`), the gathered score blocks included."""
        super().reset()
        self._score_blocks: dict[str, list] = {}

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Shut down the cluster and client this executor started; one passed in is left running."""
        if self._own and self.client is not None:
            cluster = self.client.cluster
            self.client.close()
            cluster.close()
            self.client = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def n_workers(self) -> int:
        """Workers the scheduler knows now (at least 1)."""
        return max(1, len(self.client.scheduler_info().get("workers", {})))

    def describe_pass(self, step) -> str:
        """How a pass is distributed: shards, tasks and what crosses the network."""
        if not step.reads_data:
            return "runs on the client (rows already in memory)"
        sources = [stream_root(s) for j in step.jobs for s in j.streams if isinstance(stream_root(s), Source)]
        data = sources[0].data
        if data.n < self.min_shard_examples:
            return f"runs on the client ({data.n} examples, fewer than min_shard_examples={self.min_shard_examples})"
        shards = len(self._ranges(data.n))
        model_bytes = sum(p.numel() * p.element_size() for p in sources[0].task.model.parameters())
        back = sum(_state_bytes(job, data.n) for job in step.jobs)
        return (f"{shards} shard tasks over {self.n_workers} workers (~{data.n // max(shards, 1)} examples each); "
                f"scattered once per worker: the jobs, the model ({model_bytes / 2**20:.1f} MiB) and held rows "
                f"({step.fixed_bytes / 2**20:.1f} MiB); returned: partial states (~{back / 2**20:.1f} MiB in all)")

    # ------------------------------------------------------------------ passes
    def _run_pass(self, step) -> None:
        if not step.reads_data or not self._shippable(step):
            return super()._run_pass(step)
        sources = [stream_root(s) for j in step.jobs for s in j.streams if isinstance(stream_root(s), Source)]
        data = sources[0].data
        if data.n < self.min_shard_examples:
            return super()._run_pass(step)
        ranges = self._ranges(data.n)
        sinks = self._open_sinks(step.jobs, step)
        self._check_reduction_here(sources, data)
        state = self._state_for(step)
        payload = (step, [s for _, s in sinks], state, self.options, data.token)
        results = run_tasks(self.client, _run_shard, payload, [(PAYLOAD, a, b) for a, b in ranges],
                            policy=self.faults, labels=[f"examples {a}:{b}" for a, b in ranges],
                            progress=self.options.progress and in_notebook())
        score_jobs = {i for i, (job, _) in enumerate(sinks) if job.kind == "scores"}
        if score_jobs:
            self._lazy_scores(step, sinks, results, ranges, score_jobs)
        for states, trace in results:
            self.trace.update(trace)
            for i, (job, sink) in enumerate(sinks):
                if i not in score_jobs:
                    sink.absorb(states[i])
        for i, (job, sink) in enumerate(sinks):
            if i not in score_jobs:
                self._store(job, sink.finish())

    def _lazy_scores(self, step, sinks, results, ranges, score_jobs):
        import dask.array as da

        for i in score_jobs:
            job = sinks[i][0]
            # blocks gathered here (run_tasks): the result outlives worker deaths and the executor
            blocks = [da.from_array(_pick(result, i), chunks=-1) for result in results]
            array = da.concatenate(blocks, axis=1)
            self._score_blocks[job.key] = array.T if job.transposed else array

    def _ranges(self, n: int) -> list:
        """Shards of n examples: shards_per_worker per worker, none under min_shard_examples."""
        return shard_ranges(n, max(1, min(self.n_workers * self.shards_per_worker, n // self.min_shard_examples)))

    def _shippable(self, step) -> bool:
        """Passes whose row-wise chains need operators known only through products (which
        hold this process's executor) run here instead."""
        for job in step.jobs:
            for s in job.streams:
                for op in chain_ops(s):
                    if self.resolve(op).kind == "implicit":
                        return False
        return True

    def _state_for(self, step) -> dict:
        ops, cache, kron = {}, {}, {}
        for job in step.jobs:
            for s in job.streams:
                for op in chain_ops(s):
                    ops[op.token] = self.resolve(op)
                    for sub in op.walk():
                        if sub.token in self._ops:
                            ops[sub.token] = self._ops[sub.token]
            if job.kind == "ekfac":
                kron[job.target.token] = self._kron[job.target.token]
        return {"ops": ops, "cache": cache, "kron": kron, "checked": set(self._checked_tasks),
                "threads": self.threads_per_worker}

    def _check_reduction_here(self, sources, data) -> None:
        """Check each task's loss reduction once, on the client, instead of once per shard."""
        for src in sources:
            task = src.task
            if not self.options.check_reduction or src.objective != "loss" or task.token in self._checked_tasks:
                continue
            batch = next(iter(data.loader(min(self.options.batch_size, 8))))
            with eval_mode(task.model):
                task.check_reduction(move_batch(batch, model_device_dtype(task.model)[0]))
            self._checked_tasks.add(task.token)

    # ------------------------------------------------------------------ results
    def scores(self, node: ScoreNode):
        """The (n_left, n_right) score matrix of ``node``, every pass sharded over the workers."""
        p = self.run(self.plan(node))
        return self._combine(p.simplified)

    def _combine(self, node: ScoreNode):
        if isinstance(node, ScoreSum):
            return sum(c * self._combine(t) for c, t in zip(node.coefs, node.terms))
        key = f"scores:{node.token}"
        if key in self._score_blocks:
            return self._score_blocks[key]
        return self._results[key].detach().cpu().numpy()


def _state_bytes(job, n: int) -> float:
    """Rough size of what a job's shards send back, summed over shards."""
    if job.kind == "scores":
        return 8.0 * job.held.n * n
    if job.kind in ("collect", "store", "group"):
        return 4.0 * job.target.n * job.target.space.dim
    if job.kind == "fisher":
        d = job.target.space.dim
        return 8.0 * d * d
    if job.kind in ("kfac", "ekfac"):
        return 8.0 * sum(b.shape[0] ** 2 + b.shape[-1] ** 2 for b in job.target.space.blocks)
    return 8.0 * n
