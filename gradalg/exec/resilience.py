"""Running a pass's tasks on Dask so that worker faults end in a result or a clear error.

:func:`run_tasks` submits one task per shard (or store chunk) and gathers the results
to this process. What it adds to Dask's own retries:

* **re-submission from the client.** The pass's payload (jobs, model, held state) is
  scattered to the workers; scattered data have no lineage, so when every worker
  holding it dies, Dask cancels the tasks that need it. Those tasks (and any that
  failed because their worker died) are submitted again from the client with a fresh
  scatter, as many times as needed while the scheduler lives. Only a shard that itself
  kills workers (Dask's ``KilledWorker``: it was running on every worker that died, its
  ``allowed-failures`` times) more than ``resubmits`` times is given up on, with a
  :class:`WorkerFaultError` naming it (an out-of-memory or crashing shard).
* **no workers**: after ``worker_wait`` seconds without any worker, a
  :class:`WorkerFaultError` says so (instead of waiting forever).
* **a per-task timeout** (``task_timeout`` seconds of running, counted from the moment
  the task starts on its worker, not from submission): a stalled worker (SIGSTOP,
  swapping, a deadlock) is named — address and pid — in a :class:`WorkerFaultError`.
* **results held here**: every task's result is gathered as soon as it finishes, so a
  result outlives later worker deaths and the executor itself.

Tasks must be pure functions of their arguments (every shard of a pass is), so running
one twice gives the same result; store chunk writes are positional and idempotent.
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections import Counter
from concurrent.futures import CancelledError
from dataclasses import dataclass

from ..errors import OptionError, WorkerFaultError

__all__ = ["FaultPolicy", "PAYLOAD", "run_tasks"]

PAYLOAD = object()          # placeholder for the scattered payload in a task's arguments
_START_TOPIC = "gradalg-task-start"


def _seconds(value) -> bool:
    """Whether ``value`` is a positive number of seconds (an int or a float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class FaultPolicy:
    """How a distributed pass handles faults (``DaskExecutor(..., task_timeout=...)``).

    retries : Dask retries of a task that raised (passed to ``client.submit``).
    resubmits : times a shard that keeps killing its workers is submitted again.
    task_timeout : seconds a task may run on its worker; None: no limit.
    worker_wait : seconds to wait for a worker when the cluster has none.
    poll : seconds between checks of running tasks (timeouts, lost workers).
    """

    retries: int = 3
    resubmits: int = 3
    task_timeout: float | None = None
    worker_wait: float = 60.0
    poll: float = 0.25

    def __post_init__(self):
        for name in ("retries", "resubmits"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise OptionError(f"{name} must be a non-negative int, got {value!r}")
        if self.task_timeout is not None and not _seconds(self.task_timeout):
            raise OptionError(f"task_timeout must be a positive number of seconds or None, got {self.task_timeout!r}")
        if not _seconds(self.worker_wait):
            raise OptionError(f"worker_wait must be a positive number of seconds, got {self.worker_wait!r}")


def _tracked(run_id, index, fn, *args):
    """On a worker: announce the start of task ``index`` (for timeouts), then run it."""
    from distributed import get_worker
    worker = get_worker()
    worker.log_event(_START_TOPIC, {"run": run_id, "index": index, "worker": worker.address, "pid": os.getpid()})
    return fn(*args)


def _is_fault(err: BaseException) -> bool:
    """Whether ``err`` is the cluster's failure (a worker or data lost), not the task's."""
    from distributed.comm.core import CommClosedError
    from distributed.scheduler import KilledWorker
    return isinstance(err, (KilledWorker, CancelledError, CommClosedError)) or any(
        s in str(err) for s in ("already forgotten", "lost dependencies", "Worker holding Actor was lost",
                                "No valid workers", "has been lost"))


def run_tasks(client, fn, payload, args_list, *, policy: FaultPolicy, labels=None, progress: bool = False,
              on_result=None) -> list:
    """``[fn(*args) for args in args_list]`` on the cluster, with :data:`PAYLOAD` in each
    ``args`` replaced by ``payload`` (scattered once per worker per round). Results are
    gathered here, in order. Raises what a task raised (its own error), or
    :class:`WorkerFaultError` for faults that cannot be outlived (see the module doc).

    labels : names of the tasks for messages (e.g. "examples 0:12").
    on_result : called with a task's index as its result arrives (progress lines).
    """
    labels = list(labels) if labels is not None else [f"task {i}" for i in range(len(args_list))]
    results: dict[int, object] = {}
    killed: Counter = Counter()
    run_id = uuid.uuid4().hex
    started: dict[int, tuple[float, str, int]] = {}

    def on_start(event):
        _, msg = event
        if isinstance(msg, dict) and msg.get("run") == run_id:
            started[msg["index"]] = (time.monotonic(), msg.get("worker"), msg.get("pid"))

    subscribed = policy.task_timeout is not None
    if subscribed:
        client.subscribe_topic(_START_TOPIC, on_start)
    try:
        while len(results) < len(args_list):
            scattered = _scatter(client, payload, policy.worker_wait)
            started.clear()
            pids = _worker_pids(client) if subscribed else {}
            futures = {client.submit(_tracked, run_id, i, fn, *(scattered if a is PAYLOAD else a for a in args),
                                     retries=policy.retries, pure=False): i
                       for i, args in enumerate(args_list) if i not in results}
            if progress:
                from distributed import progress as dask_progress
                dask_progress(list(futures))
            _collect_round(client, futures, results, killed, started, labels, policy, pids, on_result)
    finally:
        if subscribed:
            with contextlib.suppress(Exception):   # a closing client
                client.unsubscribe_topic(_START_TOPIC)
    return [results[i] for i in range(len(args_list))]


def _scatter(client, payload, worker_wait: float):
    """``payload`` scattered to every worker once some worker lives: tried again while
    workers die or time out receiving it, 10 times in a row at most."""
    for _ in range(10):
        try:
            client.wait_for_workers(1, timeout=worker_wait)
        except TimeoutError as err:
            raise WorkerFaultError(
                f"the Dask cluster has had no workers for {worker_wait:.0f} s (all died and none came back): "
                "restart the cluster (or its nannies), or run with the local executor") from err
        try:
            return client.scatter([payload], broadcast=True, hash=False)[0]
        except Exception as err:  # noqa: BLE001 - workers died while the payload was sent
            if not (_is_fault(err) or isinstance(err, (TimeoutError, OSError))):
                raise
        time.sleep(0.5)
    raise WorkerFaultError("the pass's payload could not be sent to the workers 10 times in a row "
                           "(they die or time out while receiving it): check the workers' memory limits and logs")


def _worker_pids(client) -> dict:
    """Worker address -> pid, asked while the workers answer (a stopped one cannot)."""
    with contextlib.suppress(Exception):   # a worker died meanwhile: names without pids
        return dict(client.run(os.getpid, on_error="ignore"))
    return {}


def _collect_round(client, futures: dict, results: dict, killed: Counter, started: dict, labels, policy,
                   pids, on_result) -> None:
    """Gather what finishes; leave lost tasks out of ``results`` (the next round submits
    them again: cancelled with their workers or their payload, or killed with their
    workers); raise on a task's own error, a repeat killer or a stalled worker."""
    from distributed import wait
    from distributed.scheduler import KilledWorker

    remaining = set(futures)
    try:
        while remaining:
            try:
                wait(list(remaining), timeout=policy.poll, return_when="FIRST_COMPLETED")
            except (TimeoutError, CancelledError):   # cancelled futures are handled below, one by one
                pass
            for fut in [fut for fut in remaining if fut.done()]:
                remaining.discard(fut)
                i = futures[fut]
                try:
                    results[i] = fut.result()
                except Exception as err:  # noqa: BLE001 - the task's own error is raised as it is
                    if not _is_fault(err):
                        raise
                    killed[i] += isinstance(err, KilledWorker)    # a lost payload or result counts 0
                    if killed[i] > policy.resubmits:
                        raise WorkerFaultError(
                            f"{labels[i]} was running on every worker that died, {killed[i]} times over "
                            f"(each time on {err.allowed_failures + 1} workers): it probably kills its worker "
                            "(out of memory, a crash in native code). Give workers more memory, use smaller "
                            "shards (more shards_per_worker) or a smaller batch_size") from err
                    continue
                if on_result is not None:
                    on_result(i)
            if policy.task_timeout is not None and remaining:
                _check_timeouts(client, futures, remaining, started, labels, policy.task_timeout, pids)
    finally:
        for fut in remaining:
            fut.cancel()


def _stalled(what: str, timeout: float) -> WorkerFaultError:
    """The error naming a stalled worker: ``what`` says which task waits on it, and how long."""
    return WorkerFaultError(
        f"{what}, past task_timeout={timeout} s: that worker is stalled (stopped, swapping or deadlocked). "
        "Restart it (client.restart_workers([...])) or raise task_timeout")


def _check_timeouts(client, futures, remaining, started, labels, timeout, pids) -> None:
    """Raise for a task running longer than ``timeout``, or queued on a worker that has
    been silent (no heartbeat) for longer than it (stopped before the task started)."""
    now, wall = time.monotonic(), time.time()
    for i in (futures[fut] for fut in remaining if futures[fut] in started):
        t0, worker, pid = started[i]
        if now - t0 > timeout:
            raise _stalled(f"{labels[i]} has been running for {now - t0:.1f} s on worker {worker} (pid {pid})",
                           timeout)
    info = client.scheduler_info().get("workers", {})
    keys = {fut.key: futures[fut] for fut in remaining}
    for worker, on_it in client.processing().items():
        mine = [keys[k] for k in on_it if k in keys]
        last_seen = info.get(worker, {}).get("last_seen")
        if mine and last_seen is not None and wall - last_seen > timeout:
            raise _stalled(f"{labels[mine[0]]} is queued on worker {worker} (pid {pids.get(worker)}), which has "
                           f"sent no heartbeat for {wall - last_seen:.1f} s", timeout)
