"""Fault injection on Dask passes: workers killed (one, then every one), a worker
stopped (SIGSTOP) under a task timeout, results read after the executor closed.

Each fault is injected while a shard is *running* (the test waits until the victim
worker reports a task in progress), so the test does not depend on timing. One
2-process LocalCluster serves the module.
"""
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

import gradalg as ga  # noqa: E402

distributed = pytest.importorskip("distributed")

pytestmark = pytest.mark.slow


class SlowLoss:
    """Cross-entropy that sleeps per batch: a pass lasts long enough to be interrupted."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, model, batch):
        time.sleep(self.seconds)
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="sum")


@pytest.fixture(scope="module")
def dx():
    with ga.options(progress=False):
        ex = ga.exec.DaskExecutor(n_workers=2, threads_per_worker=1, min_shard_examples=1, worker_wait=60)
        yield ex
        ex.close()


@pytest.fixture(scope="module")
def slow_scores():
    model = models.mlp()
    X, y = models.classification_data(n=24)
    task = ga.Task(model, SlowLoss(0.1), name="slow")
    S = ga.grads(task, (X[:3], y[:3])) @ ga.grads(task, (X, y), batch_size=2).T
    return S, S.compute().values


def _workers_running(client):
    """Addresses of the workers executing a task now, with their pids."""
    pids = client.run(os.getpid)
    busy = [w for w, keys in client.processing().items() if keys]
    return {w: pids[w] for w in busy if w in pids}


def _when_running(client, action, wanted=1, timeout=60.0):
    """Run ``action(workers)`` in a thread once ``wanted`` workers execute a shard."""
    fired = []

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = _workers_running(client)
            if len(busy) >= wanted:
                action(busy)
                fired.append(time.monotonic())
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, fired


def _kill(busy):
    for pid in busy.values():
        os.kill(pid, signal.SIGKILL)


def test_datasets_and_loaders_are_sharded_not_read_whole(dx):
    """Each shard reads its own examples (a DataRef keeps its name when unpickled on a
    worker): the Fisher is not multiplied by the number of shards, the scores' values
    have the shape the DataArray says."""
    from torch.utils.data import DataLoader, TensorDataset
    model = models.mlp()
    task = ga.tasks.classification(model)
    X, y = models.classification_data(n=24)
    for data in (TensorDataset(X, y), DataLoader(TensorDataset(X, y), batch_size=5)):
        G = ga.grads(task, data)
        np.testing.assert_allclose(ga.fisher(G).to_dense(dx).numpy(), ga.fisher(G).to_dense().numpy(),
                                   rtol=1e-10, atol=1e-14)
        S = ga.grads(task, (X[:3], y[:3])) @ G.T
        got = S.compute(executor=dx)
        assert got.shape == (3, 24) and np.asarray(got.values).shape == (3, 24)
        np.testing.assert_allclose(np.asarray(got.values), S.compute().values, rtol=1e-10)


def test_a_pass_survives_every_worker_being_killed(dx, slow_scores):
    """Both workers die mid-pass (the scattered payload is lost with them): the shards
    are submitted again from the client once the nannies restart the workers."""
    S, expected = slow_scores
    before = set(dx.client.run(os.getpid).values())
    thread, fired = _when_running(dx.client, _kill, wanted=2)
    result = S.compute(executor=dx).values
    thread.join()
    assert fired, "the workers were not killed while running"
    np.testing.assert_allclose(result, expected, rtol=1e-12)
    dx.client.wait_for_workers(2, timeout=60)
    assert not before & set(dx.client.run(os.getpid).values())   # both processes were replaced


def test_a_stopped_worker_is_named_by_the_task_timeout(dx, slow_scores):
    S, _ = slow_scores
    stopped = []

    def stop(busy):
        worker, pid = next(iter(busy.items()))
        os.kill(pid, signal.SIGSTOP)
        stopped.append((worker, pid))

    timed = ga.exec.DaskExecutor(client=dx.client, min_shard_examples=1, task_timeout=3.0)
    thread, fired = _when_running(dx.client, stop)
    try:
        t0 = time.monotonic()
        with pytest.raises(ga.WorkerFaultError, match="task_timeout") as info:
            S.compute(executor=timed)
        assert time.monotonic() - t0 < 60
        thread.join()
        worker, pid = stopped[0]
        assert worker in str(info.value) and str(pid) in str(info.value)
    finally:
        for _, pid in stopped:
            os.kill(pid, signal.SIGCONT)
    dx.client.wait_for_workers(2, timeout=60)


def test_results_outlive_the_executor():
    model = models.mlp()
    X, y = models.classification_data(n=24)
    task = ga.tasks.classification(model)
    S = ga.methods.grad_dot(task, (X, y), (X[:3], y[:3]))
    with ga.options(progress=False):
        ex = ga.exec.DaskExecutor(n_workers=1, threads_per_worker=1, min_shard_examples=1)
        result = S.compute(executor=ex)
        ex.close()
    np.testing.assert_allclose(np.asarray(result.values), S.compute().values, rtol=1e-12)


def test_fault_options_are_validated(dx):
    for bad in ({"task_timeout": 0}, {"task_timeout": "10"}, {"resubmits": -1}, {"retries": True}):
        with pytest.raises(ga.OptionError):
            ga.exec.DaskExecutor(client=dx.client, **bad)
