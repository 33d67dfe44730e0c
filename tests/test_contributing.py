"""The checklists of docs/contributing.md: a test that fails when a step of a recipe is missed.

"A method": every method of the registry (``@method`` in ``gradalg/methods/<name>.py``,
:data:`gradalg.methods.REGISTRY`) has a docstring with its formula, is in the command
line's table when it takes one task, train and queries, is on the docs catalogue page
(docs/api/methods.md), and runs ``explain()`` and ``compute()`` on a tiny model against a
dense reference: :data:`EXAMPLES` gives each its call and its dense formula. The tests are
parametrized over the registry, so a new method is covered as soon as it is registered,
and fails until its steps are done.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga
from gradalg.cli.config import METHODS as CLI_METHODS
from gradalg.methods import REGISTRY
from gradalg.testing.conformance import project_dense
from references import block_rows, one_thread  # noqa: F401 - one_thread is an autouse fixture

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
TOL = {"rtol": 1e-7, "atol": 1e-9}
NAMES = list(REGISTRY)
#: what a docstring's formula is written with (an inner product, a product, an inverse, a sum ...)
FORMULA_MARKS = ("@", "⟨", "Σ", "⁻¹", "∂", "√", "=")
#: methods that are not an expression over gradients, so have no plan to explain, and why
NO_EXPLAIN = {"magic": "replays a training run with exact metagradients (MagicScores): no gradient expression"}


# ------------------------------------------------------------------ the dense references
def _tm():
    import test_methods
    return test_methods


def _rows(s, proj=None):
    tm = _tm()
    space = ga.grads(s["task"], s["train"]).space
    return tm.project(s["RQ"], space, proj), tm.project(s["R"], space, proj), space


def _unit(R):
    return R / R.norm(dim=1, keepdim=True)


def _grad_dot():
    s = _tm().setup()
    return ga.methods.grad_dot(s["task"], s["train"], s["query"]), s["RQ"] @ s["R"].T


def _grad_cos():
    s = _tm().setup()
    return ga.methods.grad_cos(s["task"], s["train"], s["query"]), _unit(s["RQ"]) @ _unit(s["R"]).T


def _tracin():
    s = _tm().setup()
    S = ga.methods.tracin([s["task"], s["task"]], [0.1, 0.05], s["train"], s["query"])
    return S, 0.15 * s["RQ"] @ s["R"].T


def _influence():
    s = _tm().setup()
    S = ga.methods.influence(s["task"], s["train"], s["query"], curvature="empirical", damping=0.1)
    return S, _tm().influence_formula(s["RQ"], s["R"], s["R"], 0.1)


def _relatif():
    s = _tm().setup()
    S = ga.methods.relatif(s["task"], s["train"], s["query"], curvature="empirical", damping=0.1)
    H = s["R"].T @ s["R"] / len(s["R"]) + 0.1 * torch.eye(s["R"].shape[1], dtype=F64)
    HG = torch.linalg.solve(H, s["R"].T)                                  # (dim, n)
    return S, (s["RQ"] @ HG) / (s["R"] * HG.T).sum(1).sqrt()[None, :]


def _trak():
    s, P = _tm().setup(), ga.proj.gaussian(12, seed=3)
    return ga.methods.trak(s["task"], s["train"], s["query"], projector=P, damping=0.1), _tm().trak_formula(s, P, 0.1)


def _projected_gauss_newton(s, P, lam):
    """RQ Mᵀ (blockdiag(M GN Mᵀ) + λI)⁻¹ M RGᵀ, M the (k, dim) matrix of the projector P
    and GN the exact Gauss-Newton (per-class Jacobians, test_methods.exact_gauss_newton)."""
    tm = _tm()
    space = ga.grads(s["task"], s["train"]).space
    if P.kind == "kron":
        M = project_dense(torch.eye(space.dim, dtype=F64), space, P).T
    else:                                      # a sparse kind: its explicit matrix, block by block
        from test_sparse_projection import explicit_matrix
        M = torch.block_diag(*(explicit_matrix(P, b.name, b.shape) for b in space.blocks))
    H = M @ tm.exact_gauss_newton(s) @ M.T
    mask = torch.zeros_like(H, dtype=torch.bool)
    at = 0
    for b in P(ga.grads(s["task"], s["train"])).space.blocks:
        mask[at:at + b.dim, at:at + b.dim] = True
        at += b.dim
    H = torch.where(mask, H, torch.zeros_like(H)) + lam * torch.eye(H.shape[0], dtype=F64)
    return (s["RQ"] @ M.T) @ torch.linalg.solve(H, M @ s["R"].T)


def _logra():
    s = _tm().setup()
    S = ga.methods.logra(s["task"], s["train"], s["query"], k=4, seed=2, curvature="fisher", damping=0.1)
    return S, _projected_gauss_newton(s, ga.proj.kron(4, 2), 0.1)


def _grass():
    from gradalg.methods.grass import factgrass_projector
    s = _tm().setup()
    S = ga.methods.grass(s["task"], s["train"], s["query"], k=4, seed=2, damping=0.1)
    return S, _projected_gauss_newton(s, factgrass_projector(4, 2), 0.1)


def _less():
    tm = _tm()
    s, opt, space, st = tm.less_setting()
    groups = [0, 0, 1, 1]
    P = ga.proj.rademacher(24, 3)
    S = ga.methods.less([s["task"]], [opt], [1e-3], s["train"], s["query"], groups, projector=P)
    M = project_dense(torch.eye(space.dim, dtype=F64), space, P).T
    return S, tm.less_formula(s, space, st, M, groups)


def _trackstar():
    import test_trackstar as tt
    from models import classification_data, mlp
    X, y = classification_data(n=40, d_in=5, classes=3)
    model = mlp(d_in=5, hidden=4, classes=3, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), eps=1e-5, weight_decay=0.01)
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()
        opt.step()
    s = {"model": model, "opt": opt, "task": ga.tasks.classification(model),
         "train": (X[:24], y[:24]), "query": (X[24:30], y[24:30]), "task_data": (X[30:], y[30:])}
    P = ga.proj.gaussian(8, seed=1)
    S = ga.methods.trackstar(s["task"], s["train"], s["query"], optimizer=opt, layers=tt.LAYERS, projector=P)
    return S, torch.from_numpy(tt.reference(s, tt.projection_matrix(P, ga.grads(s["task"], s["train"], tt.LAYERS))))


def _magic():
    import test_unrolled as tu
    run = tu.TrainingRun(tu.mlp(), tu.ce, tu.TRAIN, tu.SGD(0.3), batch_size=4, epochs=1, seed=0)
    return ga.methods.magic(run, tu.QUERIES), -tu.finite_differences(run)       # τ = −∂f/∂ε


def _source():
    """One segment per step of full-batch GD on least squares: SOURCE is exact (test_unrolled)."""
    import test_unrolled as tu
    g = torch.Generator().manual_seed(4)
    X, y = torch.randn(10, 4, generator=g, dtype=F64), torch.randn(10, generator=g, dtype=F64)
    Xq, yq = torch.randn(3, 4, generator=g, dtype=F64), torch.randn(3, generator=g, dtype=F64)
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(F64)
    run = tu.TrainingRun(model, lambda m, b: 0.5 * (m(b[0]).squeeze(-1) - b[1]) ** 2, (X, y),
                         tu.SGD(0.2, weight_decay=0.05), batches=[list(range(10))] * 3)
    S = ga.methods.source(run, torch.utils.data.TensorDataset(Xq, yq), n_segments=3, curvature="gauss_newton",
                          task_fn=tu.regression_task)
    return S, torch.from_numpy(np.asarray(ga.methods.magic(run, (Xq, yq)).compute().values))


def _self_influence():
    s = _tm().setup()
    S = ga.methods.self_influence(ga.methods.grad_dot, s["task"], s["train"])
    return S, (s["R"] * s["R"]).sum(1)


#: each registered method's call on a tiny model and its dense reference (float64 formula
#: from loop-of-backward rows, or finite differences of retraining for MAGIC)
EXAMPLES = {"grad_dot": _grad_dot, "grad_cos": _grad_cos, "tracin": _tracin, "influence": _influence,
            "relatif": _relatif, "trak": _trak, "logra": _logra, "grass": _grass, "less": _less,
            "trackstar": _trackstar, "magic": _magic, "source": _source, "self_influence": _self_influence}


# ------------------------------------------------------------------ the checklist
def test_the_catalogue_is_the_registry():
    assert ga.methods.list() == {name: entry.summary for name, entry in REGISTRY.items()}
    for name, entry in REGISTRY.items():
        assert getattr(ga.methods, name) is entry.fn, f"ga.methods.{name} is not the registered function"
        assert name in ga.methods.__all__


@pytest.mark.parametrize("name", NAMES)
def test_docstring_has_the_formula(name):
    fn = REGISTRY[name].fn
    doc = inspect.getdoc(fn) or ""
    module_doc = inspect.getdoc(inspect.getmodule(fn)) or ""
    assert doc, f"ga.methods.{name} has no docstring: write its formula and arguments there"
    assert any(m in doc + module_doc for m in FORMULA_MARKS), (
        f"ga.methods.{name}'s docstring (or its module's) shows no formula: write S_qz = ... there")


def _takes_task_train_queries(fn) -> bool:
    params = list(inspect.signature(fn).parameters.values())
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return len(required) == 3 and required[0] in ("task", "tasks") and required[1:] == ["train", "queries"]


@pytest.mark.parametrize("name", NAMES)
def test_in_the_command_line_table_when_it_can_run_there(name):
    entry = REGISTRY[name]
    can = _takes_task_train_queries(entry.fn)
    assert entry.cli == can, (f"ga.methods.{name} {'takes' if can else 'does not take'} (task, train, queries) "
                              f"alone: register it with @method(..., cli={can})")
    assert (name in CLI_METHODS) == entry.cli


@pytest.mark.parametrize("name", NAMES)
def test_on_the_docs_catalogue_page(name):
    fn = REGISTRY[name].fn
    page = (ROOT / "docs" / "api" / "methods.md").read_text()
    assert f"::: {fn.__module__}.{fn.__name__}" in page, (
        f"docs/api/methods.md lacks ga.methods.{name}: add '::: {fn.__module__}.{fn.__name__}' "
        "with its heading and toc_label, as the others")


def test_every_method_has_an_example():
    missing = sorted(set(NAMES) - set(EXAMPLES))
    assert not missing, f"add a call and its dense reference to EXAMPLES in tests/test_contributing.py for {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_explains_and_computes_against_the_dense_reference(name):
    if name not in EXAMPLES:
        pytest.fail(f"no example for ga.methods.{name}: add one to EXAMPLES", pytrace=False)
    with ga.options(progress=False):
        S, want = EXAMPLES[name]()
        if name not in NO_EXPLAIN:
            assert str(S.explain()).strip()
        got = S.compute()
    np.testing.assert_allclose(np.asarray(got.values), np.asarray(want, dtype=np.float64), **TOL,
                               err_msg=f"ga.methods.{name} against its dense reference")


def test_the_method_recipe_runs_as_written():
    """docs/contributing.md's method example, executed as the file the page shows inside
    gradalg/methods/: it registers itself (catalogue, command line table) and equals Q Ĝᵀ."""
    import re
    import sys
    import types

    page = (ROOT / "docs" / "contributing.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "@method(" in c)
    module = types.ModuleType("gradalg.methods._recipe_example")
    module.__package__ = "gradalg.methods"
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, "docs/contributing.md", "exec", dont_inherit=True), module.__dict__)
        entry = REGISTRY["norm_dot"]
        assert entry.cli and _takes_task_train_queries(entry.fn)
        s = _tm().setup()
        S = entry.fn(s["task"], s["train"], s["query"])
        assert str(S.explain()).strip()
        np.testing.assert_allclose(np.asarray(S.compute().values), (s["RQ"] @ _unit(s["R"]).T).numpy(), **TOL)
    finally:
        REGISTRY.pop("norm_dot", None)
        sys.modules.pop(module.__name__, None)


# ------------------------------------------------------------------ a layer rule
#: what docs/contributing.md's "A layer rule" says every rule answers itself: the capture
#: hooks and the planner's facts (register_layer refuses a rule without one)
LAYER_STEPS = ("block_shape", "activations", "output_grads", "to_params", "from_params", "weight_gemm",
               "measured_kinds")


def _layer_recipe():
    """The layer-rule example of docs/contributing.md, executed as written (it registers
    its rule); returns its namespace. The caller removes the registration."""
    import re

    page = (ROOT / "docs" / "contributing.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "@register_layer(" in c)
    namespace: dict = {"__name__": "layer_recipe_example"}
    exec(compile(code, "docs/contributing.md", "exec", dont_inherit=True), namespace)
    return namespace


def test_the_layer_rule_recipe_runs_as_written():
    """The recipe's rule registers itself, captures its block number by number as
    torch.func does, and the planner prices its GEMM (forward and input gradient)."""
    from gradalg.capture import layers as L
    from gradalg.plan import estimates as E
    from gradalg.plan import shapes as S

    ns = _layer_recipe()
    module_type = ns["InOutLinear"]
    try:
        assert L.LAYER_RULES[module_type] is ns["InOutLinearRule"]
        torch.manual_seed(0)
        model = nn.Sequential(module_type(8, 6), nn.Tanh(), nn.Linear(6, 3).double())
        x, y = torch.randn(10, 8, dtype=F64), torch.randint(0, 3, (10,))
        task = ga.tasks.classification(model)
        G = ga.grads(task, (x, y), batch_size=4)
        assert [(b.name, b.kind, tuple(b.shape)) for b in G.space.blocks] == [("0", "inout", (6, 8)),
                                                                               ("2", "linear", (3, 7))]
        captured = G.to_params()
        reference = ga.per_example_grads(task, (x, y), list(captured), method="vmap")
        for name, ref in reference.items():
            torch.testing.assert_close(captured[name], ref, rtol=1e-9, atol=1e-12)
        assert S.weight_layers(model) == [(8, 6), (6, 3)]
        with ga.options(check_reduction=False) as opts:
            cost = E.capture_cost(G.expr, opts, F64)
        # three batches of 4 (batch_size=4): its forward and its input gradient GEMMs, (4, 6, 8) and (4, 8, 6)
        assert (4, 6, 8, 3, 8) in cost.gemms and (4, 8, 6, 3, 8) in cost.gemms
        assert "inout" in str(G.explain())
    finally:
        L.LAYER_RULES.pop(module_type, None)


@pytest.mark.parametrize("step", LAYER_STEPS)
def test_a_layer_rule_missing_a_step_is_refused_at_registration(step):
    """The recipe's rule with one hook or fact left out: refused by register_layer, naming
    it, before any model is captured or planned with it (not priced with no GEMM or T)."""
    from gradalg.capture import layers as L

    ns = _layer_recipe()
    module_type, rule = ns["InOutLinear"], ns["InOutLinearRule"]
    L.LAYER_RULES.pop(module_type, None)
    members = {k: v for k, v in rule.__dict__.items() if not k.startswith("__") and k != step}
    incomplete = type(f"Without_{step}", (L.LayerRule,), members)
    with pytest.raises(ga.errors.UnsupportedLayerError, match=step):
        L.register_layer(module_type)(incomplete)
    assert module_type not in L.LAYER_RULES


def test_every_registered_layer_rule_answers_every_step():
    """Each rule of the registry (the package's, and any registered since) states each
    step itself or through a base of its own, not LayerRule's default."""
    from gradalg.capture import layers as L

    for rule in set(L.LAYER_RULES.values()):
        L.check_rule(rule)
        assert not getattr(rule, "__abstractmethods__", None), rule.__name__


def test_the_layer_rule_recipe_names_every_hook():
    page = (ROOT / "docs" / "contributing.md").read_text()
    section = page.split("## A layer rule", 1)[1].split("\n## ", 1)[0]
    for step in LAYER_STEPS:
        assert f"`{step}" in section, step
