"""The operator protocol: every operator node type implements ``labels()``,
``statistics()``, ``resolve(ctx)`` and ``apply_cost(space, n, prices)``, with labels in
the one vocabulary of :mod:`gradalg.linalg.labels`, and an operator written outside the
package is one class that explains and computes like a built-in one.

The node types are found by walking ``OpNode``'s subclasses, so a new one is covered
without editing this file: it is built from its dataclass fields (an operator operand, a
gradient set, a space, numbers), or from ``EXAMPLES`` where its fields need more.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import typing
from dataclasses import dataclass

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from models import classification_data, mlp  # noqa: E402
from references import one_thread, reference_rows  # noqa: E402,F401 - one intra-op thread per test module

import gradalg as ga  # noqa: E402
from gradalg.exec.local import LocalExecutor  # noqa: E402
from gradalg.expr import GradNode, OpNode, Statistic  # noqa: E402
from gradalg.expr.spectral import UnrollDecay  # noqa: E402
from gradalg.expr.stored import StoredOp  # noqa: E402
from gradalg.linalg import VOCABULARY, Labels, LinearOp, ResolvedOp  # noqa: E402
from gradalg.linalg.labels import form_of  # noqa: E402
from gradalg.plan.cost import Cost  # noqa: E402
from gradalg.plan.estimates import OperatorPrices  # noqa: E402
from gradalg.plan.resolution import resolution_rules  # noqa: E402
from gradalg.plan.rules import PlanError  # noqa: E402
from gradalg.space import ParamSpace  # noqa: E402

F64 = torch.float64
PROTOCOL = ("labels", "statistics", "resolve", "apply_cost")


@pytest.fixture(scope="module")
def setting():
    task = ga.tasks.classification(mlp())
    X, y = classification_data(n=12)
    G = ga.grads(task, (X, y))
    return task, (X, y), G


def _subclasses(cls):
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


class _Store:
    """A stand-in operator store: ``load()`` gives the numbers."""

    def __init__(self, op):
        self.op, self.token, self.label = op, "store-test", "test store"

    def load(self):
        return self.op


def _examples(setting):
    """Builders of the node types whose fields a generic value cannot fill."""
    task, data, G = setting
    space = G.space
    return {
        "CurvatureProducts": lambda: ga.gauss_newton(task, data).expr,
        "AutoDamp": lambda: ga.fisher(G, "block").damp(ga.linalg.DampingRule("mass", 0.9)).expr,
        "Spectral": lambda: type_by_name("Spectral")(ga.fisher(G, "block").expr, UnrollDecay(0.1, 3)),
        "StoredOp": lambda: StoredOp(_Store(ResolvedOp(space, "diag", torch.ones(space.dim, dtype=F64))), space,
                                     "diag"),
    }


def type_by_name(name):
    return next(c for c in _subclasses(OpNode) if c.__name__ == name)


def _generic(cls, setting):
    """``cls`` built from its required fields, by annotation: an operator operand (a damped
    block Fisher), operands, a gradient set, its space, a vector or matrix on it, numbers."""
    _, _, G = setting
    space, hints = G.space, typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        hint = hints.get(f.name)
        if hint is OpNode:
            values[f.name] = ga.fisher(G, "block").damp(1.0).expr
        elif hint == tuple[OpNode, ...]:
            values[f.name] = (ga.fisher(G, "block").expr, ga.identity(G).expr)
        elif hint is GradNode:
            values[f.name] = G.expr
        elif hint is ParamSpace:
            values[f.name] = space
        elif hint is torch.Tensor:
            shape = (space.dim, space.dim) if "matrix" in f.name else (space.dim,)
            values[f.name] = torch.eye(space.dim, dtype=F64) if len(shape) == 2 else torch.ones(shape, dtype=F64)
        elif hint is float:
            values[f.name] = 0.5
        elif hint is int:
            values[f.name] = 2
        else:
            raise AssertionError(f"cannot build {cls.__name__}: field {f.name!r} ({hint}); add a builder to "
                                 "EXAMPLES in tests/test_node_protocol.py")
    return cls(**values)


def _instances(setting):
    examples = _examples(setting)
    types = [c for c in _subclasses(OpNode) if not inspect.isabstract(c) and c.__module__.startswith("gradalg.")]
    return [(c.__name__, examples[c.__name__]() if c.__name__ in examples else _generic(c, setting)) for c in types]


def test_every_operator_node_type_implements_the_protocol(setting):
    types = _subclasses(OpNode)
    assert len(types) >= 15, [t.__name__ for t in types]
    for cls in types:
        if cls.__module__.startswith("gradalg."):
            assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract"
        for name in PROTOCOL:
            assert callable(getattr(cls, name, None)), f"{cls.__name__} has no {name}()"


def test_a_node_type_that_forgets_a_method_cannot_be_built(setting):
    @dataclass(frozen=True, eq=False)
    class Forgetful(OpNode):
        space_: ParamSpace

        @property
        def space(self):
            return self.space_

        def labels(self):
            return Labels({"diagonal"})

    with pytest.raises(TypeError, match="abstract"):
        Forgetful(setting[2].space)


def test_every_node_type_labels_statistics_cost_and_resolution(setting):
    """Each type's labels are in the vocabulary; its statistics are Statistics; its apply
    cost is a Cost; resolved on the local executor, its LinearOp has the form and the rules
    its labels predicted."""
    _, _, G = setting
    space, prices = G.space, OperatorPrices(8, ga.get_options())
    seen = set()
    for name, node in _instances(setting):
        seen.add(name)
        labels = node.labels()
        assert isinstance(labels, Labels) and labels.labels <= VOCABULARY, (name, labels)
        assert all(isinstance(s, Statistic) for s in node.statistics()), name
        cost = node.apply_cost(node.space, 5, prices)
        assert isinstance(cost, Cost), name
        resolved = LocalExecutor().resolve(node)
        assert isinstance(resolved, LinearOp), name
        assert form_of(resolved.structure) == labels.form, (name, resolved.structure, labels)
        assert list(resolved.rules) == list(labels.rules) == resolution_rules(node), (name, resolved.rules)
        assert isinstance(node.structure, str) and ga.Operator(node).structure == node.structure
    assert {"Identity", "Diagonal", "Dense", "Fisher", "Damp", "Inverse", "Power", "ScaledOp", "SumOp", "KFAC",
            "Arnoldi", "DataInf", "CurvatureProducts", "Spectral", "StoredOp"} <= seen


def test_statistics_are_jobs_of_the_plan(setting):
    """A Fisher's and an EK-FAC's statistics are jobs of their plan's passes; DataInf's
    (read when applied) is a job applying it to the held rows (``apply``)."""
    task, data, G = setting
    Q = ga.grads(task, (data[0][:3], data[1][:3]))
    for H, kinds in ((ga.fisher(G, "block").damp(0.1).inv(), {"fisher"}),
                     (ga.ekfac(G).damp(0.1).inv(), {"kfac", "ekfac"}),
                     (ga.datainf(G, 0.1), {"apply"})):
        plan = LocalExecutor().plan((Q @ H @ G.T).expr)
        jobs = {key[0] for key in plan.jobs} - {"collect", "scores", "store"}
        assert jobs == kinds, (H, jobs)


# ---------------------------------------------------------------------- an operator from outside
@dataclass(frozen=True, eq=False)
class AdamSecondMoment(OpNode):
    """Adam's preconditioner from its second moments v (dim,): P = diag(√v + ε), so that
    Adam's step is P⁻¹ m. One class outside the package: the four methods of the protocol."""

    second_moment: torch.Tensor      # (dim,)
    space_: ParamSpace
    eps: float = 1e-8

    @property
    def space(self):
        return self.space_

    def labels(self):
        return Labels({"diagonal"})

    def statistics(self):
        return ()

    def resolve(self, ctx):
        return ResolvedOp(self.space, "diag", self.second_moment.to(F64).sqrt() + self.eps)

    def apply_cost(self, space, n, prices):
        return prices.by_form(self.labels(), space, n)

    @property
    def label(self):
        return f"adam √v+ε (ε={self.eps:g})"


def _adam_setting(setting):
    task, data, G = setting
    v = torch.rand(G.space.dim, generator=torch.Generator().manual_seed(5), dtype=F64) + 0.1
    H = ga.Operator(AdamSecondMoment(v, G.space))
    queries = (data[0][:3], data[1][:3])
    Q = ga.grads(task, queries)
    layers = G.space.names
    ref_q, ref_g = reference_rows(task, queries, layers), reference_rows(task, data, layers)
    expected = ref_q @ torch.diag(1.0 / (v.sqrt() + 1e-8)) @ ref_g.T
    return Q @ H.inv() @ G.T, expected


def test_an_operator_defined_outside_the_package_explains_and_computes(setting):
    S, expected = _adam_setting(setting)
    text = str(S.explain())
    assert "adam √v+ε" in text and "diagonal.reciprocal" in text
    torch.testing.assert_close(torch.as_tensor(S.compute().values), expected, rtol=1e-8, atol=1e-10)


def test_an_outside_operator_composes_by_the_rules_of_its_labels(setting):
    """Its algebra comes from its labels: the rules are listed before any pass, and equal
    the rules its resolved operator applied."""
    _, _, G = setting
    H = ga.Operator(AdamSecondMoment(torch.ones(G.space.dim, dtype=F64), G.space)).pow(0.5).damp(0.1)
    assert resolution_rules(H) == ["diagonal.elementwise_power", "diagonal.shift"]
    assert list(LocalExecutor().resolve(H.expr).rules) == resolution_rules(H)


def test_a_statistic_no_job_computes_is_refused_when_planned(setting):
    """No silent fall-through: a statistic of a kind the plan has no job for is refused
    with the kinds there are, before any pass."""
    task, data, G = setting

    @dataclass(frozen=True, eq=False)
    class Mystery(AdamSecondMoment):
        def statistics(self):
            return (Statistic("mystery", self, G.expr),)

    H = ga.Operator(Mystery(torch.ones(G.space.dim, dtype=F64), G.space))
    with pytest.raises(PlanError, match="'mystery'.*'ekfac', 'fisher', 'group', 'kfac'"):
        LocalExecutor().plan((G @ H @ G.T).expr)


def test_labels_outside_the_vocabulary_are_refused():
    with pytest.raises(ga.OperatorError, match="exactly one form"):
        Labels({"diagonal", "sparse"})
    with pytest.raises(ga.OperatorError, match="exactly one form"):
        Labels({"psd"})


@pytest.mark.slow
def test_an_outside_operator_runs_on_dask(setting):
    """The same scores on the Dask executor (2 worker processes): the operator's class is
    shipped with the plan (by value: this test module is not importable on the workers)."""
    pytest.importorskip("distributed")
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    S, expected = _adam_setting(setting)
    with ga.options(progress=False):
        ex = ga.exec.DaskExecutor(n_workers=2, threads_per_worker=1, min_shard_examples=1)
        try:
            got = S.compute(executor=ex)
            torch.testing.assert_close(torch.as_tensor(got.values), expected, rtol=1e-8, atol=1e-10)
        finally:
            ex.close()
            cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_the_contributing_recipe_runs_as_written(setting):
    """docs/contributing.md's operator example, executed as the page shows it (public API only)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "contributing.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "AdamSecondMoment" in c)
    task, data, G = setting
    v = torch.rand(G.space.dim, generator=torch.Generator().manual_seed(5), dtype=F64) + 0.1
    queries = (data[0][:3], data[1][:3])
    namespace = {"task": task, "train": data, "queries": queries, "v": v, "__name__": "recipe"}
    exec(compile(code, "docs/contributing.md", "exec", dont_inherit=True), namespace)
    layers = G.space.names
    expected = (reference_rows(task, queries, layers) @ torch.diag(1.0 / (v.sqrt() + 1e-8))
                @ reference_rows(task, data, layers).T)
    torch.testing.assert_close(torch.as_tensor(namespace["S"].compute().values), expected, rtol=1e-8, atol=1e-10)


@dataclass(frozen=True, eq=False)
class PlainSetAdam(AdamSecondMoment):
    """The same operator, its labels() written as a plain set of strings."""

    def labels(self):
        return {"diagonal"}


def test_labels_given_as_a_plain_set_are_read_as_labels(setting):
    """An outside operator whose labels() returns {"diagonal"} composes (damp, inverse, power)
    like one returning ga.Labels; anything else is refused naming the class and the fix."""
    task, data, G = setting
    v = torch.rand(G.space.dim, generator=torch.Generator().manual_seed(5), dtype=F64) + 0.1
    plain, typed = PlainSetAdam(v, G.space), AdamSecondMoment(v, G.space)
    assert plain.labels() == typed.labels()
    Q = ga.grads(task, (data[0][:3], data[1][:3]))
    got = (Q @ ga.Operator(plain).pow(0.5).damp(0.1).inv() @ G.T).compute().values
    want = (Q @ ga.Operator(typed).pow(0.5).damp(0.1).inv() @ G.T).compute().values
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-12, atol=0)

    @dataclass(frozen=True, eq=False)
    class Wrong(AdamSecondMoment):
        def labels(self):
            return 3

    with pytest.raises(ga.OperatorError, match=r"Wrong.labels\(\) returned int.*ga.Labels"):
        Wrong(v, G.space).labels()


def test_only_the_identity_says_it_preconditions_nothing(setting):
    """``OpNode.is_identity`` is the one question "is a score or chain with this operator
    unpreconditioned?": True for I only (c·I is tagged ``"identity"`` but changes the
    numbers), and plan/ and gradalg/store ask it instead of ``isinstance(op, Identity)``."""
    import ast
    from pathlib import Path

    import gradalg

    _, _, G = setting
    answers = {name: node.is_identity for name, node in _instances(setting)}
    assert {name for name, yes in answers.items() if yes} == {"Identity"}, answers
    I = ga.identity(G)
    assert I.expr.is_identity and not (2.0 * I).expr.is_identity
    assert "identity" in (2.0 * I).expr.labels()     # c·I: tagged, yet a preconditioner
    root = Path(gradalg.__file__).parent
    asked = [f"{path.relative_to(root)}: {ast.unparse(n)}"
             for sub in ("plan", "store") for path in sorted((root / sub).rglob("*.py"))
             for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "isinstance"
             and "Identity" in ast.unparse(n.args[1])]
    assert not asked, asked
