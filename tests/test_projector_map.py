"""The projector answers which flat-row map it applies (``Projector.map``), and the planner
asks it, not the kind's name: a dense map's (k, d) float64 matrix is refused over the memory
budget, and each projection with a map gets one "projection map" decision naming it.
Every kind of ``KINDS`` is checked, so a new kind that forgets the question is seen."""
from __future__ import annotations

import os
import sys

import pytest

import gradalg as ga
from gradalg.errors import MemoryBudgetError
from gradalg.expr.projection import KINDS, Projector
from gradalg.plan import DecisionKind
from gradalg.plan.decide import refuse_dense_projections
from gradalg.plan.memory import projection_map_decisions
from gradalg.options import get_options

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

EXPECTED = {"gaussian": "dense", "rademacher": "dense", "sparse": "sparse JL", "tensorsketch": "tensorsketch",
            "kron": None, "mask": None, "grass": None, "factgrass": None}


def _projector(kind: str) -> Projector:
    return Projector(kind, 4, 0, per_block=kind in ("kron", "mask", "grass", "factgrass"))


def test_every_kind_names_its_map():
    assert set(EXPECTED) == set(KINDS)
    assert {kind: _projector(kind).map for kind in KINDS} == EXPECTED


@pytest.mark.parametrize("kind", KINDS)
def test_the_dense_refusal_and_the_map_decision_follow_the_map(kind):
    task = ga.tasks.classification(models.mlp())
    G = ga.grads(task, models.classification_data(6, seed=1), ["0", "2"])
    node = _projector(kind)(G).expr
    d = G.expr.space.dim
    matrix = 4 * d * 8                               # the dense map's (k, d) float64 matrix
    if EXPECTED[kind] == "dense":
        with pytest.raises(MemoryBudgetError) as err:
            refuse_dense_projections(node, matrix - 1)
        assert err.value.needed == matrix
        refuse_dense_projections(node, matrix)      # within the budget
    else:
        refuse_dense_projections(node, matrix - 1)  # no matrix to refuse
    decisions = projection_map_decisions(node, get_options())
    assert [(x.kind, x.chosen) for x in decisions] == (
        [(DecisionKind.PROJECTION_MAP, EXPECTED[kind])] if EXPECTED[kind] else [])
