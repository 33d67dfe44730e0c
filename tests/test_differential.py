"""The differential matrix: every catalogue method, run by every executor under every
forced planner choice, equals the dense reference.

Axes: method (the catalogue, influence under four curvatures) × executor {local, Dask
with its own 2-worker cluster, Dask on an existing client whose workers have 2 threads
each} × {store, recompute} × {two batch sizes} × {held left, held right}.

The reference is the dense formula in float64 from ``ga.per_example_grads`` (torch.func)
where it is a few lines (Grad-Dot, Grad-Cos, TracIn, empirical-Fisher influence);
for the other methods it is the local executor with no rewrites, one batch, queries held
and nothing stored — the configuration that ``tests/test_methods.py`` checks against
each method's dense formula. Local runs cover the full product; each Dask executor runs
every method under the four configurations of a pairwise-covering array over
(store, batch size, held side), so every pair of levels meets on every executor.
"""
from __future__ import annotations

import functools
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread, reference_rows  # noqa: E402,F401 - one_thread is an autouse fixture

import gradalg as ga  # noqa: E402
from gradalg.plan import Choices, DecisionKind  # noqa: E402

distributed = pytest.importorskip("distributed")

pytestmark = pytest.mark.slow

N_TRAIN, N_QUERY = 24, 5
LAYERS = ("0", "2")
BATCHES = (5, 32)               # 5: a ragged last batch and several per shard; 32: one batch
TOL = {"rtol": 1e-8, "atol": 1e-10}


@functools.cache
def setting():
    model = models.mlp(d_in=6, hidden=8, classes=3)
    X, y = models.classification_data(n=N_TRAIN + N_QUERY, d_in=6, classes=3, seed=4)
    task = ga.tasks.classification(model)
    train, queries = (X[:N_TRAIN], y[:N_TRAIN]), (X[N_TRAIN:], y[N_TRAIN:])
    # LESS needs Adam state: its own model, one step from the same weights
    less_model = models.mlp(d_in=6, hidden=8, classes=3)
    opt = torch.optim.Adam(less_model.parameters(), lr=1e-3)
    F.cross_entropy(less_model(train[0]), train[1]).backward()
    opt.step()
    opt.zero_grad()
    less_task = ga.tasks.classification(less_model)
    return task, train, queries, (less_task, opt)


def methods():
    """(name, lazy scores, dense reference or None) for the whole catalogue."""
    task, train, queries, (less_task, opt) = setting()
    M = ga.methods
    RG, RQ = reference_rows(task, train, LAYERS), reference_rows(task, queries, LAYERS)   # (n, dim)

    def unit(R):
        return R / R.norm(dim=1, keepdim=True)

    H = RG.T @ RG / N_TRAIN + 0.1 * torch.eye(RG.shape[1], dtype=torch.float64)
    yield "grad_dot", M.grad_dot(task, train, queries), RQ @ RG.T
    yield "grad_cos", M.grad_cos(task, train, queries), unit(RQ) @ unit(RG).T
    yield "tracin", M.tracin([task, task], [0.1, 0.05], train, queries), 0.15 * RQ @ RG.T
    yield ("influence_empirical", M.influence(task, train, queries, curvature="empirical", damping=0.1),
           RQ @ torch.linalg.solve(H, RG.T))
    yield "influence", M.influence(task, train, queries), None
    yield "influence_projected", M.influence(task, train, queries, projector=ga.proj.kron(8, seed=1)), None
    yield "influence_ekfac", M.influence(task, train, queries, curvature="ekfac"), None
    yield "influence_datainf", M.influence(task, train, queries, curvature="datainf", damping=0.1), None
    yield "trak", M.trak([task, task], train, queries, k=8), None
    yield "logra", M.logra(task, train, queries, k=8), None
    yield "grass", M.grass(task, train, queries, k=8), None
    yield "less", M.less([less_task], [opt], [1e-3], train, queries, [0, 0, 1, 1, 1], k=8), None
    yield "relatif", M.relatif(task, train, queries), None
    yield "self_influence", M.self_influence(M.influence, task, train), None


METHODS = [name for name, _, _ in methods()]


@functools.cache
def reference(name):
    S, formula = {n: (s, f) for n, s, f in methods()}[name]
    canonical = ga.exec.LocalExecutor(rewrites=False, choices=Choices(held="left", store="never"))
    with ga.options(progress=False, batch_size=N_TRAIN + N_QUERY):
        ref = np.asarray(S.compute(executor=canonical).values)
    if formula is not None:   # the canonical run is itself the dense formula
        np.testing.assert_allclose(ref, formula.numpy(), **TOL, err_msg=f"{name}: canonical vs formula")
    return ref


def lazy(name):
    return {n: s for n, s, _ in methods()}[name]


def run(S, executor, batch_size):
    with ga.options(progress=False, batch_size=batch_size):
        return np.asarray(S.compute(executor=executor).values)


# ---------------------------------------------------------------------- executors
@pytest.fixture(scope="module")
def own_cluster():
    """A DaskExecutor that starts (and closes) its own 2-worker cluster; shards of at
    least 5 examples: the training pass in 4 shards, the queries' in one, both on workers."""
    ex = ga.exec.DaskExecutor(n_workers=2, threads_per_worker=1, min_shard_examples=5)
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def existing_client():
    """A client on a 2-worker cluster with 2 threads per worker (the default of
    ``LocalCluster`` on a 4-core machine): two shards may land on one worker at once."""
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0")
    client = distributed.Client(cluster)
    yield client
    client.close()
    cluster.close()


CHOICES = [(store, batch, held) for store in ("always", "never") for batch in BATCHES for held in ("left", "right")]
# pairwise-covering subset for the Dask executors (an L4 orthogonal array over 3 two-level factors)
PAIRWISE = [("always", BATCHES[0], "left"), ("always", BATCHES[1], "right"),
            ("never", BATCHES[0], "right"), ("never", BATCHES[1], "left")]


@pytest.mark.parametrize("name", METHODS)
def test_local_executor_under_every_choice_equals_the_reference(name):
    S, want = lazy(name), reference(name)
    for store, batch, held in CHOICES:
        ex = ga.exec.LocalExecutor(choices=Choices(held=held, store=store))
        np.testing.assert_allclose(run(S, ex, batch), want, **TOL,
                                   err_msg=f"{name}: local, store={store}, batch={batch}, held={held}")


@pytest.mark.parametrize("name", METHODS)
def test_dask_with_its_own_cluster_equals_the_reference(name, own_cluster):
    S, want = lazy(name), reference(name)
    for store, batch, held in PAIRWISE:
        own_cluster.choices = Choices(held=held, store=store)
        own_cluster.reset()
        np.testing.assert_allclose(run(S, own_cluster, batch), want, **TOL,
                                   err_msg=f"{name}: dask (own cluster), store={store}, batch={batch}, held={held}")


@pytest.mark.parametrize("name", METHODS)
def test_dask_on_an_existing_client_equals_the_reference(name, existing_client):
    S, want = lazy(name), reference(name)
    for store, batch, held in PAIRWISE:
        # shards of at least 6 examples: the training pass in 4, the queries' on the client
        ex = ga.exec.DaskExecutor(client=existing_client, min_shard_examples=6,
                                  choices=Choices(held=held, store=store))
        np.testing.assert_allclose(run(S, ex, batch), want, **TOL,
                                   err_msg=f"{name}: dask (existing client), store={store}, batch={batch}, held={held}")


def test_the_quickstart_influence_stores_its_training_rows_once_on_dask(existing_client):
    """The reported case: P(Q) @ fisher(P(G)).damp().inv() @ P(G).T with P(G) stored in
    the Fisher pass, on workers with two threads; the stored rows are 300, not 300 per shard."""
    model = models.mlp(d_in=8, hidden=16, classes=4)
    X, y = models.classification_data(n=310, d_in=8, classes=4, seed=5)
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, (X[:300], y[:300])), ga.grads(task, (X[300:], y[300:]))
    P = ga.proj.kron(k=16, seed=0)
    S = P(Q) @ ga.fisher(P(G)).damp(1e-2).inv() @ P(G).T
    ex = ga.exec.DaskExecutor(client=existing_client)
    with ga.options(progress=False):
        got = S.compute(executor=ex)
        want = S.compute().values
    assert ex.last_plan.decisions.one(DecisionKind.STORE).chosen == "store"
    assert got.shape == (10, 300)
    np.testing.assert_allclose(np.asarray(got.values), want, rtol=1e-10, atol=1e-12)


def test_language_model_dict_items_with_a_tied_head_on_dask_equal_local(own_cluster):
    """Variable-length dict items (gradalg's pad collate in every shard), a GPT-2 whose
    embedding is tied to its head (one block, uses summed) and LoGra's stored projected
    rows: the Dask result equals the local one, which equals a loop of autograd."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=20, n_positions=12))
    model = model.double().eval()
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(24):
        ids = torch.randint(1, 20, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g)
        items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    task = ga.tasks.causal_lm(model)
    # the tied embedding/head (not in the LM default layers) and the block's linears
    layers = ["transformer.wte"] + [f"transformer.h.0.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                    "mlp.c_proj")]
    with ga.options(progress=False):
        dot = ga.methods.grad_dot(task, items, items[:3], layers=layers)
        local = dot.compute().values
        np.testing.assert_allclose(np.asarray(dot.compute(executor=own_cluster).values), local, rtol=1e-10)
        logra = ga.methods.logra(task, items, items[:3], layers=layers, k=16)
        np.testing.assert_allclose(np.asarray(logra.compute(executor=own_cluster).values), logra.compute().values,
                                   rtol=1e-8, atol=1e-10)

    def grad(item):     # the tied weight's gradient is the sum over its two uses
        model.zero_grad()
        ids = item["input_ids"][None]
        logits = model(input_ids=ids).logits[0, :-1]
        torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").backward()
        return torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "wpe" not in n and "ln" not in n])

    rows = torch.stack([grad(it) for it in items])
    np.testing.assert_allclose(local, (rows[:3] @ rows.T).numpy(), rtol=1e-10, atol=1e-12)
