"""benchmarks/fidelity_report.py's frontier: the Pareto frontier of hand-made points, which
row is each method's default, the docs tables parsed back to the rows they were written
from, a table spliced into a document, and the figure drawn from points."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity_report.py"


@pytest.fixture(scope="module")
def fr():
    spec = importlib.util.spec_from_file_location("fidelity_report_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _row(method, config, lds, cost, **kw):
    return {"method": method, "config": config, "lds": lds, "low": lds - 0.05, "high": lds + 0.05,
            "seconds": cost * 0.1, "cost": cost, **kw}


RESULT = {"setting": "toy-k3", "description": "a toy", "fwd_bwd_seconds": 0.1,
          "protocol": {"name": "subset-retrain", "counterfactual": "c", "n_subsets": 4, "queries": "the first 2 of 2",
                       "seeds_per_subset": 3, "training_seed": "0 + r for run r = 0 … 2"},
          "reliability": {"test_retest": 0.6, "test_retest_interval": [0.5, 0.7], "ceiling": 0.9,
                          "ceiling_one_run": 0.8},
          "rows": [_row("grad_dot", "defaults", 0.10, 2.0),
                   _row("influence", "defaults (curvature='auto')", 0.30, 5.0),
                   _row("influence", "K-FAC", 0.35, 4.0),
                   _row("relatif", "EK-FAC", 0.40, 8.0),
                   _row("trak", "k=128", 0.20, 3.0),
                   _row("trak", "defaults (k=2048)", 0.25, 30.0),
                   _row("relatif", "defaults, ensemble of 5 seeds", 0.50, 40.0),
                   {"method": "magic", "config": "", "skipped": "not run"}]}


def test_frontier_keeps_the_points_nothing_cheaper_beats(fr):
    pts = fr.points_of(RESULT, "toy")
    front = [(p["method"], p["config"]) for p in fr.frontier(pts)]
    assert front == [("grad_dot", "defaults"), ("trak", "k=128"), ("influence", "K-FAC"), ("relatif", "EK-FAC"),
                     ("relatif", "defaults, ensemble of 5 seeds")]


def test_default_points_and_kinds(fr):
    pts = {(p["method"], p["config"]): p for p in fr.points_of(RESULT, "toy")}
    defaults = sorted(k for k, p in pts.items() if p["default"])
    # a row named "defaults…" wins; RelatIF has none, so its first single-model row is its default
    assert defaults == [("grad_dot", "defaults"), ("influence", "defaults (curvature='auto')"),
                        ("relatif", "EK-FAC"), ("trak", "defaults (k=2048)")]
    assert pts[("relatif", "defaults, ensemble of 5 seeds")]["kind"] == "ensemble"
    assert ("magic", "") not in pts                            # skipped rows are not points
    assert fr.kind("magic", "replayable run") == "unrolled"
    assert fr.kind("influence", "EK-FAC, 10 seed(s) × last 5 of 10 checkpoints") == "ensemble"


def test_defaults_table_says_where_each_default_sits(fr):
    data = {"settings": {"toy": {"points": fr.points_of(RESULT, "toy")}}}
    lines = {line.split(" | ")[1]: line for line in fr.defaults_table(data).splitlines()[2:]}
    assert "**yes**" in lines["grad_dot"] and "**yes**" in lines["relatif"]
    # influence's default (0.30 at 5×) is beaten by K-FAC (0.35 at 4×): 0.050 below the frontier
    assert "no (−0.050)" in lines["influence"] and "K-FAC: 0.350 at 4.0×" in lines["influence"]
    assert "no (−0.150)" in lines["trak"]


def test_docs_tables_parse_back_to_their_rows(fr):
    md = "# doc\n\nsome text\n\n" + fr.table(RESULT) + "\n\nmore text\n"
    parsed = fr.from_docs(md)["toy-k3"]
    assert parsed["protocol"]["seeds_per_subset"] == 3 and parsed["reliability"]["ceiling"] == 0.9
    done = [r for r in RESULT["rows"] if "lds" in r]
    got = [r for r in parsed["rows"] if "lds" in r]
    assert [(r["method"], r["config"]) for r in got] == [(r["method"], r["config"]) for r in
                                                         sorted(done, key=lambda r: [x["method"] for x in
                                                                                     RESULT["rows"]].index(r["method"]))]
    for r in got:
        ref = next(x for x in done if (x["method"], x["config"]) == (r["method"], r["config"]))
        assert r["lds"] == pytest.approx(ref["lds"], abs=5e-4) and r["cost"] == pytest.approx(ref["cost"], abs=0.5)
    assert any(r.get("skipped") for r in parsed["rows"])


def test_splice_replaces_only_that_table(fr):
    old = dict(RESULT, rows=RESULT["rows"][:2])
    md = "# doc\n\n" + fr.table(old) + "\n\nafter\n"
    out = fr.splice(md, RESULT)
    assert out == "# doc\n\n" + fr.table(RESULT) + "\n\nafter\n"
    assert fr.splice("# nothing here\n", RESULT) == "# nothing here\n"


def test_collect_and_draw(fr, tmp_path):
    import json
    (tmp_path / "results-toy-k3.json").write_text(json.dumps(RESULT))
    (tmp_path / "results-lm.json").write_text(json.dumps(dict(RESULT, setting="lm")))
    (tmp_path / "results-lm-unrolled-q16.json").write_text(json.dumps(dict(RESULT, setting="x")))   # not a panel
    previous = {"settings": {"mlp": {"source": "kept", "points": []}}}
    # the docs' lm table has a row the results file lacks: kept beside the rerun rows
    docs = fr.table(dict(RESULT, setting="lm", rows=RESULT["rows"][:2] + [_row("less", "sparse", 0.3, 9.0)]))
    data = fr.collect(tmp_path, previous, docs_md=docs)
    assert set(data["settings"]) == {"lm", "mlp"}
    assert data["settings"]["lm"]["source"] == "build/fidelity/results-lm.json + 1 rows of its table in " \
                                               "docs/fidelity.md not rerun"
    assert sorted(p["method"] for p in data["settings"]["lm"]["points"]) == sorted(
        [r["method"] for r in RESULT["rows"] if "lds" in r] + ["less"])
    assert data["settings"]["mlp"]["source"] == "kept"
    data["settings"] = {"lm": data["settings"]["lm"]}
    fig = fr.draw(data, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 1000
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_points_merge_per_setting(fr, tmp_path, monkeypatch):
    """``--points`` with results for two settings: those two are taken from their files (a
    setting's previous points replaced, not merged), every other setting of the JSON is kept
    as it was, its recorded ``source`` included; with no results files nothing changes."""
    import json
    build, points = tmp_path / "build", tmp_path / "points.json"
    build.mkdir()
    (build / "results-lm2.json").write_text(json.dumps(dict(RESULT, setting="lm2", protocol={"seeds_per_subset": 1},
                                                            rows=RESULT["rows"][:3])))
    (build / "results-text-k3.json").write_text(json.dumps(dict(RESULT, setting="text-k3")))
    stale = {"method": "trak", "config": "gone", "lds": 0.9, "low": 0.8, "high": 1.0, "cost": 1.0,
             "kind": "single", "default": True}
    previous = {"generated_by": "x", "settings": {
        "mlp": {"source": "build/fidelity/results-mlp.json", "description": "an MLP", "points": [stale]},
        "lm2": {"source": "docs/fidelity.md (its table)", "description": "old", "points": [stale]},
        "llama": {"source": "build/fidelity/results-llama-k3.json", "description": "a llama", "ceiling": 0.77,
                  "points": [dict(stale, method="less")]}}}
    points.write_text(json.dumps(previous))
    monkeypatch.setattr(fr, "BUILD", build)
    monkeypatch.setattr(fr, "POINTS", points)
    monkeypatch.setattr(fr, "ROOT", tmp_path)
    monkeypatch.setattr(fr, "FIGURE", tmp_path / "frontier.png")
    monkeypatch.setattr(fr, "DOCS", tmp_path / "fidelity.md")
    (tmp_path / "fidelity.md").write_text("# no tables\n")
    fr.main(["--points"])
    data = json.loads(points.read_text())
    assert list(data["settings"]) == ["mlp", "lm2", "text", "llama"]        # the panels' order
    for kept in ("mlp", "llama"):
        assert data["settings"][kept] == previous["settings"][kept]
    lm2 = data["settings"]["lm2"]
    assert lm2["source"] == "build/fidelity/results-lm2.json"
    assert [(p["method"], p["config"], p["lds"]) for p in lm2["points"]] == [
        (r["method"], r["config"], r["lds"]) for r in RESULT["rows"][:3]]   # the stale point is gone
    text = data["settings"]["text"]
    assert text["source"] == "build/fidelity/results-text-k3.json" and text["seeds_per_subset"] == 3
    assert text["ceiling"] == 0.9 and len(text["points"]) == len([r for r in RESULT["rows"] if "lds" in r])
    # a machine without build/fidelity: every setting as it was
    for path in build.glob("*.json"):
        path.unlink()
    before = json.loads(points.read_text())
    fr.main(["--points"])
    assert json.loads(points.read_text())["settings"] == before["settings"]


def test_targets_table_reads_the_multi_run_ground_truth(fr, tmp_path):
    """Issue 31 item 6 sets its targets against multi-run ground truths: with ``results-lm.json``
    (one run per subset) and ``results-lm-k4.json`` (the mean of 4) both there, ``lm``'s points
    and its targets row are the 4-run file's, completed by the rows of the docs' ``lm-k4`` table
    (not the one-run ``lm`` table's), and the row names its ground truth; a later ``--points``
    on a machine with the one-run file only keeps the 4-run points (on main it replaced them)."""
    import json
    one = dict(RESULT, setting="lm", protocol={"seeds_per_subset": 1}, rows=[_row("relatif", "defaults", 0.39, 14.0)])
    one.pop("reliability")
    four = dict(RESULT, setting="lm-k4", protocol=dict(RESULT["protocol"], seeds_per_subset=4),
                reliability=dict(RESULT["reliability"], ceiling=0.87), rows=[_row("relatif", "defaults", 0.47, 14.0)])
    (tmp_path / "results-lm.json").write_text(json.dumps(one))
    (tmp_path / "results-lm-k4.json").write_text(json.dumps(four))
    docs = (fr.table(dict(one, rows=[_row("relatif", "EK-FAC, ensemble of 5 seeds", 0.48, 200.0)])) + "\n\n"
            + fr.table(dict(four, rows=[_row("relatif", "EK-FAC, ensemble of 5 seeds", 0.56, 200.0)])) + "\n")
    data = fr.collect(tmp_path, None, docs_md=docs)
    lm = data["settings"]["lm"]
    assert lm["seeds_per_subset"] == 4 and lm["ceiling"] == 0.87
    assert lm["source"] == "build/fidelity/results-lm-k4.json + 1 rows of its table in docs/fidelity.md not rerun"
    assert sorted(p["lds"] for p in lm["points"]) == [0.47, 0.56]
    row = fr.targets_table(data).splitlines()[2].split(" | ")
    assert row[:2] == ["| `lm`", "4 runs per subset, LDS ceiling 0.87 (`results-lm-k4.json`)"]
    assert row[2].startswith("0.470 [") and row[5].startswith("0.560 [")
    (tmp_path / "results-lm-k4.json").unlink()
    kept = fr.collect(tmp_path, data, docs_md=docs)["settings"]["lm"]
    assert kept == lm
    assert fr.collect(tmp_path, None, docs_md=docs)["settings"]["lm"]["seeds_per_subset"] == 1
    assert "1 run per subset, LDS ceiling not measured (`results-lm.json`)" in fr.targets_table(
        fr.collect(tmp_path, None, docs_md=docs))


def test_update_docs_keeps_the_rows_not_rerun(fr):
    """``--update-docs`` with a partial rerun: the table gets the rerun rows (new numbers) and
    keeps its rows the results file lacks; the LM ensembles table is not a table of rows."""
    old = dict(RESULT, rows=[_row("grad_dot", "defaults", 0.11, 2.0), _row("trak", "k=128", 0.20, 3.0)])
    md = "# doc\n\n" + fr.table(old) + "\n\nafter\n"
    rerun = dict(RESULT, rows=[_row("grad_dot", "defaults", 0.15, 2.5), _row("grad_dot", "layers='x'", 0.12, 2.0)])
    out = fr.docs_tables(fr.splice(md, fr.merged(rerun, md)))["toy-k3"]["rows"]
    assert [(r["method"], r["config"], r["lds"]) for r in out] == [
        ("grad_dot", "defaults", 0.15), ("grad_dot", "layers='x'", 0.12), ("trak", "k=128", 0.20)]
    assert fr.merged(rerun, "# no table\n") == rerun


def test_lm_defaults_rows_at_the_default_layers_and_blocks_only(fr):
    """``fidelity_lm``'s defaults rows: each runs with ``layers=None`` (the task's default
    layers) under its own label, then with the blocks under ``label + BLOCKS_ONLY``, a row
    the frontier never takes as the method's default."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import fidelity_lm as FL
    finally:
        sys.path.remove(str(SCRIPT.parent))
    rows = list(FL.default_layer_rows([("trak", "defaults (k=2048)", lambda L: ("trak", L)),
                                       ("grad_dot", "", lambda L: ("grad_dot", L))]))
    assert [(m, c, thunk()) for m, c, thunk in rows] == [
        ("trak", "defaults (k=2048)", ("trak", None)),
        ("trak", "defaults (k=2048)" + FL.BLOCKS_ONLY, ("trak", ["transformer.h.*"])),
        ("grad_dot", "", ("grad_dot", None)),
        ("grad_dot", "defaults" + FL.BLOCKS_ONLY, ("grad_dot", ["transformer.h.*"]))]
    # the blocks-only twin listed first must still not be the default point
    result = {"rows": [_row(m, c, 0.5 if FL.BLOCKS_ONLY in c else 0.4, 2.0) for m, c, _ in reversed(rows)]}
    defaults = {(p["method"], p["config"]) for p in fr.points_of(result, "lm") if p["default"]}
    assert defaults == {("trak", "defaults (k=2048)"), ("grad_dot", "")}


def _md_table(md: str, header: str) -> str:
    """The markdown table of ``md`` whose header row starts with ``header`` (its rows through the
    first line that is not a table row)."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end])


def test_docs_frontier_tables_are_the_committed_points(fr):
    """docs/fidelity.md's "which point each default sits on" and issue 31's targets tables
    are what ``--frontier`` prints from the committed points, cell for cell: no cell entered
    by hand (issue 31's check: the document regenerated from the benchmark files)."""
    import json
    data = json.loads(fr.POINTS.read_text())
    md = fr.DOCS.read_text()
    assert _md_table(md, "| setting | method | default LDS |") == fr.defaults_table(data)
    assert _md_table(md, "| setting | ground truth | best at its defaults") == fr.targets_table(data)


def test_replace_table_swaps_only_the_table_with_that_header(fr):
    """``--frontier --update-docs``'s splice: the table under the same header row is replaced
    through its last row, the text around and other tables kept; no such table is an error."""
    md = "# doc\n\n| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\ntext\n\n| c | d |\n|---|---|\n| 5 | 6 |\n"
    out = fr.replace_table(md, "| a | b |\n|---|---|\n| 7 | 8 |")
    assert out == "# doc\n\n| a | b |\n|---|---|\n| 7 | 8 |\n\ntext\n\n| c | d |\n|---|---|\n| 5 | 6 |\n"
    with pytest.raises(ValueError, match="no table with the header"):
        fr.replace_table(md, "| x | y |\n|---|---|")


def test_tied_table_takes_blocks_only_rows_for_its_first_column(fr):
    """The tied-embedding table's first column is the blocks only: Grad-Dot's and LoGra's
    defaults rows now run at the default layers (the vocabulary layers included), so the
    column takes their ``BLOCKS_ONLY`` rows, or stays blank, never the default-layer row."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import fidelity_lm as FL
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert fr.BLOCKS_ONLY == FL.BLOCKS_ONLY
    rows = [_row("grad_dot", "defaults", 0.20, 4.0), _row("grad_dot", "layers='all'", 0.21, 5.0),
            _row("logra", "defaults (k=4096)", 0.47, 9.0), _row("logra", "layers='all' (defaults otherwise)", 0.46, 9.0)]
    lines = fr.tied_table([dict(RESULT, rows=rows)]).splitlines()
    assert lines == ["| `toy` | Grad-Dot |  | 0.210 [0.160, 0.260] (5.0×) |  |  |",
                     "| `toy` | LoGra (defaults otherwise) |  | 0.460 [0.410, 0.510] (9.0×) |  |  |"]
    rows += [_row("grad_dot", "defaults" + FL.BLOCKS_ONLY, 0.12, 2.0),
             _row("logra", "defaults (k=4096)" + FL.BLOCKS_ONLY, 0.37, 5.0)]
    lines = fr.tied_table([dict(RESULT, rows=rows)]).splitlines()
    assert [line.split(" | ")[2] for line in lines] == ["0.120 [0.070, 0.170] (2.0×)", "0.370 [0.320, 0.420] (5.0×)"]


def test_explorer_rows_are_ensemble_points_with_their_cost(fr, tmp_path):
    """``benchmarks/explore_ensembles.py --points``: a row is an ``ensemble`` point (the frontier's
    ``kind`` of its configuration agrees), its cost M · c_score + (R + K · stretch) · c_run, with
    c_score the method's default point's cost and c_run one training run's from the setting's
    committed seeds / one-run ensemble points; a row that trains where c_run was never measured
    is no point. ``--points`` keeps such points when it rebuilds the setting from a results file,
    and the targets table counts an ensemble of one run's checkpoints as one training run's,
    marked an ensemble, not as one model (on main the points were dropped and had no column)."""
    import json
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import explore_ensembles as EE
    finally:
        sys.path.remove(str(SCRIPT.parent))
    seeds, one_run = EE.TRAINING["lm2"]
    committed = [_row("relatif", EE.DEFAULTS["relatif"], 0.57, 25.0), _row("relatif", seeds, 0.67, 340.0),
                 _row("relatif", one_run, 0.64, 60.0), _row("influence", EE.DEFAULTS["influence"], 0.52, 7.0)]
    assert EE.costs(committed, "lm2", "influence") == (7.0, 70.0)          # (340 − 60) / 4 per run
    assert EE.costs(committed, "conv", "relatif") == (25.0, None)          # no seeds rows there
    ci = lambda tau: (0.624, (0.54, 0.68))  # noqa: E731
    ckpts = {"config": f"{EE.DEFAULTS['relatif']}, ensemble of its run's last 5 of 10 checkpoints",
             "tau": None, "members": 5, "runs": 0, "stretches": 0}
    cont = dict(ckpts, config=f"{EE.DEFAULTS['relatif']}, ensemble of the model and 5 snapshots of training "
                "continued from it", members=6, stretches=5)
    seeded = dict(ckpts, config=f"{EE.DEFAULTS['relatif']}, ensemble of 10 seeds × last 5 of 10 checkpoints",
                  members=50, runs=9)
    p = EE.point("relatif", ckpts, ci, 25.0, 70.0, 0.1)
    assert (p["kind"], p["cost"], p["lds"], p["low"], p["high"]) == ("ensemble", 125.0, 0.624, 0.54, 0.68)
    assert fr.kind(p["method"], p["config"]) == "ensemble"
    assert EE.point("relatif", cont, ci, 25.0, 70.0, 0.1)["cost"] == 6 * 25.0 + 5 * 0.1 * 70.0
    assert EE.point("relatif", seeded, ci, 25.0, 70.0, 0.1)["cost"] == 50 * 25.0 + 9 * 70.0
    assert EE.point("relatif", cont, ci, 25.0, None, 0.1) is None
    assert EE.point("relatif", ckpts, ci, 25.0, None, 0.1)["cost"] == 125.0   # no training: costed anyway
    assert EE.point("relatif", dict(ckpts, config=None), ci, 25.0, 70.0, 0.1) is None   # the final model alone
    # --points rebuilding lm2 from its results file keeps the explorer's point
    seeded_p = EE.point("relatif", seeded, lambda tau: (0.67, (0.6, 0.72)), 25.0, 70.0, 0.1)
    previous = {"settings": {"lm2": {"source": "x", "seeds_per_subset": 4, "points": [
        dict(p, source="elsewhere", config="gone"), p, seeded_p]}}}
    previous["settings"]["lm2"]["points"][0].pop("source")
    four = dict(RESULT, setting="lm2-k4", protocol=dict(RESULT["protocol"], seeds_per_subset=4),
                rows=[_row("relatif", EE.DEFAULTS["relatif"], 0.57, 25.0)])
    (tmp_path / "results-lm2-k4.json").write_text(json.dumps(four))
    pts = fr.collect(tmp_path, previous, docs_md="")["settings"]["lm2"]["points"]
    assert [(q["config"], q["kind"], q["cost"]) for q in pts] == [
        (EE.DEFAULTS["relatif"], "single", 25.0), (p["config"], "ensemble", 125.0),
        (seeded_p["config"], "ensemble", 1880.0)]
    row = fr.targets_table({"settings": {"lm2": {"source": "s", "seeds_per_subset": 4, "ceiling": 0.88,
                                                 "points": pts}}}).splitlines()[2].split(" | ")
    assert row[3].startswith("0.570 [") and row[3].endswith("(25×)")                   # one model
    assert row[4] == f"0.624 [0.540, 0.680] — relatif, {p['config']} (ensemble, 125×)"  # one training run
    assert row[5].startswith("0.670 [") and "10 seeds" in row[5]                      # overall
