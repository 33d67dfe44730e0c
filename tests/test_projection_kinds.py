"""The projection kinds' protocol (gradalg/proj/kinds.py, docs/contributing.md "A projection kind").

Every registered kind is instantiated and must implement every method of the protocol:
its kernel (``apply``), its estimate (``cost``), its tables' bytes and their build cost.
The kernel is run on a real layer block, as factors and as the same rows flat: the two
must agree, the map must be linear and not zero, and the output must have the shape the
kind's ``block_shape`` promises. A kind registered without a method is refused at
registration, and no ``kind == "..."`` ladder is left where a projector is planned or run.
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import gradalg as ga
from gradalg.capture.factors import Factors, materialize
from gradalg.errors import PlanError
from gradalg.plan.cost import Cost
from gradalg.plan.estimates import ProjectionPrices
from gradalg.proj.projector import KINDS
from gradalg.proj.kinds import REGISTRY, BlockRun, ProjectionKind, Rows, register
from gradalg.space import Block

ROOT = Path(__file__).resolve().parents[1] / "gradalg"
METHODS = ("apply", "cost", "table_bytes", "build_cost")
NAMES = list(REGISTRY)


def _projector(name: str) -> ga.proj.Projector:
    return ga.proj.Projector(name, 6, seed=3, per_block=REGISTRY[name].default_per_block)


def test_the_registry_is_the_projectors_vocabulary():
    assert tuple(REGISTRY) == KINDS == ("gaussian", "rademacher", "kron", "sparse", "mask", "grass",
                                                 "factgrass", "tensorsketch")
    with pytest.raises(ga.OptionError, match="unknown projector kind 'nope'"):
        ga.proj.Projector("nope", 4)


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_kind_implements_the_protocol(name):
    kind = REGISTRY[name]
    assert isinstance(kind, ProjectionKind) and not type(kind).__abstractmethods__
    for method in METHODS:     # its own, not the abstract base's
        assert getattr(type(kind), method) is not getattr(ProjectionKind, method), (name, method)
    p = _projector(name)
    assert p.kind_object is kind

    # the kernel on one (out, in) layer block: factors and the same rows flat agree
    gen = torch.Generator().manual_seed(0)
    n, T, out, n_in = 5, 3, 7, 4
    F = Factors(torch.randn(n, T, n_in, generator=gen, dtype=torch.float64),
                torch.randn(n, T, out, generator=gen, dtype=torch.float64))
    flat = materialize(F).flatten(1)
    block = Block("w", (out, n_in), "linear")
    run = BlockRun(((block.name, block.dim),))
    from_factors = kind.apply(p, block, F, run)
    if isinstance(from_factors, Factors):
        assert kind.keeps_factors
        from_factors = materialize(from_factors).flatten(1)
    y = kind.apply(p, block, flat, run)
    assert y.shape == (n, math.prod(p.block_shape(block.shape)))
    torch.testing.assert_close(from_factors, y, rtol=1e-9, atol=1e-12)
    assert y.abs().sum() > 0
    mixed = kind.apply(p, block, 2 * flat[:2] - flat[2:4], run)      # a fixed linear map
    torch.testing.assert_close(mixed, 2 * y[:2] - y[2:4], rtol=1e-9, atol=1e-12)

    # its estimate, tables and their build
    prices = ProjectionPrices(8)
    for factored in (True, False):
        c = kind.cost(p, block, Rows(n, n, 1, T, factored, block.dim), prices)
        assert isinstance(c, Cost) and c.flops + c.bytes + c.elementwise > 0, (name, factored)
    assert kind.table_bytes(p, block) >= 0
    assert isinstance(kind.build_cost(p, block, prices), Cost)


def test_every_concrete_kind_class_is_registered():
    """A kind class in gradalg/proj/kinds.py that is not abstract is reachable by a name."""
    def concrete(cls):
        for sub in cls.__subclasses__():
            yield from concrete(sub)
            if not sub.__abstractmethods__ and sub.__module__ == "gradalg.proj.kinds":
                yield sub
    registered = {type(kind) for kind in REGISTRY.values()}
    assert set(concrete(ProjectionKind)) == registered


def test_a_kind_that_leaves_out_a_method_is_refused_at_registration():
    class Half(ProjectionKind):
        def apply(self, p, block, value, run):
            return value

        def cost(self, p, b, rows, prices):
            return prices.counts()

    with pytest.raises(PlanError, match="Half does not implement build_cost, table_bytes"):
        register("half")(Half)
    assert "half" not in REGISTRY
    with pytest.raises(PlanError, match="'sparse' is registered twice"):
        register("sparse")(type(REGISTRY["sparse"]))


def _kind_ladders(path: Path) -> list[str]:
    """``x.kind == "..."`` / ``x.kind in ("...", ...)`` where x is a projector (``p``,
    ``projector``, ``self`` in projector.py, or ``….projector``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "kind"):
            continue
        owner = node.left.value
        names = {"p", "projector"} | ({"self"} if path.name == "projector.py" else set())
        if not ((isinstance(owner, ast.Name) and owner.id in names)
                or (isinstance(owner, ast.Attribute) and owner.attr == "projector")):
            continue
        consts = [c for comp in node.comparators for c in ([comp] if not isinstance(comp, ast.Tuple) else comp.elts)]
        if any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in consts):
            found.append(f"{path.parent.name}/{path.name}:{node.lineno}")
    return found


def test_no_projector_kind_ladder_where_projections_are_planned_or_run(tmp_path):
    files = [*(ROOT / "plan").rglob("*.py"), *(ROOT / "exec").rglob("*.py"), *(ROOT / "proj").glob("*.py"),
             ROOT / "expr" / "grads.py"]
    ladders = [hit for f in files for hit in _kind_ladders(f)]
    assert not ladders, f"dispatch on a projector's kind string: ask p.kind_object instead ({ladders})"
    probe = tmp_path / "probe.py"          # the scan sees a ladder when there is one
    probe.write_text('def f(p):\n    return p.kind == "kron" or p.projector.kind in ("mask", "grass")\n')
    assert len(_kind_ladders(probe)) == 2
