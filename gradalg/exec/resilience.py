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

import os
import time
import uuid
from concurrent.futures import CancelledError
from dataclasses import dataclass

from ..errors import OptionError, WorkerFaultError

__all__ = ["FaultPolicy", "PAYLOAD", "run_tasks"]

PAYLOAD = object()          # placeholder for the scattered payload in a task's arguments
_START_TOPIC = "gradalg-task-start"


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
        if self.task_timeout is not None and (isinstance(self.task_timeout, bool) or not
                                              isinstance(self.task_timeout, (int, float)) or
                                              not self.task_timeout > 0):
            raise OptionError(f"task_timeout must be a positive number of seconds or None, got {self.task_timeout!r}")
        if isinstance(self.worker_wait, bool) or not isinstance(self.worker_wait, (int, float)) or self.worker_wait <= 0:
            raise OptionError(f"worker_wait must be a positive number of seconds, got {self.worker_wait!r}")


def _tracked(run_id, index, fn, *args):
    """On a worker: announce the start of task ``index`` (for timeouts), then run it."""
    try:
        from distributed import get_worker
        worker = get_worker()
        worker.log_event(_START_TOPIC, {"run": run_id, "index": index, "worker": worker.address,
                                        "pid": os.getpid()})
    except (ImportError, ValueError):      # not on a worker (a synchronous scheduler)
        pass
    return fn(*args)


def _is_fault(err: BaseException) -> bool:
    """Whether ``err`` is the cluster's failure (a worker or data lost), not the task's."""
    from distributed.scheduler import KilledWorker
    if isinstance(err, (KilledWorker, CancelledError)):
        return True
    try:
        from distributed.comm.core import CommClosedError
        if isinstance(err, CommClosedError):
            return True
    except ImportError:
        pass
    text = str(err)
    return any(s in text for s in ("already forgotten", "lost dependencies", "Worker holding Actor was lost",
                                   "No valid workers", "has been lost"))


def _wait_for_workers(client, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not client.scheduler_info().get("workers"):
        if time.monotonic() > deadline:
            raise WorkerFaultError(
                f"the Dask cluster has had no workers for {seconds:.0f} s (all died and none came back): "
                "restart the cluster (or its nannies), or run with the local executor")
        time.sleep(0.2)


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
    killed = {i: 0 for i in range(len(args_list))}
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
        failed_scatters = 0
        while len(results) < len(args_list):
            _wait_for_workers(client, policy.worker_wait)
            pending = [i for i in range(len(args_list)) if i not in results]
            started.clear()
            pids = _worker_pids(client) if subscribed else {}
            futures = _submit_round(client, fn, payload, args_list, pending, run_id, policy)
            failed_scatters = failed_scatters + 1 if not futures else 0
            if failed_scatters > 10:
                raise WorkerFaultError("the pass's payload could not be sent to the workers 10 times in a row "
                                       "(they die or time out while receiving it): check the workers' memory "
                                       "limits and logs")
            if not futures:
                time.sleep(0.5)
                continue
            if progress:
                from distributed import progress as dask_progress
                dask_progress(list(futures))
            _collect_round(client, futures, results, killed, started, labels, policy, pids, on_result)
    finally:
        if subscribed:
            try:
                client.unsubscribe_topic(_START_TOPIC)
            except Exception:  # noqa: BLE001 - a closing client
                pass
    return [results[i] for i in range(len(args_list))]


def _submit_round(client, fn, payload, args_list, pending, run_id, policy) -> dict:
    try:
        [scattered] = client.scatter([payload], broadcast=True, hash=False)
    except Exception as err:  # noqa: BLE001 - workers died while the payload was sent
        if _is_fault(err) or isinstance(err, (TimeoutError, OSError)):
            return {}
        raise
    futures = {}
    for i in pending:
        args = tuple(scattered if a is PAYLOAD else a for a in args_list[i])
        fut = client.submit(_tracked, run_id, i, fn, *args, retries=policy.retries, pure=False)
        futures[fut] = i
    return futures


def _worker_pids(client) -> dict:
    """Worker address -> pid, asked while the workers answer (a stopped one cannot)."""
    try:
        return dict(client.run(os.getpid, on_error="ignore"))
    except Exception:  # noqa: BLE001 - a worker died meanwhile: names without pids
        return {}


def _collect_round(client, futures: dict, results: dict, killed: dict, started: dict, labels, policy,
                   pids=None, on_result=None) -> None:
    """Gather what finishes; leave lost tasks out of ``results`` (the next round submits
    them again); raise on a task's own error, a repeat killer or a stalled worker."""
    from distributed import wait
    from distributed.scheduler import KilledWorker

    remaining = set(futures)
    try:
        while remaining:
            try:
                wait(list(remaining), timeout=policy.poll, return_when="FIRST_COMPLETED")
            except (TimeoutError, CancelledError):   # cancelled futures are handled below, one by one
                pass
            done = [fut for fut in remaining if fut.done()]
            for fut in done:
                remaining.discard(fut)
                i = futures[fut]
                if fut.status == "finished":
                    try:
                        results[i] = fut.result()
                    except Exception as err:  # noqa: BLE001 - the result was lost while fetched
                        if not _is_fault(err):
                            raise
                        continue
                    if on_result is not None:
                        on_result(i)
                    continue
                if fut.cancelled() or fut.status == "cancelled":
                    continue          # lost with its workers or its payload: submitted again
                try:
                    err = fut.exception()
                except CancelledError as cancelled:
                    err = cancelled
                if err is None or not _is_fault(err):
                    fut.result()          # the task's own error: raised as it is
                if isinstance(err, KilledWorker):
                    killed[i] += 1
                    if killed[i] > policy.resubmits:
                        raise WorkerFaultError(
                            f"{labels[i]} was running on every worker that died, {killed[i]} times over "
                            f"(each time on {err.allowed_failures + 1} workers): it probably kills its worker "
                            "(out of memory, a crash in native code). Give workers more memory, use smaller "
                            "shards (more shards_per_worker) or a smaller batch_size") from err
            _check_timeouts(client, futures, remaining, started, labels, policy, pids or {})
    finally:
        for fut in remaining:
            fut.cancel()


_last_silence_check = [0.0]


def _stalled(label, seconds, worker, pid, timeout, queued=False) -> WorkerFaultError:
    what = (f"{label} is queued on worker {worker} (pid {pid}), which has sent no heartbeat for {seconds:.1f} s"
            if queued else f"{label} has been running for {seconds:.1f} s on worker {worker} (pid {pid})")
    return WorkerFaultError(
        f"{what}, past task_timeout={timeout} s: that worker is stalled (stopped, swapping or deadlocked). "
        "Restart it (client.restart_workers([...])) or raise task_timeout")


def _check_timeouts(client, futures, remaining, started, labels, policy, pids) -> None:
    """Raise for a task running longer than the timeout, or queued on a worker that has
    been silent (no heartbeat) for longer than it (stopped before the task started)."""
    if policy.task_timeout is None or not remaining:
        return
    now = time.monotonic()
    for fut in remaining:
        i = futures[fut]
        if i in started:
            t0, worker, pid = started[i]
            if now - t0 > policy.task_timeout:
                raise _stalled(labels[i], now - t0, worker, pid, policy.task_timeout)
    if now - _last_silence_check[0] < 1.0:
        return
    _last_silence_check[0] = now
    info = client.scheduler_info().get("workers", {})
    keys = {fut.key: futures[fut] for fut in remaining}
    wall = time.time()
    for worker, on_it in client.processing().items():
        mine = [keys[k] for k in on_it if k in keys]
        last_seen = info.get(worker, {}).get("last_seen")
        if mine and last_seen is not None and wall - last_seen > policy.task_timeout:
            raise _stalled(labels[mine[0]], wall - last_seen, worker, pids.get(worker), policy.task_timeout,
                           queued=True)
