"""The Dask executor equals the local executor, survives a killed worker, and returns
Dask-backed results. One 2-process LocalCluster serves the whole module."""
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

import gradalg as ga  # noqa: E402

distributed = pytest.importorskip("distributed")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dx():
    with ga.options(progress=False):
        ex = ga.exec.DaskExecutor(n_workers=2, threads_per_worker=1, min_shard_examples=1)
        yield ex
        ex.close()


@pytest.fixture(scope="module")
def setting():
    model = models.mlp()
    X, y = models.classification_data(n=48)
    task = ga.tasks.classification(model)
    return task, (X, y), (X[:5], y[:5])


def _methods(task, train, queries):
    M = ga.methods
    yield "grad_dot", M.grad_dot(task, train, queries)
    yield "grad_cos", M.grad_cos(task, train, queries)
    yield "influence", M.influence(task, train, queries)
    yield "influence_projected", M.influence(task, train, queries, projector=ga.proj.kron(16))
    yield "influence_ekfac", M.influence(task, train, queries, curvature="ekfac")
    # statistics on the first 20 / 30 of 48 examples: prefix passes split into shards
    yield "influence_ekfac_subsets", M.influence(task, train, queries, curvature="ekfac",
                                                 covariance_max_examples=20, lambda_max_examples=30)
    yield "influence_ekfac_rank_2_queries", M.influence(task, train, queries, curvature="ekfac", query_gradient_rank=2)
    yield "influence_datainf", M.influence(task, train, queries, curvature="datainf", damping=0.1)
    yield "tracin", M.tracin([task, task], [0.1, 0.05], train, queries)
    yield "trak", M.trak([task, task], train, queries, k=16)
    yield "logra", M.logra(task, train, queries, k=16)
    yield "grass", M.grass(task, train, queries, k=16)
    yield "relatif", M.relatif(task, train, queries)


def test_every_method_equals_the_local_executor(dx, setting):
    task, train, queries = setting
    for name, S in _methods(task, train, queries):
        local = S.compute().values
        distributed_result = S.compute(executor=dx)
        np.testing.assert_allclose(distributed_result.values, local, rtol=1e-9, atol=1e-9, err_msg=name)


def test_self_influence_and_less(dx, setting):
    task, train, queries = setting
    si = ga.methods.self_influence(ga.methods.influence, task, train)
    np.testing.assert_allclose(si.compute(executor=dx).values, si.compute().values, rtol=1e-9)
    opt = torch.optim.Adam(task.model.parameters(), lr=1e-3)
    model_copy = task.model
    X, y = train
    F.cross_entropy(model_copy(X), y).backward()
    opt.step()
    opt.zero_grad()
    S = ga.methods.less([task], [opt], [1e-3], train, queries, [0, 0, 1, 1, 1], k=32)
    np.testing.assert_allclose(S.compute(executor=dx).values, S.compute().values, rtol=1e-9, atol=1e-12)


def test_scores_are_dask_backed_blocks_one_per_shard(dx, setting):
    task, train, queries = setting
    result = ga.methods.grad_dot(task, train, queries).compute(executor=dx)
    import dask.array as da
    assert isinstance(result.data, da.Array)
    assert len(result.data.chunks[1]) == dx.n_workers * dx.shards_per_worker
    assert result.dims == ("query", "train")
    assert list(result.train.values) == list(range(48))


def test_sharded_passes_write_progress_lines_without_a_terminal(dx, setting, capfd):
    """A Dask pass in a log (nohup, SLURM) reports rows as shards finish, with rate and ETA."""
    from dataclasses import replace
    task, train, queries = setting
    before = dx.options
    dx.options = replace(before, progress="lines", progress_interval=0)
    try:
        ga.methods.grad_dot(task, train, queries).compute(executor=dx).values
    finally:
        dx.options = before
    err = capfd.readouterr().err
    shard_lines = [line for line in err.splitlines() if "shards)" in line and "rows" in line]
    assert shard_lines and shard_lines[-1].split(": ", 1)[1].startswith("done, 48 rows in ")
    assert any("/48 rows" in line and "ETA" in line for line in shard_lines)


def test_small_passes_run_in_this_process_and_shards_keep_a_minimum_size(dx, setting):
    """A pass over fewer than ``min_shard_examples`` runs on the client (shipping the
    model to every worker would cost more); larger passes get no shard under it."""
    task, train, queries = setting
    S = ga.methods.grad_dot(task, train, queries)
    want = S.compute().values
    old = dx.min_shard_examples
    try:
        dx.min_shard_examples = 20
        got = S.compute(executor=dx)
        assert len(got.data.chunks[1]) == 2                   # 48 examples: 2 shards of 24, not 4 of 12
        np.testing.assert_allclose(np.asarray(got.values), want, rtol=1e-12, atol=1e-12)
        query_pass = [p for p in dx.last_plan.passes if p.reads_data and p.key.n == 5][0]
        assert dx.describe_pass(query_pass).startswith("runs on the client (5 examples")
    finally:
        dx.min_shard_examples = old
    with pytest.raises(ValueError, match="min_shard_examples"):
        ga.exec.DaskExecutor(client=dx.client, min_shard_examples=0)


class _SlowLoss:
    """A loss that sleeps per batch, leaving time to kill a worker mid-pass."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, model, batch):
        time.sleep(self.seconds)
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="sum")


def test_a_killed_worker_is_replaced_and_the_result_is_unchanged(dx, setting):
    task0, train, queries = setting
    task = ga.Task(task0.model, _SlowLoss(0.15), name="slow")
    S = ga.grads(task, queries) @ ga.grads(task, train, batch_size=2).T
    expected = S.compute().values
    killed = []

    def kill_while_running():
        # kill a worker once it is executing a shard (not at a fixed time: the pass may
        # not have started, or may have finished, on a loaded machine)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            pids = dx.client.run(os.getpid)
            busy = [w for w, keys in dx.client.processing().items() if keys and w in pids]
            if busy:
                os.kill(pids[busy[0]], signal.SIGKILL)
                killed.append(pids[busy[0]])
            time.sleep(0.05)

    killer = threading.Thread(target=kill_while_running, daemon=True)
    killer.start()
    result = S.compute(executor=dx).values   # 24 batches × 0.15 s over 2 workers ≈ 2 s
    killer.join()
    assert killed                             # the worker died mid-run
    victim = killed[0]
    np.testing.assert_allclose(result, expected, rtol=1e-12)
    dx.client.wait_for_workers(2, timeout=60)
    after = dx.client.run(os.getpid)
    assert victim not in after.values()   # the nanny started a new worker process
