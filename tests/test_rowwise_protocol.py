"""The row-wise protocol: every row-wise node type (``gradalg.expr.RowWise``) implements
``apply(chunk, ctx)``, ``row_cost(n, chunk, prices)``, ``restrict(data, a, b)``,
``first_examples(n)`` and ``representation``; the planner and the executors call only these.

The types are found by walking ``RowWise``'s subclasses, so a new one fails here until it
has a builder in ``BUILDERS``; each is computed on the local executor, whole and restricted
to a shard of its rows, against the rows of the gradients it is built from.
"""
from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from models import classification_data, mlp  # noqa: E402
from references import one_thread  # noqa: E402,F401 - one intra-op thread per test module

import gradalg as ga  # noqa: E402
from gradalg.api import GradientSet  # noqa: E402
from gradalg.expr import (AdamPrecondition, AdamState, GradNode, LowRank, Normalize,  # noqa: E402
                          PerToken, Precondition, Project, RowWise, ScaleRows, Select)
from gradalg.expr.grads import first_examples  # noqa: E402
from gradalg.plan.cost import Cost  # noqa: E402
from gradalg.plan.estimates import rowwise_cost  # noqa: E402
from gradalg.plan.planner import ROW_WISE  # noqa: E402

F64 = torch.float64
PROTOCOL = ("apply", "row_cost", "restrict", "first_examples")


@pytest.fixture(scope="module")
def setting():
    task = ga.tasks.classification(mlp())
    X, y = classification_data(n=12)
    return ga.grads(task, (X, y))


def _subclasses(cls):
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


def _types():
    return [c for c in _subclasses(RowWise) if not inspect.isabstract(c) and c.__module__.startswith("gradalg.")
            and not c.__name__.startswith("_")]


def _adam(G):
    d = G.space.dim
    return AdamState(torch.linspace(-1, 1, d, dtype=F64), torch.linspace(0.1, 2, d, dtype=F64), 0.9, 0.999, 1e-8)


#: {type name: (builder of a node over G, reference of its rows from G's dense rows (or None))}
BUILDERS = {
    "Project": (lambda G: Project(G.expr, ga.proj.gaussian(6)), None),
    "Normalize": (lambda G: Normalize(G.expr),
                  lambda G, x: x / x.norm(dim=1, keepdim=True)),
    "AdamPrecondition": (lambda G: AdamPrecondition(G.expr, _adam(G)),
                         lambda G, x: _adam_rows(_adam(G), x)),
    "Select": (lambda G: Select(G.expr, (G.space.blocks[0].name,)), None),
    "Precondition": (lambda G: Precondition(G.expr, ga.fisher(G, "block").damp(1.0).expr), None),
    "ScaleRows": (lambda G: ScaleRows(G.expr, 0.5), lambda G, x: 0.5 * x),
    "LowRank": (lambda G: LowRank(G.expr, 1), None),
    "PerToken": (lambda G: PerToken(G.expr, 1), lambda G, x: x),
}


def _adam_rows(state, x):
    m = state.beta1 * state.exp_avg + (1 - state.beta1) * x
    v = state.beta2 * state.exp_avg_sq + (1 - state.beta2) * x * x
    return m / (v.sqrt() + state.eps)


def _flat(node_or_set) -> torch.Tensor:
    """(n, d) rows, blocks concatenated in space order."""
    gs = node_or_set if isinstance(node_or_set, GradientSet) else GradientSet(node_or_set)
    rows = gs.to_dense()
    return torch.cat([rows[b.name].reshape(len(gs), -1).to(F64) for b in gs.expr.space.blocks], dim=1)


def test_every_row_wise_node_type_implements_the_protocol():
    types = _types()
    assert len(types) >= 8, [t.__name__ for t in types]
    assert ROW_WISE is RowWise
    for cls in types:
        for name in PROTOCOL:
            assert callable(getattr(cls, name, None)), f"{cls.__name__} has no {name}()"
        assert cls.__name__ in BUILDERS, f"add a builder of {cls.__name__} to BUILDERS in {__file__}"


def test_a_row_wise_type_that_forgets_a_method_cannot_be_built(setting):
    @dataclass(frozen=True, eq=False)
    class Forgetful(RowWise):
        grads: GradNode

        space = property(lambda self: self.grads.space)
        n = property(lambda self: self.grads.n)
        ids = property(lambda self: self.grads.ids)
        representation = property(lambda self: self.grads.representation)

        def apply(self, chunk, ctx):
            return chunk

    with pytest.raises(TypeError, match="abstract"):
        Forgetful(setting.expr)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_each_row_wise_type_computes_restricts_and_costs(setting, name):
    """Its rows (from ``apply``) equal the reference; restricted to examples 3:9 they equal
    rows 3:9 of the whole; its cost is a Cost, through ``rowwise_cost``; the first 5
    examples are a prefix of its Source (per-token rows are refused)."""
    G = setting
    build, reference = BUILDERS[name]
    node = build(G)
    whole = _flat(node)
    assert whole.shape[0] == node.n
    if reference is not None:
        torch.testing.assert_close(whole, reference(G, _flat(G)), rtol=1e-6, atol=1e-8)
    token = G.expr.data.token
    part = node.restrict(token, 3, 9)
    assert type(part) is type(node) and part.n == 6 * node.n // G.n
    assert node.restrict("another dataset", 3, 9) is node
    torch.testing.assert_close(_flat(part), whole[3 * node.n // G.n: 9 * node.n // G.n], rtol=1e-6, atol=1e-8)
    layout = {b.name: "factors" for b in G.space.blocks}
    cost = rowwise_cost(node, G.n, 4, layout, elem=8)
    assert isinstance(cost, Cost) and cost.flops >= 0 and cost.bytes >= 0
    if isinstance(node, PerToken):
        with pytest.raises(ValueError, match="first 5 examples"):
            first_examples(node, 5)
    else:
        assert first_examples(node, 5).n == 5
