"""``gradalg.exec.resilience.run_tasks`` on a real one-worker cluster, one case per
kind of failure (``tests/test_faults.py`` injects faults into whole Dask passes):

* a task's own error is raised as it is (not taken for a fault, not submitted again);
* a task that kills every worker it runs on (Dask's ``KilledWorker``) is given up on
  after ``resubmits`` re-submissions, with a :class:`WorkerFaultError` naming it;
* a task that runs past ``task_timeout`` names its worker and that worker's pid;
* a cluster without workers ends in a :class:`WorkerFaultError` after ``worker_wait``.
"""
import os
import time

import pytest

import gradalg as ga

distributed = pytest.importorskip("distributed")

from gradalg.exec.resilience import PAYLOAD, FaultPolicy, run_tasks  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    import dask
    # the scheduler runs in this process: one worker death makes a task a KilledWorker
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                           dashboard_address=":0")
    c = distributed.Client(cluster)
    yield c
    c.close()
    cluster.close()


def _add(payload, x):
    return payload + x


def _own_error(payload, x):
    raise KeyError(f"task {x} fails by itself")


def _kill_worker(payload, x):
    os._exit(1)


def _sleep(payload, seconds):
    time.sleep(seconds)
    return seconds


def test_results_come_back_in_order_with_the_payload(client):
    seen = []
    got = run_tasks(client, _add, 100, [(PAYLOAD, i) for i in range(5)], policy=FaultPolicy(), on_result=seen.append)
    assert got == [100, 101, 102, 103, 104] and sorted(seen) == [0, 1, 2, 3, 4]


def test_a_task_s_own_error_is_raised_as_it_is(client):
    with pytest.raises(KeyError, match="task 1 fails by itself"):
        run_tasks(client, _own_error, 0, [(PAYLOAD, 1)], policy=FaultPolicy(retries=0))


def test_a_task_that_kills_its_workers_is_given_up_on_after_resubmits(client):
    with pytest.raises(ga.WorkerFaultError, match="shard A was running on every worker that died, 2 times over"):
        run_tasks(client, _kill_worker, 0, [(PAYLOAD, 0)], labels=["shard A"],
                  policy=FaultPolicy(retries=0, resubmits=1))
    client.wait_for_workers(1, timeout=60)
    assert run_tasks(client, _add, 1, [(PAYLOAD, 1)], policy=FaultPolicy()) == [2]   # the nanny restarted it


def test_a_task_running_past_the_timeout_names_its_worker_and_pid(client):
    [(worker, pid)] = client.run(os.getpid).items()
    t0 = time.monotonic()
    with pytest.raises(ga.WorkerFaultError, match="task_timeout=1.0 s") as err:
        run_tasks(client, _sleep, 0, [(PAYLOAD, 8)], labels=["shard B"], policy=FaultPolicy(task_timeout=1.0))
    assert time.monotonic() - t0 < 8
    assert "shard B has been running for" in str(err.value) and worker in str(err.value) and str(pid) in str(err.value)


def test_a_cluster_without_workers_is_a_fault_after_worker_wait():
    with distributed.LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as c:
        t0 = time.monotonic()
        with pytest.raises(ga.WorkerFaultError, match="no workers for 1 s"):
            run_tasks(c, _add, 0, [(PAYLOAD, 1)], policy=FaultPolicy(worker_wait=1))
        assert time.monotonic() - t0 < 30
