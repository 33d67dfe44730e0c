"""A ``compute()``'s intermediates are freed by reference counting when it returns (session
48, task ``cycles``): none is left to Python's cyclic garbage collector.

Scoring checkpoints in a loop, the resident set grew by each computation's intermediates
(~230 MiB per RelatIF on a tiny GPT-2; 7 GB after 50 checkpoints) until a full cyclic
collection happened to run: the cyclic GC runs on counts of allocated objects, not on
memory. The cycles were

* the executor and its pass runner (``Executor.runner.ctx`` was the executor): the run
  state (every resolved operator — factors, eigenbases —, kept and stored rows, results)
  and the last plan lived until the cyclic GC ran;
* the recursive ``visit`` closure of :func:`gradalg.expr.base.transform` (its cell held the
  function): its memo of rebuilt nodes and its ``fn`` (``freeze_ops``'s: an executor's
  ``resolve``) likewise;
* a resolved DataInf operator in the run state streams its training rows through the
  executor (``Resolution.rows``): executor → state → operator → executor. An executor made
  by ``compute()`` itself now drops its run state when the result is assembled.

The check: with the cyclic GC disabled, compute, drop the result, then run one collection
that saves what it finds (``gc.DEBUG_SAVEALL``): no tensor may be among it. On ``main``
every method here failed it (RelatIF: 49 tensors, 1.1 MB, the stored rows' factors among
them; TRAK: 6 tensors, its projections).
"""
from __future__ import annotations

import gc

import pytest
import torch

import gradalg as ga

import models


def _items(n, queries, T=10, vocab=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": r} for r in torch.randint(1, vocab, (n + queries, T), generator=g)]


METHODS = {
    "grad_dot": lambda t, z, q: ga.methods.grad_dot(t, z, q),
    "influence": lambda t, z, q: ga.methods.influence(t, z, q),
    "ekfac": lambda t, z, q: ga.methods.influence(t, z, q, curvature="ekfac"),
    "relatif": lambda t, z, q: ga.methods.relatif(t, z, q),
    "logra": lambda t, z, q: ga.methods.logra(t, z, q, k=16),
    "trak": lambda t, z, q: ga.methods.trak(t, z, q, k=64),
    "self_influence": lambda t, z, q: ga.methods.self_influence(ga.methods.influence, t, z),
    "datainf": lambda t, z, q: ga.methods.influence(t, z, q, curvature="datainf"),
}


def _cyclic_garbage(run) -> list:
    """What the cyclic collector alone would free after ``run()`` (its result dropped):
    the objects of one saving collection run after it with the cyclic GC disabled."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
    finally:
        gc.set_debug(0)
        found = gc.garbage[:]
        gc.garbage.clear()
        if enabled:
            gc.enable()
    return found


@pytest.mark.parametrize("method", sorted(METHODS))
def test_compute_leaves_no_tensor_to_the_cyclic_collector(method):
    model = models.gpt2(dtype=torch.float32, n_layer=1, n_embd=32)
    task, items = ga.tasks.causal_lm(model), _items(16, 3)
    ran = []

    def run():
        with ga.options(progress=False, fingerprint_cache=False):
            ran.append(METHODS[method](task, items[:16], items[16:]).compute().shape)

    tensors = [x for x in _cyclic_garbage(run) if isinstance(x, torch.Tensor)]
    assert ran, "the computation ran"
    held = sum(t.numel() * t.element_size() for t in tensors)
    assert not tensors, (f"{len(tensors)} tensors ({held} bytes) outlived {method}'s compute() in reference "
                         f"cycles, e.g. shapes {[tuple(t.shape) for t in tensors[:5]]}")


def test_the_check_finds_a_cycle_holding_a_tensor():
    """The check sees a tensor kept only by a cycle (it is not vacuous)."""
    class Holder:
        pass

    def run():
        h = Holder()
        h.me, h.rows = h, torch.zeros(1000)

    found = [x for x in _cyclic_garbage(run) if isinstance(x, torch.Tensor)]
    assert [tuple(t.shape) for t in found] == [(1000,)]



class Recording(ga.LocalExecutor):
    """A local executor that records its ``close()`` calls in ``closed``."""
    closed: list = []

    def close(self):
        Recording.closed.append(self)
        super().close()


@pytest.fixture
def recording(monkeypatch):
    """``get_executor("recording")`` makes a :class:`Recording`; yields the list of closed ones."""
    import gradalg.exec.base as base

    made = base.get_executor
    monkeypatch.setattr(base, "get_executor",
                        lambda executor=None, **kw: Recording() if executor == "recording" else made(executor, **kw))
    monkeypatch.setattr(Recording, "closed", [])
    return Recording.closed


def test_an_executor_compute_made_is_closed_and_a_given_one_is_not(recording):
    """``compute(executor="dask")`` made a DaskExecutor whose LocalCluster (worker processes)
    was never closed: one more cluster left running per call. An executor ``compute()`` makes
    from a name is closed once the result is assembled; one the user passes stays open (it
    keeps its state on purpose: the user closes it)."""
    model = models.gpt2(dtype=torch.float32, n_layer=1, n_embd=32)
    task, items = ga.tasks.causal_lm(model), _items(8, 2)
    with ga.options(progress=False):
        S = ga.methods.grad_dot(task, items[:8], items[8:])
        by_name = S.compute(executor="recording").values
        assert len(recording) == 1
        mine = Recording()
        given = S.compute(executor=mine).values
        assert len(recording) == 1 and mine.state.results, "the executor the user passed is neither closed nor reset"
        mine.close()
    assert (by_name == given).all()


def test_to_dense_closes_an_executor_it_made(recording):
    """``G.to_dense(executor="dask")`` and ``H.to_dense(executor="dask")`` left their cluster
    running too: the executor they make is closed after the rows / matrix are read."""
    model = models.gpt2(dtype=torch.float32, n_layer=1, n_embd=32)
    task, items = ga.tasks.causal_lm(model), _items(8, 0)
    with ga.options(progress=False):
        G = ga.grads(task, items, layers=["transformer.h.0.mlp.c_proj"])
        rows = G.to_dense(executor="recording")
        H = ga.fisher(G).to_dense(executor="recording")
    assert len(recording) == 2
    flat = rows["transformer.h.0.mlp.c_proj"].reshape(8, -1).double()
    assert torch.allclose(H.double(), flat.T @ flat / 8, rtol=1e-4, atol=1e-7)
