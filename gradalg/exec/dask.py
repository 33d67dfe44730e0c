"""The Dask executor: the same physical plan, each pass over data split into shards
that run on Dask workers.

A ``DaskExecutor`` is the one :class:`~gradalg.exec.base.Executor` (plan, run, assemble;
the run state stays in this process; windows of rows are plans like any other) with
:class:`DaskShards` as its shard strategy (:mod:`gradalg.exec.runner`). For every pass the plan places on the
workers, the examples are split into index ranges: as many as the plan's ``SHARDS``
decision says (:meth:`DaskShards.split`: default 2 per worker, ``ga.options(dask_shards=k)``
to force k).
The pass's jobs and their accumulators — with the state they need (held rows already preconditioned,
resolved operators of the row-wise chains, K-FAC bases) — are pickled once per pass
(:func:`gradalg.exec.models.pack`) and scattered to every worker; each shard loads its
own copy. The model travels inside, once per worker; or, with ``model_fn``
(:class:`~gradalg.exec.WorkerModel`), as a reference that each worker resolves to the
model it built once and checked against the client's fingerprint (a client holding the
model on the ``meta`` device sends every pass over data to the workers). Each shard
task feeds its sub-dataset to the jobs with a worker-side executor built from that
state (``Executor(options, state=RunState(...))``) and returns the accumulators'
partial states (``export``), pickled with the worker's model named by its key; the
client absorbs them in shard order.
Score blocks are gathered to the client as each shard finishes: the result is a Dask
array whose blocks are the shards' score columns, wrapped in an ``xarray.DataArray`` by
``Scores.compute``; it outlives worker deaths and the executor.

A worker runs one shard at a time (its threads go to torch): the shards share the
worker's copy of the model, and capture hooks its modules.

Faults (:mod:`gradalg.exec.resilience`): a worker that dies is replaced by its nanny;
shards lost with it (or with the scattered payload, when every holder died) are
submitted again from the client; every shard is a pure function of its range, so the
result is the same. ``task_timeout`` names a stalled worker.

Where each pass runs is decided when the plan is made (:meth:`DaskShards.place`, shown by
``explain()``): on the client when it is a products pass (called by its solver there, one
pass per iteration), reads rows in memory, reads fewer than
``min_shard_examples`` examples while the client holds the model's weights, or needs
operators known only through products of the client's model (their structure labels say
``implicit``, :mod:`gradalg.linalg.labels`); on the workers otherwise (refused, by the
placement, for a model sharded across torch.distributed ranks).
"""
from __future__ import annotations

import threading
import weakref

import torch

from ..errors import DistributedError, ModelMismatchError, OperatorError, OptionError
from .base import Executor
from ..capture.wrappers import is_sharded
from .models import (as_worker_model, is_meta_model, make_ref, pack, register_client_model, to_client,
                     to_workers, unpack, worker_models_seen)
from .progress import in_notebook, progress_bar
from .resilience import PAYLOAD, FaultPolicy, run_tasks
from ..plan.placement import Placement
from ..proj import clear_caches as clear_projection_caches
from .runner import PassRunner, ShardStrategy, check_reductions
from .shards import shard_ranges
from .state import RunState
from ..units import format_bytes_alike

__all__ = ["DaskExecutor", "DaskShards"]


# One shard at a time per worker process: the shards of a pass share the worker's copy of
# the model (scattered once), and capture installs hooks on its modules; two shards
# running in two threads would each record the other's forwards (rows once per shard, or
# a backward that finds no activations). A worker's threads go to torch instead.
_SHARD_LOCK = threading.Lock()


def _run_shard(blob: bytes, start: int, stop: int) -> bytes:
    """On a worker, one shard at a time (:data:`_SHARD_LOCK`): run one pass over examples
    start:stop; return the jobs' partial states, packed (:func:`gradalg.exec.models.pack`).
    Each shard loads its own copy of the jobs and their accumulators; a model made by a factory resolves
    to the one this worker built (once), a pickled model is loaded with them."""
    from distributed import get_worker

    with _SHARD_LOCK:
        step, accs, state, options, data_token, threads, keys = unpack(blob)
        if threads:
            torch.set_num_threads(threads)   # per task: OpenMP settings are per thread
        # the loss reduction was checked on the client (state.checked)
        ex = Executor(options, state=RunState(ops=dict(state.ops), kron=dict(state.kron),
                                              checked=set(state.checked)))
        try:
            parts = PassRunner(ex, ex.shards).feed_shard(step, data_token, start, stop, accs)
        finally:
            clear_projection_caches()    # a long-lived worker keeps no plan's matrices after its shard
        seen, worker = worker_models_seen(), get_worker().address
        digests = {key: (seen[key], worker) for key in keys if key in seen}
        # rows returned (Chunk objects name their task) name the model by its key, not its weights
        back = [to_client(model, key) for model, key in zip(step.models(), keys)]
        return pack((parts, dict(ex.trace), digests), back, to_cpu=True)


class DaskShards(ShardStrategy):
    """The Dask shard strategy: each pass the plan places on the cluster is split into
    example ranges run as tasks on the workers, their partial states absorbed in shard
    order; parameters as :class:`DaskExecutor`'s.

    Attributes: ``client``, ``transfers`` (one dict per pass run on the cluster:
    ``{"pass": label, "payload_bytes": bytes scattered to each worker, "result_bytes":
    [bytes each shard task returned]}``), and the settings below."""

    keeps_held_rows = True
    here, spread = "on the client", "on the workers"

    def ways(self) -> int:
        return self.n_workers

    def __init__(self, client=None, *, n_workers: int = 2, threads_per_worker: int = 1,
                 shards_per_worker: int = 2, min_shard_examples: int = 32, retries: int = 3,
                 task_timeout: float | None = None, resubmits: int = 3, worker_wait: float = 60.0, model_fn=None):
        from distributed import Client

        if min_shard_examples < 1:
            raise OptionError(f"min_shard_examples must be at least 1, got {min_shard_examples}")
        self._own = client is None      # a client made here starts a LocalCluster, and closes it with itself
        self.client = client if client is not None else Client(
            n_workers=n_workers, threads_per_worker=threads_per_worker, processes=True, dashboard_address=":0")
        self.threads_per_worker = threads_per_worker
        self.client.run(torch.set_num_threads, threads_per_worker)
        self.shards_per_worker = shards_per_worker
        self.min_shard_examples = min_shard_examples
        self.retries = retries
        self.faults = FaultPolicy(retries, resubmits, task_timeout, worker_wait)
        several = isinstance(model_fn, dict)     # {client model: factory}, else one factory (or None)
        self._factories = {id(m): (m, as_worker_model(f)) for m, f in model_fn.items()} if several else {}
        self._model_fn = as_worker_model(model_fn) if model_fn is not None and not several else None
        self._bound = None                                # the client model a single model_fn stands for
        self._digests: dict[str, tuple[str, str]] = {}   # factory key -> (weights digest, first worker)
        self.transfers: list[dict] = []

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the cluster this strategy started (a client given to it stays open)."""
        if self._own and self.client is not None:
            self.client.close()
            self.client = None

    @property
    def n_workers(self) -> int:
        """Workers the scheduler knows now (at least 1)."""
        return max(1, len(self.client.scheduler_info().get("workers", {})))

    def as_array(self, result):
        """A score term as the Dask executor returns it: Dask arrays as they are, tensors as NumPy."""
        return result.detach().cpu().numpy() if isinstance(result, torch.Tensor) else result

    # ------------------------------------------------------------------ where a pass runs
    def place_data(self, step) -> Placement:
        """On the client: passes whose row-wise chains need operators known only through
        products of the client's model, and passes over fewer than ``min_shard_examples``
        examples when the client holds the weights; on the workers, every other pass over
        data (:meth:`ShardStrategy.place`: products passes and passes over rows in memory
        run on the client), refused there for a model sharded across torch.distributed
        ranks (the placement's refusal, raised when the pass would run)."""
        if _needs_products(step):
            what = "operators known only through products of this process's model (an iterative solver)"
            return Placement(False, f"needs {what}", self.refuse_here(step, what))
        n, models = step.sources()[0].data.n, step.models()
        if n < self.min_shard_examples and not any(is_meta_model(m) for m in models):
            return Placement(False, f"{n} examples, fewer than min_shard_examples={self.min_shard_examples}")
        return Placement(True, "on the workers", _sharded_refusal(step, models), *self.split(n))

    def split(self, n: int) -> tuple[int, tuple]:
        """The shard tasks of a pass over ``n`` examples, decided with its placement (the
        plan's ``SHARDS`` decision), and the counts weighed: ``ga.options(dask_shards=k)``
        when set, else ``shards_per_worker`` per worker known now, none under
        ``min_shard_examples``; at most one per example."""
        forced, workers = self.options.dask_shards, self.n_workers * self.shards_per_worker
        by_size = n // self.min_shard_examples
        count = min(n, forced if forced is not None else max(1, min(workers, by_size)))
        return count, (("shards_per_worker × workers", f"{self.shards_per_worker} × {self.n_workers} = {workers}"),
                       ("examples ÷ min_shard_examples", f"{n} ÷ {self.min_shard_examples} = {by_size}"),
                       ("ga.options(dask_shards=...)", "unset" if forced is None else str(forced)))

    def refuse_here(self, step, what: str) -> Exception | None:
        """Work that needs this process's model, refused when the client holds it on the
        meta device."""
        if not any(is_meta_model(m) for m in step.models()):
            return None
        return ModelMismatchError(
            f"{step.label} needs {what} in this process, which holds the model on the meta device: use a "
            "curvature with a closed form (K-FAC, EK-FAC, a Fisher in projected space), or hold the weights here")

    def describe_shards(self, step, where, n: int, result_bytes: float) -> str:
        """The shard tasks of a pass over ``n`` examples (as the plan placed it: ``where``)
        and what crosses the network."""
        models, shards = step.models(), where.shards
        sizes = [sum(p.numel() * p.element_size() for p in model.parameters()) for model in models]
        *sizes, held, returned = format_bytes_alike(*sizes, step.fixed_bytes, result_bytes)
        factories = [self._factory_of(model, len(models), describe=True) for model in models]
        sent = [f"the model ({size})" if factory is None else
                f"a reference to the model ({size} built once per worker by {factory!r})"
                for factory, size in zip(factories, sizes)]
        return (f"{shards} shard tasks over {self.n_workers} workers (~{n // max(shards, 1)} examples each); "
                f"scattered once per worker: the jobs, {', '.join(sent)} and held rows "
                f"({held}); returned: partial states (~{returned} in all)")

    # ------------------------------------------------------------------ a pass on the cluster
    def run_shards(self, runner, step, accs) -> dict:
        """Run one pass on the cluster, a shard per example range, the jobs' accumulators
        ``accs`` absorbing the shards' partial states in order. The shard tasks run through
        :func:`~gradalg.exec.resilience.run_tasks`, with a progress display. Returns the score
        results, by job index: Dask arrays of the blocks gathered from the shards."""
        ctx, models = runner.ctx, step.models()
        data = step.sources()[0].data
        ranges = shard_ranges(data.n, runner.where.shards)    # the plan's SHARDS decision
        check_reductions(ctx, step)
        refs = self._refs(models)
        keys = [r.key if r is not None else f"pickled-{id(m)}" for m, r in zip(models, refs)]
        for model, key in zip(models, keys):
            register_client_model(key, model)
        payload = (step, accs, _state_for(ctx, step), ctx.options, data.token, self.threads_per_worker, keys)
        blob = pack(payload, [to_workers(m, r) for m, r in zip(models, refs) if r is not None])
        widget = bool(ctx.options.progress) and in_notebook()   # Dask's own progress widget
        with progress_bar(ctx.options.progress if not widget else False, data.n,
                          f"{step.label} ({len(ranges)} shards)", interval=ctx.options.progress_interval) as bar:
            packed = run_tasks(self.client, _run_shard, blob, [(PAYLOAD, a, b) for a, b in ranges],
                               policy=self.faults, labels=[f"examples {a}:{b}" for a, b in ranges],
                               progress=widget, on_result=lambda i: bar.update(ranges[i][1] - ranges[i][0]))
        self.transfers.append({"pass": step.label, "payload_bytes": len(blob),
                               "result_bytes": [len(b) for b in packed]})
        results = [unpack(b) for b in packed]
        self._check_workers_agree(refs, results)
        scores = {i for i, job in enumerate(step.jobs) if job.shards_are_blocks}   # kept as column blocks
        for states, trace, _ in results:
            ctx.trace.update(trace)
            for i, acc in enumerate(accs):
                if i not in scores:
                    acc.absorb(states[i])
        return {i: _lazy_scores(results, i) for i in scores}

    def _factory_of(self, model, n_models: int, describe: bool = False):
        """The factory of the client's ``model`` (None: pickled). A single ``model_fn`` is
        bound to the first model a pass reads; another model is refused (``describe``: for
        the plan's text, nothing bound and None for a model the pass would refuse)."""
        if id(model) in self._factories:
            return self._factories[id(model)][1]
        if self._model_fn is None:
            return None
        bound = self._bound() if self._bound is not None else None
        if n_models > 1 or (bound is not None and bound is not model):
            if describe:
                return None
            raise OptionError(
                f"model_fn gives one model, and {'this pass reads' if n_models > 1 else 'this executor has run'} "
                f"another ({type(model).__name__}): pass a dict model_fn={{client_model: factory, ...}} naming "
                "each model the workers should build, or use a new executor for a new model")
        if not describe:
            self._bound = weakref.ref(model)
        return self._model_fn

    def _refs(self, models) -> list:
        """What each model of a pass travels as: a :class:`ModelRef` (built on the workers)
        or None (pickled with the pass)."""
        refs = []
        for i, model in enumerate(models):
            factory = self._factory_of(model, len(models))
            if factory is None and is_meta_model(model):
                raise ModelMismatchError(
                    f"model {i} of this pass ({type(model).__name__}) is on the meta device (no weights) and has "
                    "no factory: pass DaskExecutor(model_fn=...) so that the workers build or load it")
            refs.append(make_ref(model, factory, type(model).__name__) if factory is not None else None)
        return refs

    def _check_workers_agree(self, refs, results) -> None:
        """Models whose weights the client cannot check (meta device, no declared
        fingerprint): every worker must have built the same weights."""
        for _, _, digests in results:
            for key, (digest, worker) in digests.items():
                first = self._digests.setdefault(key, (digest, worker))
                if first[0] != digest:
                    ref = next(r for r in refs if r is not None and r.key == key)
                    raise ModelMismatchError(
                        f"workers built different weights from {ref.factory!r}: {first[1]} has fingerprint "
                        f"{first[0]}, {worker} has {digest}. Make the factory deterministic (seed its "
                        "initialization, or load a checkpoint), and declare the expected weights with "
                        "WorkerModel(..., fingerprint=...)")



class DaskExecutor(DaskShards, Executor):
    """Runs plans on a Dask cluster: the :class:`~gradalg.exec.base.Executor` with the
    :class:`DaskShards` strategy (its members are the executor's: ``dx.client``, ``dx.transfers``).

    Parameters
    ----------
    client : an existing ``distributed.Client`` (default: a new ``LocalCluster`` of
        ``n_workers`` processes, closed by ``close()`` or at exit).
    n_workers : for the default local cluster.
    threads_per_worker : threads of each worker of the default local cluster, and torch
        threads of every shard. A worker runs one shard at a time, whatever its thread
        count: the shards it runs share its copy of the model, whose modules capture hooks.
    shards_per_worker : shards per worker for each pass over data (decided when the plan
        is made: its ``SHARDS`` decisions; ``ga.options(dask_shards=k)`` forces k).
    min_shard_examples : no shard gets fewer examples than this; a pass over fewer
        examples (the queries, typically) runs in this process, where shipping the
        model and the jobs to every worker would cost more than the pass.
    retries : Dask retries of a shard that raised.
    task_timeout : seconds a shard may run on its worker before the pass stops with a
        :class:`WorkerFaultError` naming that worker (None: no limit).
    resubmits, worker_wait : see :class:`gradalg.exec.resilience.FaultPolicy`: shards
        lost with their workers are submitted again from this process (any number of
        worker deaths is survived while the scheduler lives).
    model_fn : how the workers make the model instead of receiving it pickled (the only
        way for a model that does not fit a pickle: 7B+ parameters). A
        :class:`~gradalg.exec.WorkerModel`, a callable returning the model, an import
        path ``"pkg.module:build"``, or a Hugging Face checkpoint directory; or a dict
        ``{client_model: any of these}`` when passes read several models. Each worker
        builds the model once (cached by the factory's fingerprint), places it on its
        device, and checks its architecture and weights against the client's model
        (:class:`~gradalg.errors.ModelMismatchError` when they differ). The client's
        model may be on the ``meta`` device (``WorkerModel.meta()``): planning reads
        shapes only, and every pass over data, however small, runs on the workers.
        Models without a factory are pickled to the workers with the pass.

    Attributes
    ----------
    transfers : list of dict, one per pass run on the cluster since the executor was
        made: ``{"pass": label, "payload_bytes": bytes scattered to each worker,
        "result_bytes": [bytes each shard task returned]}``.

    Example::

        spec = ga.exec.WorkerModel("mypkg.models:build", seed=0)
        task = ga.tasks.classification(spec.meta())      # no weights on the client
        with ga.exec.DaskExecutor(client, model_fn=spec) as dx:
            scores = ga.methods.grad_dot(task, train, queries).compute(executor=dx)
        dx.transfers[-1]   # {"pass": ..., "payload_bytes": ..., "result_bytes": [...]}
    """

    name = "dask"

    def __init__(self, client=None, *, n_workers: int = 2, threads_per_worker: int = 1,
                 shards_per_worker: int = 2, min_shard_examples: int = 32, retries: int = 3, options=None,
                 rewrites: bool = True, task_timeout: float | None = None, resubmits: int = 3,
                 worker_wait: float = 60.0, choices=None, model_fn=None):
        # the parameters spelled out (not **kwargs): help(), a notebook's completion and a misspelt
        # keyword's TypeError name them
        DaskShards.__init__(self, client, n_workers=n_workers, threads_per_worker=threads_per_worker,
                            shards_per_worker=shards_per_worker, min_shard_examples=min_shard_examples,
                            retries=retries, task_timeout=task_timeout, resubmits=resubmits,
                            worker_wait=worker_wait, model_fn=model_fn)
        Executor.__init__(self, options, rewrites=rewrites, choices=choices, shards=self)


def _needs_products(step) -> bool:
    """Whether a pass's row-wise chains apply operators known only through products (their
    labels say ``implicit``): resolved, they hold the client's model and its executor."""
    for op in step.operators():
        try:
            if "implicit" in op.labels():
                return True
        except OperatorError:   # refused when resolved: resolved here, where it raises
            return True
    return False


def _state_for(ctx, step) -> RunState:
    """The part of the run state a shard of ``step`` needs: the resolved operators of its
    row-wise chains (the accumulators carry their held rows and bases)."""
    ops, done = {}, ctx.state.ops
    for op in step.operators():
        ops[op.token] = ctx.resolve(op)
        ops.update((sub.token, done[sub.token]) for sub in op.walk() if sub.token in done)
    return RunState(ops=ops, checked=set(ctx.state.checked))


def _sharded_refusal(step, models) -> DistributedError | None:
    """The refusal of a pass on the workers over a model sharded across torch.distributed
    ranks (a worker would get one rank's shards), or None."""
    sharded = [type(m).__name__ for m in models if is_sharded(m)]
    if sharded:
        return DistributedError(
            f"{step.label} reads a model sharded across torch.distributed ranks ({', '.join(sharded)}: FSDP1, "
            "or DTensor parameters of FSDP2 or tensor parallel); a Dask worker would receive only this rank's shards. Run "
            "the plan inside the torchrun job with executor=ga.exec.TorchDistributed(), or give the Dask "
            "workers the whole model (DaskExecutor(model_fn=...)) and plan on an unsharded or meta-device copy")
    return None


def _lazy_scores(results, index):
    """A Dask array of one score job's columns, a block per shard (gathered already: the
    result outlives worker deaths and the executor)."""
    import dask.array as da

    blocks = (states[index].detach().cpu().numpy() for states, _, _ in results)   # result: (states, trace, digests)
    return da.concatenate([da.from_array(block, chunks=-1) for block in blocks], axis=1)
