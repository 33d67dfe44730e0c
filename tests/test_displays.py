"""Displays are pure: ``repr``, ``explain()`` (text and HTML) call no model (not even on
the meta device), benchmark nothing and show no internal node ids; ``Q @ G.T`` shows no
identity operator."""
from __future__ import annotations

import html
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread  # noqa: E402,F401 - one_thread is an autouse fixture

import gradalg as ga  # noqa: E402
from gradalg.devices import measure  # noqa: E402

NODE_ID = re.compile(r"\b[a-z_]+-[0-9a-f]{12}\b")


class AnyForward:
    """Counts every forward call of any module of the model, on any device."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __enter__(self):
        self.handles = [m.register_forward_hook(lambda *a: setattr(self, "calls", self.calls + 1))
                        for m in self.model.modules()]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@pytest.fixture
def no_benchmark(tmp_path, monkeypatch):
    """A machine never measured (empty cache) where measuring fails the test."""
    monkeypatch.setenv("GRADALG_CACHE", str(tmp_path))

    def refuse():
        raise AssertionError("a display benchmarked the device")
    monkeypatch.setattr(measure, "measure_cpu", refuse)


def expressions():
    model = models.cnn()
    X, y = models.image_data(n=10)
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, (X, y)), ga.grads(task, (X[:3], y[:3]))
    P = ga.proj.kron(k=4, seed=0)
    yield model, Q @ G.T
    yield model, P(Q) @ ga.fisher(P(G)).damp(1e-2).inv() @ P(G).T
    yield model, ga.methods.influence(task, (X, y), (X[:3], y[:3]), curvature="ekfac")


def test_repr_and_explain_call_no_model_and_benchmark_nothing(no_benchmark):
    for model, S in expressions():
        with AnyForward(model) as seen:
            texts = [repr(S), S._repr_html_(), str(S.explain()), S.explain()._repr_html_(),
                     str(S.explain(stage="physical")), S.explain(stage="costed")._repr_html_()]
        assert seen.calls == 0, "a display ran the model"
        for text in texts:
            assert not NODE_ID.search(text), NODE_ID.search(text).group(0)


def test_a_plain_inner_product_shows_no_identity_operator(no_benchmark):
    _, S = next(expressions())
    for text in (repr(S), str(S.explain(stage="logical"))):
        assert "identity" not in text and "─ I " not in text, text



def test_blocks_are_shown_by_module_path_kind_and_shape_but_keyed_by_name(no_benchmark):
    model = models.mlp()
    X, y = models.classification_data(n=6)
    G = ga.grads(ga.tasks.classification(model), (X, y))
    S = G @ G.T
    assert "0 (linear 16×9, factored)" in repr(S) and "2 (linear 3×17, factored)" in repr(S)
    kernels = [d["what"] for d in S.explain(device="a100", memory_budget=2**30).decisions() if d["kind"] == "kernel"]
    assert kernels == ["kernel for block 0 (linear 16×9) of scores", "kernel for block 2 (linear 3×17) of scores"]
    assert G["0"].space.names == ("0",) and G[["0", "2"]].space.names == ("0", "2")   # API keys unchanged


# ---- snapshots --------------------------------------------------------------------------
# explain() of a few representative expressions, planned for a preset device (A100) with a
# fixed budget, so the numbers do not depend on this machine. After an intended change of
# the displays, regenerate them and review the diff:
#     GRADALG_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_displays.py -k snapshot
SNAPSHOTS = os.path.join(os.path.dirname(__file__), "snapshots")
STYLE = re.compile(r"<style>.*?</style>", re.S)   # the shipped CSS is not part of a snapshot


def snapshot_expressions():
    mlp = models.mlp()
    X, y = models.classification_data(n=12)
    task = ga.tasks.classification(mlp)
    G, Q = ga.grads(task, (X, y)), ga.grads(task, (X[:3], y[:3]))
    yield "grad_dot_mlp", Q @ G.T
    P = ga.proj.kron(k=4, seed=0)
    yield "projected_influence_mlp", P(Q) @ ga.fisher(P(G)).damp(1e-2).inv() @ P(G).T
    gpt2 = models.gpt2(n_layer=1, n_embd=16)
    g = torch.Generator().manual_seed(1)
    seqs = [{"input_ids": torch.randint(1, 101, (n,), generator=g), "attention_mask": torch.ones(n, dtype=torch.long)}
            for n in (5, 3, 6, 4)]
    yield "ekfac_influence_gpt2", ga.methods.influence(ga.tasks.causal_lm(gpt2), seqs, seqs[:2], curvature="ekfac",
                                                      layers=["transformer.h.0.mlp.c_fc", "lm_head"])


def _check_snapshot(name: str, text: str):
    path = os.path.join(SNAPSHOTS, name)
    if os.environ.get("GRADALG_UPDATE_SNAPSHOTS") == "1":
        os.makedirs(SNAPSHOTS, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    assert os.path.exists(path), f"no snapshot {path}: run with GRADALG_UPDATE_SNAPSHOTS=1 to write it"
    with open(path, encoding="utf-8") as f:
        expected = f.read()
    assert text == expected, (f"explain() differs from {path}; if the change is intended, regenerate with "
                              "GRADALG_UPDATE_SNAPSHOTS=1 and review the diff")


@pytest.mark.parametrize("name", ["grad_dot_mlp", "projected_influence_mlp", "ekfac_influence_gpt2"])
def test_explain_matches_its_snapshot(no_benchmark, name):
    S = dict(snapshot_expressions())[name]
    explained = S.explain(device="a100", memory_budget=2**30)
    text, page = str(explained), STYLE.sub("<style>…</style>", explained._repr_html_())
    assert not NODE_ID.search(text + page) and " at 0x" not in text + page
    _check_snapshot(f"{name}.txt", text + "\n")
    _check_snapshot(f"{name}.html", page.replace("<details", "\n<details").replace("<tr>", "\n<tr>") + "\n")


def test_explain_stage_shows_one_stage_in_text_and_html(no_benchmark):
    S = dict(snapshot_expressions())["projected_influence_mlp"]
    sections = {"logical": "1. logical", "simplified": "2. simplified", "costed": "3. costed decisions",
                "physical": "4. physical passes", "scale": "5. at scale"}
    for stage, heading in sections.items():
        explained = S.explain(device="a100", memory_budget=2**30, stage=stage)
        text, page = str(explained), explained._repr_html_()
        for other, other_heading in sections.items():
            shown_text, shown_page = other_heading in text, f"<summary>{other_heading}" in page
            assert shown_text == shown_page == (other == stage), (stage, other, shown_text, shown_page)


def test_explain_shows_the_operator_rules_resolution_will_apply(no_benchmark):
    """Stage 2 lists, per operator, the named rules of gradalg.linalg that resolving it
    applies: the same list as resolution_rules (and as the resolved operator's ``rules``,
    tests/test_operators.py), in the text and the HTML, without running the model."""
    from gradalg.linalg.rules import describe_rule
    from gradalg.plan.resolution import resolution_rules

    model = models.mlp()
    X, y = models.classification_data(n=8)
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, (X, y)), ga.grads(task, (X[:2], y[:2]))
    H = ga.kfac(G).damp(1e-2).inv()
    with AnyForward(model) as seen:
        explained = (Q @ H @ G.T).explain(device="a100", memory_budget=2**30, stage="simplified")
        rows, text, page = explained.operators(), str(explained), explained._repr_html_()
    assert seen.calls == 0
    rules = ["kronecker.damp_in_eigenbasis", "kronecker.invert_eigenvalues"]
    assert rows == [{"operator": "kfac → damp(λ=0.01) → inverse", "refused": None, "rules": rules,
                     "math": {name: describe_rule(name) for name in rules}}]
    assert rows[0]["rules"] == resolution_rules(H)
    assert "- kfac → damp(λ=0.01) → inverse: kronecker.damp_in_eigenbasis, kronecker.invert_eigenvalues" in text
    # in the HTML each rule name shows its math on hover
    math = html.escape(describe_rule("kronecker.invert_eigenvalues"))
    assert ("<td>kfac → damp(λ=0.01) → inverse</td><td><b title='" in page
            and f"<br><b title='{math}'>kronecker.invert_eigenvalues</b></td>" in page)
    assert explained.to_dict()["operator_rules"] == rows
    # a structure that cannot do the operation shows its refusal, before any pass
    refused = (Q @ ga.gauss_newton(task, (X, y)).damp(0.1).pow(-0.5) @ G.T).explain(stage="simplified").operators()
    assert refused[0]["rules"] == [] and "ga.arnoldi" in refused[0]["refused"]
    # a plain inner product has no operator to resolve: no section
    assert "operator rules" not in str((Q @ G.T).explain(stage="simplified"))


def _leftover(line: str, pieces) -> str:
    """``line`` without any of ``pieces`` (longest first): what in it comes from nowhere else."""
    for piece in sorted(set(pieces) - {""}, key=len, reverse=True):
        line = line.replace(piece, "\0")    # a mark, so that what is left around a piece does not join up
    return line.replace("\0", "").strip()


def test_text_and_html_show_the_same_cells(no_benchmark):
    """Both renderings lay out one model (``Explain.sections()``): the HTML's tables hold exactly
    the model's column names and cells, and the text line of each row is its cells in the columns'
    templates and nothing else, so a column added to one renderer only fails."""
    import string
    from dataclasses import replace

    from gradalg.devices import PRESETS
    from gradalg.plan.explain import Explain, Table

    plan = dict(snapshot_expressions())["projected_influence_mlp"].explain(device="a100", memory_budget=2**30).plan
    small = replace(PRESETS["a100"], name="small GPU", memory=2e3)   # one example per GPU does not fit
    measured = [{"seconds": 0.02, "held_bytes": 3e3, "peak_rss_growth_bytes": 9e4, "peak_rss_is_bound": True}]
    explained = Explain(plan, measured, gpus=(1, 8), device=small)    # pass 0 measured, the others not
    text, page, lines = str(explained), explained._repr_html_(), str(explained).splitlines()
    tables = [part for s in explained.sections() for part in s.parts if isinstance(part, Table) and part.rows]
    names = [[c.name for c, _ in t.shown()] for t in tables]
    assert len(tables) == 5 and "meas/est" in names[3] and "why" in names[4], names  # rules, operators, ..., scale
    pages = re.findall(r"<table class='ga-table'>(.*?)</table>", page)
    assert len(pages) == len(tables)

    def cell(td):   # an HTML cell's parts, as text
        return tuple(html.unescape(re.sub(r"<[^>]+>", "", x)) for x in td.split("<br>"))
    for table, shown_page in zip(tables, pages):
        shown = table.shown()
        assert [html.unescape(x) for x in re.findall(r"<th[^>]*>(.*?)</th>", shown_page)] == [c.name for c, _ in shown]
        html_rows = [tuple(map(cell, re.findall(r"<td>(.*?)</td>", tr))) for tr in re.findall(r"<tr>(.*?)</tr>",
                                                                                               shown_page)[1:]]
        assert html_rows == [tuple(cells[j] for _, cells in shown) for j in range(len(table.rows))]
        literals = [lit for c, _ in shown for lit, *_ in string.Formatter().parse(c.text)] + [c.sep for c, _ in shown]
        if table.header:
            assert any(not _leftover(line, [c.name for c, _ in shown]) for line in lines), table.columns
        for j in range(len(table.rows)):
            inline = [x for c, cells in shown if not c.below for x in cells[j] if x]
            line = next((line for line in lines if all(x in line for x in inline)), None)
            assert line is not None and not _leftover(line, inline + literals), (inline, line)
            assert all(x in text for c, cells in shown if c.below for x in cells[j])
