"""A refusal for memory names the fix the way the budget was given, and the fix plans.

A budget comes from ``ga.options(memory_budget=...)``, from ``explain(memory_budget=...)``
(which ``ga.options`` would not override) or from the ``gradalg`` command's options
(``--set options.memory_budget=...``); a machine budget's fraction from ``ga.options`` or
the command. Every refusal (the planner's note, the Fisher's statistics check, a pass over
its budget) names that way and no other, and each suggested fix, applied as written, plans.
"""
from __future__ import annotations

import re

import pytest
import torch

import gradalg as ga
from gradalg.plan.budget import Budget, budget_setting, refusal_note, resolve_budget
from gradalg.plan.planner import plan

FIX = re.compile(r"(ga\.options|explain)\((memory_budget|memory_fraction)=('[^']+'|[0-9][0-9.e-]*)\)")
CLI_FIX = re.compile(r"--set (options\.(?:memory_budget|memory_fraction)=\S+?)(?=[.;,]? |\.?$)")


@pytest.fixture(scope="module")
def setting():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    X, y = torch.randn(20, 8), torch.randint(0, 4, (20,))
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, (X, y)), ga.grads(task, (X[:3], y[:3]))
    dense = Q @ ga.fisher(G).damp(1e-3).inv() @ G.T      # a dense Fisher of d = 36: 10.4 kB
    return dense, Q @ G.T


def _refusal(call) -> str:
    with pytest.raises(ga.MemoryBudgetError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("which", [0, 1], ids=["fisher_statistics", "held_rows"])
def test_a_budget_given_to_ga_options_is_changed_there(setting, which):
    S = setting[which]
    with ga.options(memory_budget=10_000 if which == 0 else 200):
        msg = _refusal(S.explain)
    assert "explain(" not in msg, msg
    fixes = FIX.findall(msg)
    assert fixes and all(call == "ga.options" for call, _, _ in fixes), msg
    for call, name, value in fixes:
        with ga.options(**{name: eval(value)}):           # the fix, as written, plans
            plan(S.expr)


@pytest.mark.parametrize("which", [0, 1], ids=["fisher_statistics", "held_rows"])
def test_a_budget_given_to_explain_is_changed_there(setting, which):
    """``explain(memory_budget=...)`` wins over ``ga.options``: a fix written as
    ``ga.options(memory_budget=...)`` would change nothing (the message said so before,
    in the statistics check's fixes and in every pass's refusal)."""
    S = setting[which]
    msg = _refusal(lambda: S.explain(memory_budget=10_000 if which == 0 else 200))
    assert "ga.options(memory_budget" not in msg and "(explain(memory_budget=...))" in msg, msg
    [(call, name, value)] = FIX.findall(msg)
    assert (call, name) == ("explain", "memory_budget"), msg
    S.explain(memory_budget=eval(value))                 # the fix, as written, plans


def test_the_command_lines_budget_is_changed_with_set(setting, monkeypatch, tmp_path):
    """Under the ``gradalg`` command (``budget_setting("cli")``, which its options enter)
    the fixes are ``--set options.<name>=<value>``, parsed as the command parses them."""
    from gradalg.plan import budget as B
    pytest.importorskip("pydantic")
    from gradalg.cli.config import parse_override

    S = setting[0]
    with budget_setting("cli"), ga.options(memory_budget=10_000):
        msg = _refusal(S.explain)
        assert resolve_budget(ga.get_options()).setting == "cli"
    assert "ga.options(" not in msg and "(--set options.memory_budget)" in msg, msg
    [fix] = CLI_FIX.findall(msg)
    key, value = parse_override(fix)
    assert key == "options.memory_budget"
    with ga.options(memory_budget=value):
        plan(S.expr)
    # a machine budget: its fraction is set the same way
    (tmp_path / "meminfo").write_text("MemAvailable:       8000 kB\n")       # 8.19 MB available
    monkeypatch.setattr(B, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(B, "cgroup_room", lambda *a, **k: None)
    with budget_setting("cli"), ga.options(memory_budget=None, memory_fraction=0.001):
        msg = _refusal(lambda: plan(S.expr))
    fixes = dict(parse_override(f) for f in CLI_FIX.findall(msg))
    assert set(fixes) == {"options.memory_budget", "options.memory_fraction"}, msg
    with ga.options(memory_budget=None, memory_fraction=fixes["options.memory_fraction"]):
        plan(S.expr)


def test_each_setting_writes_its_fix():
    """The three settings side by side, and a wrong one refused."""
    given = {s: Budget(100, "x", 0.5, 200.0, setting=s) for s in ("ga.options", "explain", "cli")}
    assert given["ga.options"].change("memory_budget", "1MB") == "ga.options(memory_budget='1MB')"
    assert given["explain"].change("memory_budget", "1MB") == "explain(memory_budget='1MB')"
    assert given["explain"].change("memory_fraction", 0.3) == "ga.options(memory_fraction=0.3)"
    assert given["cli"].change("memory_budget", "1MB") == "--set options.memory_budget=1MB"
    assert given["cli"].change("memory_fraction") == "--set options.memory_fraction=..."
    assert "change it with --set options.memory_budget=8GB" in refusal_note(given["cli"])
    with pytest.raises(ga.errors.PlanError, match="setting"):
        Budget(1, "x", setting="toml")
    with pytest.raises(ga.errors.PlanError, match="budget_setting"):
        with budget_setting("yaml"):
            pass
