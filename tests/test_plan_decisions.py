"""The planner's decisions are typed records: a ``DecisionKind``, the subject's token (or a
pass key), the block, the winner, the alternatives and the reason. They are looked up by
field (``plan.decisions.of`` / ``.one``), rendered from their fields (no node ids in the
text), exported as plain data, immutable and picklable. Plus the typed errors of ``plan/``."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys

import pytest
import torch

import gradalg as ga
from gradalg.errors import ObjectiveError, OptionError
from gradalg.plan import Choices, Decision, DecisionKind, PlanError
from gradalg.plan.decisions import DecisionLookupError, Decisions
from gradalg.plan.passkeys import PassKey
from gradalg.devices import profile
from gradalg.plan.jobs import TopK
from gradalg.plan.planner import plan
from gradalg.plan.scale import scale_estimates

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread  # noqa: E402,F401 - an autouse fixture

LAYERS = ["0", "2"]


@pytest.fixture(scope="module")
def sides():
    task = ga.tasks.classification(models.mlp())
    G = ga.grads(task, models.classification_data(24, seed=1), LAYERS, batch_size=5)
    Q = ga.grads(task, models.classification_data(3, seed=2), LAYERS)
    return G, Q


def _plans(G, Q):
    """Plans that between them make every kind of decision."""
    P = ga.proj.gaussian(6, seed=0)
    with ga.options(kron_float64_width=4, kron_diagonal_width=12):
        kfac = plan((Q @ ga.ekfac(G).damp(0.1).inv() @ G.T).expr)
    from gradalg.exec import Executor
    from gradalg.plan.placement import Placement
    from test_shard_strategy import Halves

    class Thirds(Halves):    # a strategy that says how many shards a pass gets (as Dask does)
        def place(self, step):
            return Placement(True, "thirds", shards=3, weighed=(("fixed", "3"),)) if step.reads_data else \
                Placement(False, "rows in memory")
    placed = Executor(shards=Halves()).plan((Q @ G.T).expr)    # where each pass runs: a shard strategy's
    split = Executor(shards=Thirds()).plan((Q @ G.T).expr)     # and into how many shards
    # the formed Hessian or the Gauss-Newton, decided when run (a CURVATURE decision)
    near = ga.methods.influence(ga.tasks.classification(models.mlp()), models.classification_data(24, seed=1),
                                models.classification_data(3, seed=2), curvature="near_minimum")
    return [kfac, plan((Q @ G.normalize().T).expr), plan((P(Q) @ P(G).T).expr),
            plan((Q.low_rank(1) @ G.T).expr), placed, split, plan(near.expr),
            plan((Q @ ga.datainf(G, 0.1) @ Q.T).diag().expr)]     # DataInf's rows read in windows


def test_every_kind_is_made_and_every_subject_is_named(sides):
    G, Q = sides
    plans = _plans(G, Q)
    made = {d.kind for p in plans for d in p.decisions}
    assert made == set(DecisionKind), set(DecisionKind) - made
    for p in plans:
        tokens = {n.token for tree in (p.logical, p.simplified) for n in tree.walk()}
        projectors = {n.projector.token for n in p.simplified.walk() if hasattr(n, "projector")}
        keys = {q.key for q in p.passes}
        for d in p.decisions:
            assert isinstance(d, Decision) and isinstance(d.kind, DecisionKind)
            if d.kind in (DecisionKind.BATCH_SIZE, DecisionKind.TRIM):
                assert d.subject in keys
            elif d.kind in (DecisionKind.PLACEMENT, DecisionKind.SHARDS):
                index, key = d.subject
                assert p.passes[index].key == key
            elif d.kind is DecisionKind.PROJECTION_MAP:
                assert d.subject in projectors
            else:
                assert d.subject in tokens, d
            assert (d.block is not None) == (d.kind in (DecisionKind.KERNEL, DecisionKind.KRON_PRECISION,
                                                        DecisionKind.KRON_DIAGONAL))
            assert d.block is None or d.block in LAYERS
            assert d.chosen and d.reason and d.alternatives
            assert "[" not in d.title()          # no node id pasted into the title


def test_lookup_by_field(sides):
    G, Q = sides
    p = plan((Q @ G.T).expr)
    kernels = p.decisions.of(DecisionKind.KERNEL)
    assert [d.block for d in kernels] == LAYERS and all(d.subject == p.simplified.token for d in kernels)
    assert p.decisions.one(DecisionKind.KERNEL, block="2") is kernels[1]
    assert p.decisions.one(DecisionKind.HELD_SIDE, subject=p.simplified.token).chosen == "left (query) rows"
    assert p.decisions.of(DecisionKind.STORE) == []
    with pytest.raises(DecisionLookupError, match="2 decisions of kind KERNEL") as err:
        p.decisions.one(DecisionKind.KERNEL)
    assert isinstance(err.value, KeyError) and isinstance(err.value, PlanError)
    with pytest.raises(KeyError, match="0 decisions of kind STORE.*pass block= or subject="):
        p.decisions.one(DecisionKind.STORE)
    # nearly valid lookups work: a kind's name in any case, a block index as an int
    assert p.decisions.of("kernel") == p.decisions.of("KERNEL") == kernels
    assert p.decisions.one("kernel", block=2) is kernels[1]
    with pytest.raises(PlanError, match="no decision kind 'kernels'.*DecisionKind.{HELD_SIDE"):
        p.decisions.of("kernels")           # a typo is refused, not an empty list


def test_a_decision_is_immutable_and_picklable(sides):
    G, Q = sides
    p = plan((Q @ G.T).expr)
    d = p.decisions.one(DecisionKind.KERNEL, block="0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.chosen = "dense"
    with pytest.raises(TypeError):
        d.alternatives["ghost"] = 0.0
    back = pickle.loads(pickle.dumps(p.decisions))
    assert isinstance(back, Decisions) and back == p.decisions
    with pytest.raises(PlanError, match="no decision kind"):
        Decision("kernl", "x", "ghost", {})
    assert Decision("kernel", "x", "ghost", {}).kind is DecisionKind.KERNEL


def test_text_html_and_dict_are_rendered_from_the_fields(sides):
    G, Q = sides
    S = Q @ ga.fisher(G).damp(0.1).inv() @ G.T
    ex = S.explain()
    rows = ex.decisions()
    assert [r["kind"] for r in rows] == [d.kind.name.lower() for d in ex.plan.decisions]
    for row, d in zip(rows, ex.plan.decisions):
        assert (row["block"], row["chosen"], row["reason"]) == (d.block, d.chosen, d.reason)
        assert row["subject"] == (d.subject.to_data() if isinstance(d.subject, PassKey) else d.subject)
        json.dumps(row["subject"])   # plain data (a pass key as [kind, *fields])
        if d.kind is DecisionKind.KERNEL:   # the block named by path, kind and shape
            assert row["what"] == f"kernel for block {d.block} (linear {'16×9' if d.block == '0' else '3×17'}) of " \
                                  f"{d.label}"
        else:
            assert row["what"] == d.title()
    text, html = str(ex), ex._repr_html_()
    for d in ex.plan.decisions:
        assert d.subject not in text if isinstance(d.subject, str) else True   # no node ids shown
        assert d.reason in text
    assert "costed decisions" in html
    assert ex.to_dict()["decisions"] == rows


def test_plan_error_is_one_class_everywhere():
    import gradalg.errors
    import gradalg.plan.planner
    import gradalg.plan.rules
    assert PlanError is gradalg.errors.PlanError is gradalg.plan.rules.PlanError is gradalg.plan.planner.PlanError
    assert issubclass(PlanError, ga.GradalgError) and issubclass(PlanError, RuntimeError)


@pytest.mark.parametrize("make, match", [
    (lambda: Choices(held="both"), r"held=\.\.\.\) must be one of"),
    (lambda: Choices(store=1), r"store=\.\.\.\) must be one of"),
    (lambda: TopK(0), "k must be a positive integer"),
    (lambda: TopK("3"), "k must be a positive integer"),
    (lambda: profile("cpu", count="four"), "count must be a positive integer"),
    (lambda: profile("cpu", count=0), "count must be a positive integer"),
    (lambda: profile("cuda:x"), "unknown device"),
    (lambda: profile("tpu"), "unknown device"),
    (lambda: profile(torch.device("meta")), "no profile for a model on meta"),
])
def test_bad_planner_arguments_raise_option_errors(make, match):
    with pytest.raises(OptionError, match=match) as err:
        make()
    assert isinstance(err.value, ValueError)        # callers catching ValueError still do


def test_the_fixes_the_messages_name_work(sides):
    G, Q = sides
    assert Choices(held="left").held == "left" and TopK(3).k == 3
    assert profile("cpu", count=2).count == 2 and profile("cpu", count=2.0).count == 2
    p = plan((Q @ G.T).expr)
    with pytest.raises(OptionError, match="GPU counts must be positive integers"):
        scale_estimates(p, ("x",), "h200")
    assert [r["gpus"] for r in scale_estimates(p, (1, 4), "h200")] == [1, 4]


def test_scoring_expected_gradients_is_an_objective_error():
    task = ga.tasks.classification(models.mlp())
    data = models.classification_data(6, seed=1)
    E = ga.grads(task, data, LAYERS, objective="expected")
    with pytest.raises(ObjectiveError, match="objective='expected'.*objective='loss'"):
        plan((E @ E.T).expr)
    plan((ga.grads(task, data, LAYERS) @ ga.grads(task, data, LAYERS).T).expr)   # the fix: per-example rows
