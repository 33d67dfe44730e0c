"""Where a Dask pass runs, and what it refuses, is decided when the plan is made: a pass over
a model sharded across torch.distributed ranks (DTensor parameters) is refused by its
placement, shown by ``explain()``, and raised before any shard task is submitted."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

import gradalg as ga  # noqa: E402
from gradalg.errors import DistributedError  # noqa: E402

distributed = pytest.importorskip("distributed")


def _looks_sharded(model):
    """Parameters with the attributes by which a DTensor is recognized (``placements``,
    ``to_local``), their values untouched: the model still runs here."""
    for p in model.parameters():
        p.placements = ()
        p.to_local = lambda p=p: p
    return model


def test_a_pass_over_a_sharded_model_is_refused_by_the_plan_before_any_shard_runs():
    model = models.mlp()
    X, y = models.classification_data(n=24)
    task = ga.tasks.classification(model)
    S = ga.methods.grad_dot(task, (X, y), (X[:5], y[:5]))
    want = S.compute().values                       # plain model: computed before it looks sharded
    _looks_sharded(model)
    client = distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0")
    try:
        with ga.options(progress=False):
            dx = ga.exec.DaskExecutor(client, min_shard_examples=100)   # every pass small: on the client
            torch.testing.assert_close(torch.as_tensor(S.compute(executor=dx).values), torch.as_tensor(want))
            dx = ga.exec.DaskExecutor(client, min_shard_examples=1)
            p = dx.plan(S.expr)
            refusals = [where.refusal for where in p.placement if where.sharded]
            assert refusals and all(isinstance(r, DistributedError) for r in refusals)
            assert "sharded across torch.distributed ranks" in str(refusals[0])
            assert "refused: " in str(S.explain(executor=dx))
            with pytest.raises(DistributedError, match="TorchDistributed"):
                S.compute(executor=dx)
            assert dx.transfers == []                # raised before any payload was sent
    finally:
        client.close()


def test_the_shard_count_is_a_plan_decision_that_explain_shows_and_an_option_forces():
    """How many shard tasks a pass on the workers gets is decided when the plan is made (a
    ``SHARDS`` decision and ``plan.placement[i].shards``), shown by ``explain()``, forced by
    ``ga.options(dask_shards=k)``, and what the run splits the pass into; ``explain()``
    describes the shards of the plan it shows, not a placement made again."""
    from dataclasses import replace

    from gradalg.plan.decisions import DecisionKind
    from gradalg.plan.explain import Explain
    X, y = models.classification_data(n=24)
    task = ga.tasks.classification(models.mlp())
    S = ga.methods.grad_dot(task, (X, y), (X[:5], y[:5]))
    want = S.compute().values
    client = distributed.Client(processes=False, n_workers=2, threads_per_worker=1, dashboard_address=":0")
    try:
        with ga.options(progress=False):
            dx = ga.exec.DaskExecutor(client, min_shard_examples=5)
            p = dx.plan(S.expr)
            (train,) = [i for i, step in enumerate(p.passes) if step.reads_data and step.key.n == 24]
            d = p.decisions.one(DecisionKind.SHARDS, subject=(train, p.passes[train].key))
            assert d.chosen == "4" and p.placement[train].shards == 4     # 2 per worker, 24 // 5 = 4 allowed
            assert d.alternatives["shards_per_worker × workers"] == "2 × 2 = 4"
            assert d.alternatives["examples ÷ min_shard_examples"] == "24 ÷ 5 = 4"
            assert f"shards of pass {train + 1} ({p.passes[train].label}): chose 4" in str(S.explain(executor=dx))
            assert len(S.compute(executor=dx).data.chunks[1]) == 4
            dx.options = replace(dx.options, dask_shards=3)
            forced = dx.plan(S.expr)
            assert forced.placement[train].shards == 3
            assert forced.decisions.one(DecisionKind.SHARDS, subject=(train, p.passes[train].key)).chosen == "3"
            got = S.compute(executor=dx)
            assert got.data.chunks[1] == (8, 8, 8)
            torch.testing.assert_close(torch.as_tensor(got.values), torch.as_tensor(want))
            dx.options = replace(dx.options, dask_shards=None)
            shown = Explain(forced, executor=dx).passes()[train]["distributed"]
            assert shown.startswith("3 shard tasks over 2 workers"), shown
    finally:
        client.close()
