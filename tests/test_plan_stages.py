"""The planner as pure stages (lower → facts → decide → schedule → size): each stage's
record is frozen and shown by ``Plan.explain(stage=...)``; measured shapes are a field of
the plan's facts, never an attribute of a node, so a display plans the same before and
after a run; jobs are new records where a later stage decides something about them."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

import gradalg as ga
from gradalg.plan import DecisionKind
from gradalg.plan.decide import JobGraph
from gradalg.plan.facts import Facts, facts
from gradalg.plan.lower import Lowered
from gradalg.plan.planner import STAGES, PlanError, plan
from gradalg.plan.schedule import Schedule

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402


def cnn_scores():
    model = models.cnn()
    task = ga.tasks.classification(model)
    G = ga.grads(task, models.image_data(n=8), batch_size=4)
    Q = ga.grads(task, models.image_data(n=2, seed=5))
    return G, Q


def test_each_stage_is_a_frozen_record_shown_by_explain():
    G, Q = cnn_scores()
    S = Q @ ga.fisher(G).damp(0.1).inv() @ G.T
    p = plan(S.expr, measure_shapes=True)
    records = {"lower": Lowered, "facts": Facts, "decide": JobGraph, "schedule": Schedule}
    for stage, cls in records.items():
        assert isinstance(p.stages[stage], cls) and dataclasses.is_dataclass(p.stages[stage])
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(p.stages[stage], "x", 1)
    lines = {stage: p.explain(stage) for stage in STAGES}
    assert lines["lower"].startswith("scores of")
    assert "measured for a run" in lines["facts"] and "positions" in lines["facts"]
    assert "fisher" in lines["decide"] and "held side" in lines["decide"].lower()
    assert lines["schedule"].count("pass over") == len(p.passes)
    assert lines["size"].count(" held + ") == len(p.passes)
    for stage_pass, sized in zip(p.stages["schedule"].passes, p.passes):
        assert stage_pass.key == sized.key and stage_pass.batch_size is None     # size made new records
    with pytest.raises(PlanError, match="stages are lower, facts"):
        p.explain("costed")
    shown = str(S.explain(stage="decide"))      # the expression's explain() shows a planner stage too
    assert "planner stage decide" in shown and "held side" in shown.lower() and "1. logical" not in shown
    assert "planner stage schedule" in S.explain(stage="schedule")._repr_html_()


def test_measured_shapes_are_facts_not_node_attributes():
    """A display plan is the same before and after a measured plan (a run's): the
    measurement is in the run plan's facts, not cached on the source."""
    G, Q = cnn_scores()
    S = Q @ G.T
    before = plan(S.expr)
    run = plan(S.expr, measure_shapes=True)
    after = plan(S.expr)
    src = G.expr.source
    assert not hasattr(src, "_forward_shapes") and not hasattr(src, "_tokens_hint")
    kernels = [d.chosen for d in before.decisions.of(DecisionKind.KERNEL)]
    assert "when run" in kernels and kernels == [d.chosen for d in after.decisions.of(DecisionKind.KERNEL)]
    assert "when run" not in {d.chosen for d in run.decisions.of(DecisionKind.KERNEL)}
    assert run.stages["facts"].shapes[src.token].measured
    assert after.stages["facts"].shapes == {}
    # the facts stage alone, with a cache the caller owns
    memo = {}
    known = facts(run.simplified, run.options, run.device, measure=True, memo=memo)
    assert set(memo) == {G.expr.source.token, Q.expr.source.token} and known.shapes[src.token] == run.stages["facts"].shapes[src.token]


def test_jobs_are_new_records_not_modified():
    """The schedule and size stages return new jobs (release, normalization, cost); the
    decide stage's jobs keep their fields."""
    G, Q = cnn_scores()
    S = Q @ ga.kfac(G).damp(0.1).inv() @ G.normalize().T
    p = plan(S.expr, measure_shapes=True)
    graph = p.stages["decide"]
    scores = [j for j in graph.jobs.values() if j.kind == "scores"]
    assert scores and all(not j.release_held and not j.normalize_streamed and j.cost.flops == 0 for j in scores)
    planned = [j for step in p.passes for j in step.jobs if j.kind == "scores"]
    assert planned[0] is not scores[0] and planned[0].cost.flops > 0
    inside = p.decisions.one(DecisionKind.NORMALIZATION).chosen == "in the score kernel"
    assert planned[0].normalize_streamed == inside and planned[0].release_held
    assert p.jobs[planned[0].key].release_held      # plan.jobs holds the scheduled records


def test_a_pass_key_is_a_typed_record_compared_hashed_and_pickled():
    """A pass key names what the pass reads by field (no positions): equal keys (the same
    task and data, read by two jobs) share a pass, and keys survive the trips a plan makes
    (pickled to Dask workers, compared across torch.distributed ranks, exported as JSON)."""
    import json
    import pickle

    from gradalg.plan.passkeys import CapturedPassKey, DataPassKey, MemoryPassKey, PassKey, ProductsPassKey

    G, Q = cnn_scores()
    S = Q @ ga.fisher(G).damp(0.1).inv() @ G.T
    p = plan(S.expr)
    keys = [q.key for q in p.passes]
    assert keys and all(isinstance(k, PassKey) and dataclasses.is_dataclass(k) for k in keys)
    data = [k for k in keys if k.reads_data]
    assert {(k.task_name, k.n) for k in data} >= {(G.expr.task.name, 8), (Q.expr.task.name, 2)}
    assert all(q.label == q.key.label and f"({q.key.n:,} examples)" in q.label for q in p.passes if q.reads_data)
    assert pickle.loads(pickle.dumps(keys)) == keys and {k: 1 for k in keys}    # equal, hashable after a trip
    batch = [d for d in p.decisions if d.kind is DecisionKind.BATCH_SIZE]     # a decision about a pass
    assert batch and [d.subject for d in pickle.loads(pickle.dumps(batch))] == [d.subject for d in batch]
    with pytest.raises(dataclasses.FrozenInstanceError):
        keys[0].n = 1
    for key in keys:
        assert json.loads(json.dumps(key.to_data())) == [key.kind, *dataclasses.astuple(key)]
    # one record per kind, told apart by class and fields, never by position
    memory, captured = MemoryPassKey("t"), CapturedPassKey("t")
    assert memory != captured and len({memory, captured, MemoryPassKey("t")}) == 2
    assert (memory.kept, memory.rows, captured.kept, captured.rows) == ("t", "t", None, "t")
    products = ProductsPassKey("h", "task", 40, 9)
    assert products.per_call and not products.reads_data and products.kept is None
    assert products.label == "up to 9 passes over task (40 examples)"
    assert DataPassKey("a", "b", "task", 1200).label == "pass over task (1,200 examples)"
