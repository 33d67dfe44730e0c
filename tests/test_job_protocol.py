"""Every registered job type is one class that answers the planner and the executor
itself: built from real plans and run through the pass runner, each class prices its
work and bytes with its own methods (the base raises, so no type is priced or run like
another) and makes an accumulator that satisfies the :class:`Accumulator` protocol."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

import gradalg as ga
from gradalg.errors import OptionError
from gradalg.plan.jobs import JOB_TYPES, Accumulator, Job, ScoresJob, TopK, job_type
from gradalg.plan.shapes import ModelFacts

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

LAYERS = ["0", "2"]

#: what a job type answers, and the hook of the base's template that may answer it instead
PLANNING = {"stream_cost": "chunk_cost", "per_example_bytes": "example_bytes", "fixed_bytes": None,
            "output_bytes": None}
RUNNING = ("accumulator", "publish")


def _subclasses(cls=Job):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _own(cls, method: str) -> bool:
    return getattr(cls, method) is not getattr(Job, method)


def test_every_job_class_is_registered_by_its_kind():
    concrete = [c for c in _subclasses() if "kind" in c.__dict__]
    assert concrete and set(concrete) == set(JOB_TYPES.values())
    for kind, cls in JOB_TYPES.items():
        assert cls.kind == kind and job_type(kind) is cls
        for method, hook in PLANNING.items():
            assert _own(cls, method) or (hook and _own(cls, hook)), (cls.__name__, method)
        for method in RUNNING:
            assert _own(cls, method), (cls.__name__, method)
    with pytest.raises(OptionError, match=r"unknown job kind 'nope': job_type\(kind\) takes one of \[.*'scores'"):
        job_type("nope")
    with pytest.raises(TypeError, match="instance of its class"):   # the old string-typed constructor
        ScoresJob("scores", None)
    # the base refuses rather than pricing or running an unknown job like another
    for method, args in (("chunk_cost", (None, 1, {}, 4)), ("fixed_bytes", (None,)), ("example_bytes", (None,)),
                         ("output_bytes", (1,)), ("accumulator", (None,)), ("publish", (None, None))):
        with pytest.raises(NotImplementedError, match=method):
            getattr(Job, method)(object(), *args)


#: the schedule stage's questions, and the kinds whose class answers one other than the
#: base's default (all off): the scheduler asks the job, never its type
SCHEDULING = {"can_wait": {"collect", "store"}, "collects": {"collect", "store", "group"}, "store_refused": {"topk"},
              "normalized": {"scores", "topk"}, "can_release_held": {"scores"}}


def test_the_schedule_asks_the_job_not_its_type():
    import gradalg.plan.schedule as schedule

    for hook, kinds in SCHEDULING.items():
        assert {k for k, cls in JOB_TYPES.items() if _own(cls, hook)} == kinds, hook
    assert {k for k, cls in JOB_TYPES.items() if cls.reads_stored_factors} == {"kfac"}
    asked = _asked_about(schedule)
    assert not [a for a in asked if a.endswith("Job") or "Job," in a], asked   # no job class is asked about


def _asked_about(module) -> list[str]:
    """The second argument of every ``isinstance`` and the first of every ``getattr`` call
    in ``module``'s source."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(module.__file__).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("isinstance", "getattr")]
    return [ast.unparse(n.args[1] if n.func.id == "isinstance" else n.args[0]) for n in calls]


#: the size stage's questions (methods), and the kinds whose class answers one itself
SIZING = {"keeping_held_rows": {"scores"}, "applied_ops": {"diag", "scores", "topk", "apply"}}


def test_the_size_stage_asks_the_job_not_its_type():
    """The size stage asks each job what it holds and applies: which kinds answer each
    question is pinned, a class with a ``release_held`` field must say how it is sized
    holding its raw rows (a forgotten override would size a released side once), and
    size.py names no job class in ``isinstance`` nor reads a job's fields by ``getattr``."""
    import dataclasses

    import gradalg.plan.size as size

    for hook, kinds in SIZING.items():
        assert {k for k, cls in JOB_TYPES.items() if _own(cls, hook)} == kinds, hook
    for kind, cls in JOB_TYPES.items():
        if "release_held" in {f.name for f in dataclasses.fields(cls)}:
            assert _own(cls, "keeping_held_rows"), kind
    assert {k for k, cls in JOB_TYPES.items() if not cls.shrinks_with_queries} == {"fisher", "kfac", "ekfac", "store"}
    assert {k for k, cls in JOB_TYPES.items() if cls.streamed_back} == {"store"}
    asked = _asked_about(size)
    assert not [a for a in asked if a.endswith("Job") or "Job," in a or a in ("j", "job")], asked


def test_a_cluster_executor_asks_the_job_how_its_shards_return():
    """Dask keeps a scores job's shard states as column blocks of a lazy array and absorbs
    every other job's (``shards_are_blocks``); exec/dask.py names no job class."""
    import gradalg.exec.dask as dask_executor

    assert {k for k, cls in JOB_TYPES.items() if cls.shards_are_blocks} == {"scores"}
    assert not [a for a in _asked_about(dask_executor) if a.endswith("Job") or "Job," in a]


@pytest.fixture(scope="module")
def instances():
    """Every job a set of small plans builds and runs, with the accumulator each opened:
    ``{class: [(job, accumulator), ...]}``."""
    model = models.mlp()
    task = ga.tasks.classification(model)
    train, query = models.classification_data(12, seed=1), models.classification_data(3, seed=2)
    G, Q = ga.grads(task, train, LAYERS, batch_size=5), ga.grads(task, query, LAYERS, batch_size=5)
    opened: dict[type, list] = {}

    def recording(real):
        def accumulator(job, ctx):
            acc = real(job, ctx)
            opened.setdefault(type(job), []).append((job, acc))
            return acc
        return accumulator

    mp = pytest.MonkeyPatch()
    for cls in {Job, *JOB_TYPES.values()}:     # each class that defines its own (a subclass may inherit it)
        if "accumulator" in vars(cls):
            mp.setattr(cls, "accumulator", recording(vars(cls)["accumulator"]))
    try:
        ex = ga.LocalExecutor()
        (Q @ ga.fisher(G).damp(0.1).inv() @ G.T).compute(executor=ex)     # collect, fisher, store, scores
        (Q @ G.group_mean([i % 4 for i in range(12)]).T).compute(executor=ex)   # group
        ex.operator(ga.ekfac(G).expr)                                      # kfac, ekfac
        (G @ G.T).diag().compute(executor=ex)                              # diag
        ex.topk((Q @ G.T).expr, TopK(2))                                   # topk
        (Q @ ga.datainf(G, 0.1) @ G.T).compute(executor=ex)                # apply (DataInf's read of its rows)
        H = ga.gauss_newton(task, train, LAYERS)
        (Q @ H.damp(0.1).inv(method="cg", max_iter=3) @ G.T).compute(executor=ex)   # products (CG's)
    finally:
        mp.undo()
    return opened


def test_every_job_class_prices_and_runs_itself(instances):
    assert set(instances) == set(JOB_TYPES.values()), sorted(c.__name__ for c in set(JOB_TYPES.values()) - set(instances))
    for cls, pairs in instances.items():
        for job, acc in pairs:
            assert isinstance(acc, Accumulator), cls.__name__
            layout = {b.name: "factors" for b in job.streams[0].space.blocks} if job.streams else {}
            facts = ModelFacts(dtype=torch.float64)     # nothing measured: every layer at tokens_hint
            cost = job.stream_cost(12, 5, facts, lambda node: layout, lambda node: {}, ga.get_options(), set())
            for number in (cost.flops, cost.bytes, job.fixed_bytes(facts),
                           job.per_example_bytes(facts), job.output_bytes(12)):
                assert math.isfinite(number) and number >= 0, (cls.__name__, number)
            # a job is fed chunks of its streams, or runs a pass of its own (products: raw batches per call)
            assert (job.fed or job.pass_key()) and job.phase and job.describe()


def test_release_of_held_rows_is_decided_by_the_planner():
    """A scores job drops its raw held rows once preconditioned (``release_held``) when the
    schedule stage says so; an executor whose shards open the jobs again (its strategy's
    ``keeps_held_rows``) gets a plan that keeps them, and the run follows the plan."""
    from gradalg.exec import Executor, InProcess

    class Reopening(InProcess):
        keeps_held_rows = True

    model = models.mlp()
    task = ga.tasks.classification(model)
    G = ga.grads(task, models.classification_data(12, seed=1), LAYERS, batch_size=5)
    Q = ga.grads(task, models.classification_data(3, seed=2), LAYERS, batch_size=5)
    S = Q @ ga.kfac(G).damp(0.1).inv() @ G.T
    runs = {}
    for name, ex in (("released", ga.LocalExecutor()), ("kept", Executor(shards=Reopening()))):
        p = ex.plan(S.expr)
        scores = [j for j in p.jobs.values() if isinstance(j, ScoresJob)]
        assert scores and all(j.release_held == (name == "released") for j in scores), name
        assert not any(j.keeping_held_rows().release_held for j in scores)    # sized holding them
        runs[name] = torch.as_tensor(S.compute(executor=ex).values)
        assert (Q.expr.token in ex.state.rows) == (name == "kept")
    torch.testing.assert_close(runs["released"], runs["kept"], rtol=0, atol=0)


def test_every_stream_root_is_read_by_a_pass_or_made_by_a_job():
    """A gradient node that is not derived row by row (a stream root) is read by a pass
    (from data: ``Source``; kept rows: ``Captured``) or says, by ``statistics()``, which
    registered job makes its rows first (a group mean's ``"group"``): a new root type
    that forgets to say so fails here instead of being planned as rows that never exist.
    decide.py names no node class in ``isinstance`` to find them."""
    import inspect

    import gradalg.plan.decide as decide
    from gradalg.expr import Captured, GradNode, GroupMean, RowWise, Source
    from gradalg.plan.lower import STATISTICS_JOBS

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    roots = {c for c in subclasses(GradNode) if not issubclass(c, RowWise) and not inspect.isabstract(c)}
    made = {c for c in roots if not issubclass(c, (Source, Captured))}
    assert GroupMean in made
    for cls in made:
        assert cls.statistics is not GradNode.statistics, cls.__name__
    for cls in roots - made:
        assert cls.statistics is GradNode.statistics, cls.__name__   # read by a pass: nothing first
    G = ga.grads(ga.tasks.classification(models.mlp()), models.classification_data(6, seed=1), LAYERS)
    (statistic,) = G.group_mean([0, 1, 0, 1, 2, 2]).expr.statistics()
    assert statistic.job in STATISTICS_JOBS and statistic.rows is G.expr
    assert STATISTICS_JOBS[statistic.job].for_statistic(statistic, set()).collects(statistic.node.token)
    assert "GroupMean" not in _asked_about(decide)
