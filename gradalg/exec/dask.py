"""The Dask executor: the same physical plan, each pass over data split into shards
that run on Dask workers.

Composition, not inheritance: a ``DaskExecutor`` holds a :class:`LocalExecutor` (the
plan, the pass runner, the run state, the pull path) and is that executor's *shard
strategy* (``run_shards``, :mod:`gradalg.exec.runner`). For every pass that reads a
dataset, the examples are split into index ranges (``shards``, default 2 per worker).
The pass's sinks — with the state they need (held rows already preconditioned,
resolved operators of the row-wise chains, K-FAC bases) — are scattered to every
worker once per pass; that sends the model once per worker. Each shard task feeds its
sub-dataset to the sinks with a worker-side :class:`LocalExecutor` built from that
state (``LocalExecutor(options, state=RunState(...))``) and returns the sinks' partial
states (``export``); the client absorbs them in shard order.
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
from ..expr import Source
from ..plan.jobs import ScoresJob
from ..plan.planner import chain_ops, stream_root
from .base import Executor
from .capture_pass import eval_mode, model_device_dtype
from .local import LocalExecutor
from .progress import in_notebook, progress_bar
from .resilience import PAYLOAD, FaultPolicy, run_tasks
from .shards import restrict, shard_ranges
from .state import RunState

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
    step, sinks, state, options, data_token, threads = payload
    if threads:
        torch.set_num_threads(threads)   # per task: OpenMP settings are per thread
    # the loss reduction was checked on the client (state.checked)
    ex = LocalExecutor(options, state=RunState(ops=dict(state.ops), kron=dict(state.kron),
                                               checked=set(state.checked)))
    jobs = [replace(job, streams=tuple(restrict(s, data_token, start, stop) for s in job.streams))
            for job in step.jobs]
    shard_step = replace(step, jobs=jobs)
    shard_sinks = copy.deepcopy(sinks)
    for job, sink in zip(jobs, shard_sinks):
        sink.job = job
        sink.for_shard(start)
    ex.runner.feed(shard_step, shard_sinks)
    return [sink.export() for sink in shard_sinks], dict(ex.trace)


def _pick(result, index):
    block = result[0][index]
    return block.detach().cpu().numpy()


class DaskExecutor(Executor):
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
        from distributed import Client, LocalCluster

        # the plan, the pass runner, the run state and the pull path; passes' shards run here
        self.local = LocalExecutor(options, rewrites=rewrites, choices=choices, shards=self)

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

    # ------------------------------------------------------------------ the composed executor
    @property
    def options(self):
        """The composed LocalExecutor's ``ga.options`` (settable)."""
        return self.local.options

    @options.setter
    def options(self, value):
        self.local.options = value

    @property
    def rewrites(self) -> bool:
        """Whether the planner's rewrite rules run (settable)."""
        return self.local.rewrites

    @rewrites.setter
    def rewrites(self, value):
        self.local.rewrites = value

    @property
    def choices(self):
        """Forced planner decisions, :class:`~gradalg.plan.Choices` (settable)."""
        return self.local.choices

    @choices.setter
    def choices(self, value):
        self.local.choices = value

    @property
    def trace(self):
        """Counts of the kernels that ran (tests use it to prove routing)."""
        return self.local.trace

    @property
    def state(self) -> RunState:
        """What the run keeps: rows, resolved operators, K-FAC bases, results."""
        return self.local.state

    @property
    def last_plan(self):
        """The plan that ran last."""
        return self.local.last_plan

    @property
    def pass_stats(self) -> list:
        """Measured seconds and memory of each pass of the last run."""
        return self.local.pass_stats

    def reset(self) -> None:
        """Forget every resolved operator, kept row and result (``LocalExecutor.reset``)."""
        self.local.reset()

    def plan(self, node, topk=None):
        """The plan for ``node`` (as :meth:`LocalExecutor.plan`); a top-k job's shards
        return their own top-k, merged here in shard order."""
        return self.local.plan(node, topk=topk)

    def run(self, p):
        """Run plan ``p``: each pass over data sharded over the workers."""
        return self.local.run(p)

    def resolve(self, node):
        """The resolved operator of ``node`` (:class:`~gradalg.linalg.LinearOp`), memoized."""
        return self.local.resolve(node)

    def iter_chunks(self, node):
        """The rows of ``node`` chunk by chunk, on the client (pull path)."""
        return self.local.iter_chunks(node)

    def gradients(self, node):
        return self.local.gradients(node)

    def operator(self, node):
        return self.local.operator(node)

    def diagonal(self, node):
        return self.local.diagonal(node)

    def scores(self, node):
        """Scores of ``node``: a Dask array of the shards' blocks where a pass ran on the
        cluster, NumPy where it ran here."""
        p = self.local.run(self.local.plan(node))
        return self.local.state.scores(p.simplified, as_array=_as_array)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
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
        back = sum(job.output_bytes(data.n) for job in step.jobs)
        return (f"{shards} shard tasks over {self.n_workers} workers (~{data.n // max(shards, 1)} examples each); "
                f"scattered once per worker: the jobs, the model ({model_bytes / 2**20:.1f} MiB) and held rows "
                f"({step.fixed_bytes / 2**20:.1f} MiB); returned: partial states (~{back / 2**20:.1f} MiB in all)")

    # ------------------------------------------------------------------ passes
    def run_shards(self, runner, step, sinks) -> dict:
        """Run one pass: on the cluster, a shard per example range, the sinks absorbing the
        shards' partial states in order; here (``runner.feed``) when the pass reads rows in
        memory, too few examples, or needs operators this process holds. Returns the score
        results, by sink index: Dask arrays of the blocks gathered from the shards."""
        if not step.reads_data or not self._shippable(step):
            runner.feed(step, sinks)
            return {}
        sources = [stream_root(s) for j in step.jobs for s in j.streams if isinstance(stream_root(s), Source)]
        data = sources[0].data
        if data.n < self.min_shard_examples:
            runner.feed(step, sinks)
            return {}
        ranges = self._ranges(data.n)
        self._check_reduction_here(sources, data)
        payload = (step, sinks, self._state_for(step), self.options, data.token, self.threads_per_worker)
        widget = bool(self.options.progress) and in_notebook()   # Dask's own progress widget
        with progress_bar(self.options.progress if not widget else False, data.n,
                          f"{step.label} ({len(ranges)} shards)", interval=self.options.progress_interval) as bar:
            results = run_tasks(self.client, _run_shard, payload, [(PAYLOAD, a, b) for a, b in ranges],
                                policy=self.faults, labels=[f"examples {a}:{b}" for a, b in ranges],
                                progress=widget, on_result=lambda i: bar.update(ranges[i][1] - ranges[i][0]))
        scores = {i for i, sink in enumerate(sinks) if isinstance(sink.job, ScoresJob)}
        for states, trace in results:
            self.trace.update(trace)
            for i, sink in enumerate(sinks):
                if i not in scores:
                    sink.absorb(states[i])
        return {i: _lazy_scores(results, i) for i in scores}

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

    def _state_for(self, step) -> RunState:
        """The part of the run state a shard of ``step`` needs: the resolved operators of its
        row-wise chains (the sinks carry their held rows and bases)."""
        ops, done = {}, self.state.ops
        for job in step.jobs:
            for s in job.streams:
                for op in chain_ops(s):
                    ops[op.token] = self.resolve(op)
                    for sub in op.walk():
                        if sub.token in done:
                            ops[sub.token] = done[sub.token]
        return RunState(ops=ops, checked=set(self.state.checked))

    def _check_reduction_here(self, sources, data) -> None:
        """Check each task's loss reduction once, on the client, instead of once per shard."""
        for src in sources:
            task = src.task
            if not self.options.check_reduction or src.objective != "loss" or task.token in self.state.checked:
                continue
            batch = next(iter(data.loader(min(self.options.batch_size, 8))))
            with eval_mode(task.model):
                task.check_reduction(move_batch(batch, model_device_dtype(task.model)[0]))
            self.state.checked.add(task.token)


def _lazy_scores(results, index):
    """A Dask array of one score job's columns, a block per shard (gathered already: the
    result outlives worker deaths and the executor)."""
    import dask.array as da

    return da.concatenate([da.from_array(_pick(result, index), chunks=-1) for result in results], axis=1)


def _as_array(result):
    """A score term as the Dask executor returns it: Dask arrays as they are, tensors as NumPy."""
    return result.detach().cpu().numpy() if isinstance(result, torch.Tensor) else result
