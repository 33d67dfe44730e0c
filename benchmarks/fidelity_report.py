"""Markdown tables and the cost–fidelity frontier from the fidelity results
(``build/fidelity/results-<setting>.json``).

Written by ``benchmarks/fidelity.py`` (digits: logreg, mlp), ``benchmarks/fidelity_lm.py``
(GPT-2 on synthetic languages: lm, lm2), ``benchmarks/fidelity_text.py`` (text, instruct)
and ``benchmarks/fidelity_more.py`` (llama, conv, seqcls). One table per setting: LDS with
its 95 % bootstrap interval (over queries and subsets), the wall time of
``Scores.compute()`` and that time over one plain forward + backward pass over the
training set.

The **frontier** (issue 31 item 5): every finished row is a point (cost = seconds of
``compute()`` ÷ one forward + backward over the training set, the ratio measured in the
same process; LDS). A point is on the Pareto frontier of its setting when no other point
costs no more and has a higher LDS. Each method's **default point** is its row whose
configuration starts with ``defaults`` (or is empty: Grad-Dot / Grad-Cos have no knobs);
for a method without such a row in a setting — the older digits and ``lm`` tables label
the configuration instead — its first row (the scripts write defaults first), unless
that row is in ``NOT_DEFAULT`` (rows naming ``NOT_DEFAULT_WORDS``, e.g. ``layers=``, are never
defaults). Kinds: ``single`` (one model, checkpoint methods
included), ``ensemble`` (``ga.methods.ensemble`` over seeds, subsets or checkpoints: the
configuration says "ensemble" or "× last"), ``unrolled`` (MAGIC, SOURCE).

    python benchmarks/fidelity_report.py                       # every setting's table
    python benchmarks/fidelity_report.py --settings lm,lm2
    python benchmarks/fidelity_report.py --settings lm,lm2 --update-docs   # those tables in docs/fidelity.md
                                                # (rows of a table its results file lacks are kept)
    python benchmarks/fidelity_report.py --settings text-k3,instruct-k3 --tied   # the tied-embedding rows
    python benchmarks/fidelity_report.py --points              # rewrite benchmarks/results/fidelity_points.json
    python benchmarks/fidelity_report.py --frontier            # docs/img/fidelity_frontier.png + the defaults table
    python benchmarks/fidelity_report.py --frontier --update-docs   # and both tables written into docs/fidelity.md

``--points`` reads every results file under ``build/fidelity`` (a partial rerun is completed
with the rows of that setting's table in ``docs/fidelity.md`` it has not rerun); a setting
without one keeps the points it already has in the JSON, or else takes its docs table's
(each setting records its ``source``), so the docs and notebook 03 render without ``build/``. ``--frontier`` draws from that JSON.
Points another script wrote into the JSON, each with its own ``source`` (``benchmarks/explore_ensembles.py
--points``: ensembles at the defaults from cached member scores), are kept when ``--points`` rebuilds
their setting, unless the results file has a row of the same method and configuration.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "fidelity"
POINTS = ROOT / "benchmarks" / "results" / "fidelity_points.json"
FIGURE = ROOT / "docs" / "img" / "fidelity_frontier.png"
#: the panels, in this order (a results file ``results-<name>[-k<K>].json`` fills its panel)
SETTINGS = ("logreg", "mlp", "lm", "lm2", "text", "instruct", "llama", "conv", "seqcls")
#: (setting, method, configuration) of first rows that are not the method's default
NOT_DEFAULT = {("lm", "less", "3 Adam checkpoints, sparse k=8192"),     # LESS's defaults (then a dense map) were refused
               ("lm2", "less", "3 Adam checkpoints, sparse k=8192")}


#: a configuration naming one of these sets an argument away from its default: never a default point
NOT_DEFAULT_WORDS = ("layers=", "by name", "(reference)", "kron_diagonal_width")


def load(setting: str, root: Path = BUILD) -> dict:
    return json.loads((root / f"results-{setting}.json").read_text())


def table(result: dict) -> str:
    bases = [r["seconds"] / r["cost"] for r in result["rows"] if r.get("cost")]     # each run measured its own
    ms = lambda x: f"{x * 1e3:.1f}" if x >= 1e-3 else f"{x * 1e3:.2f}"  # noqa: E731 - a digits run is 0.2 ms
    base = (f"{ms(min(bases))}–{ms(max(bases))} ms (measured in each run)" if bases and
            max(bases) > 1.05 * min(bases) else f"{ms(result['fwd_bwd_seconds'])} ms")
    proto = result.get("protocol", {})
    named = (f" Protocol **{proto['name']}** ({proto['counterfactual']}); {proto['n_subsets']} subsets, "
             f"{proto['queries']} queries." if "name" in proto else "")
    runs = proto.get("seeds_per_subset", 1)
    if runs > 1:
        named += f" Targets: the mean of {runs} training runs per subset (seeds {proto['training_seed']})."
    if "reliability" in result:
        rel = result["reliability"]
        low, high = rel["test_retest_interval"]
        named += (f" Ground truth test–retest (Spearman between runs) {rel['test_retest']:.3f} [{low:.3f}, "
                  f"{high:.3f}]; LDS ceiling {rel['ceiling']:.2f} against the {runs}-run mean "
                  f"({rel['ceiling_one_run']:.2f} for one run; `ga.eval.reliability`).")
    lines = [f"**{result['setting']}**: {result['description']}; plain forward + backward over the training "
             f"set {base}.{named}", "",
             "| method | configuration | LDS [95% CI] | seconds | cost (× fwd+bwd) |", "|---|---|---:|---:|---:|"]
    order = list(dict.fromkeys(r["method"] for r in result["rows"]))     # methods by first appearance
    for r in sorted(result["rows"], key=lambda r: order.index(r["method"])):
        if r.get("skipped"):
            lines.append(f"| {r['method']} | {r['config']} | skipped: {r['skipped'].replace('|', '/')} | | |")
            continue
        lines.append(f"| {r['method']} | {r['config']} | {r['lds']:.3f} [{r['low']:.3f}, {r['high']:.3f}] | "
                     f"{r['seconds']:.2f} | {r['cost']:.0f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- frontier
def kind(method: str, config: str) -> str:
    """'unrolled' (MAGIC, SOURCE), 'ensemble' (averaged over models or checkpoints) or 'single'."""
    if method in ("magic", "source"):
        return "unrolled"
    return "ensemble" if ("ensemble" in config or "× last" in config) else "single"


def points_of(result: dict, setting: str) -> list[dict]:
    """The finished rows of one results file as frontier points: method, config, lds, low,
    high, cost, kind, default (bool)."""
    done = [r for r in result["rows"] if not r.get("skipped") and r.get("cost") and
            r.get("lds") is not None and math.isfinite(r["lds"])]
    pts = [{"method": r["method"], "config": r["config"], "lds": round(r["lds"], 6), "low": round(r["low"], 6),
            "high": round(r["high"], 6), "cost": round(r["cost"], 4), "kind": kind(r["method"], r["config"]),
            "default": False} for r in done]
    for method in dict.fromkeys(p["method"] for p in pts):
        mine = [p for p in pts if p["method"] == method and p["kind"] != "ensemble"
                and not any(word in p["config"] for word in NOT_DEFAULT_WORDS)]
        named = [p for p in mine if p["config"].startswith("defaults") or p["config"] == ""]
        if named:
            named[0]["default"] = True
        elif mine and (setting, method, mine[0]["config"]) not in NOT_DEFAULT and mine[0]["kind"] == "single":
            mine[0]["default"] = True
    return pts


def frontier(points: list[dict]) -> list[dict]:
    """The Pareto frontier (cheapest first): the points no other point beats at no more cost."""
    best, out = -math.inf, []
    for p in sorted(points, key=lambda p: (p["cost"], -p["lds"])):
        if p["lds"] > best:
            out.append(p)
            best = p["lds"]
    return out


def setting_of(path: Path) -> str:
    """'text' of results-text-k3.json, 'lm' of results-lm.json (other protocols' files: None)."""
    name = path.stem.removeprefix("results-")
    base = name.split("-k")[0] if "-k" in name else name
    return base if base in SETTINGS and name in (base, *(f"{base}-k{k}" for k in range(2, 13))) else None


def collect(root: Path = BUILD, previous: dict | None = None, docs_md: str | None = None) -> dict:
    """The points JSON: each setting from its results file under ``root`` when there (the
    file with the most seeds per subset), else as in ``previous``, else from the tables of
    ``docs_md`` (default: ``docs/fidelity.md``'s text). A results file against fewer runs per
    subset than the setting's points in ``previous`` does not replace them: a machine with only
    ``results-lm.json`` keeps ``lm``'s points against the mean of 4 runs (``results-lm-k4.json``)."""
    out = {"generated_by": "python benchmarks/fidelity_report.py --points", "settings": {}}
    found = {}
    for path in sorted(root.glob("results-*.json")):
        s = setting_of(path)
        if s is None:
            continue
        res = json.loads(path.read_text())
        k = res.get("protocol", {}).get("seeds_per_subset", 1)
        if s not in found or k > found[s][0]:
            found[s] = (k, path, res)
    docs = None
    for s in SETTINGS:
        kept = (previous or {}).get("settings", {}).get(s, {})
        others = [p for p in kept.get("points", []) if "source" in p]       # another script's points: kept
        if s in found and found[s][0] < kept.get("seeds_per_subset", 1):
            print(f"{s}: {found[s][1].name} has {found[s][0]} run(s) per subset; the points kept are against "
                  f"{kept['seeds_per_subset']} runs ({kept['source']})")
            out["settings"][s] = kept
        elif s in found:
            k, path, res = found[s]
            rel = res.get("reliability", {})
            source = f"build/fidelity/{path.name}"
            docs = from_docs(DOCS.read_text() if docs_md is None else docs_md) if docs is None else docs
            table_rows = docs.get(res["setting"], {}).get("rows", [])
            have = {(r["method"], r["config"]) for r in res["rows"]}
            missing = [r for r in table_rows if (r["method"], r["config"]) not in have]
            if missing:        # a partial rerun: the table's other rows (same protocol and seeds) kept
                res = dict(res, rows=missing + res["rows"])
                source += f" + {len(missing)} rows of its table in docs/fidelity.md not rerun"
            out["settings"][s] = {"source": source, "description": res["description"],
                                  "seeds_per_subset": k, "ceiling": rel.get("ceiling"),
                                  "points": with_others(points_of(res, s), others)}
        elif previous and s in previous.get("settings", {}):
            out["settings"][s] = previous["settings"][s]
        else:
            docs = from_docs(DOCS.read_text() if docs_md is None else docs_md) if docs is None else docs
            by_base = {n.split("-k")[0]: res for n, res in docs.items()}
            if s in by_base:
                res = by_base[s]
                out["settings"][s] = {"source": "docs/fidelity.md (its table; not rerun into build/fidelity here)",
                                      "description": res["description"],
                                      "seeds_per_subset": res["protocol"]["seeds_per_subset"],
                                      "ceiling": res.get("reliability", {}).get("ceiling"),
                                      "points": with_others(points_of(res, s), others)}
    return out


def with_others(pts: list[dict], others: list[dict]) -> list[dict]:
    """``pts`` and the points of ``others`` (written by another script, e.g.
    ``benchmarks/explore_ensembles.py --points``, which records its ``source`` on each) that
    ``pts`` has no point of the same method and configuration for."""
    have = {(p["method"], p["config"]) for p in pts}
    return pts + [p for p in others if (p["method"], p["config"]) not in have]


DOCS = ROOT / "docs" / "fidelity.md"


def from_docs(md: str) -> dict:
    """Results dicts parsed back from the per-setting tables of ``docs/fidelity.md`` (the
    format ``table`` writes: a ``**<setting>**: <description>; …`` line, then the
    method / configuration / LDS [CI] / seconds / cost rows) and, for ``lm`` / ``lm2``, the
    rows of the "Ensembles on the LM" table (there only seconds are given: cost = seconds ÷
    the forward + backward that section states for its runs, else the median of seconds ÷
    cost over that setting's table). The fallback of ``--points``
    for a setting with neither a results file nor points already: the committed numbers."""
    import re
    out = docs_tables(md)
    start = md.find("| members | `lm` relatif |")
    if start >= 0:
        import statistics
        base = {s: statistics.median(r["seconds"] / r["cost"] for r in out[s]["rows"] if r.get("cost"))
                for s in ("lm", "lm2") if s in out}
        # the forward + backward of the runs the ensembles were timed in, when the section states it
        # (the settings' tables may be rerun since, at another load: their median is not that run's)
        stated = re.search(r"median\s+over their tables then: `lm` ([0-9.]+) ms, `lm2` ([0-9.]+) ms", md)
        if stated:
            base.update({s: float(stated.group(i)) / 1e3 for i, s in ((1, "lm"), (2, "lm2")) if s in base})
        for row in md[start:].splitlines()[2:]:
            if not row.startswith("|"):
                break
            cells = [c.strip().replace("**", "") for c in row.strip("|").split("|")]
            if cells[0].startswith("1 (the final model"):
                continue
            secs = [float(x) for x in cells[5].split("/")]
            for j, (s, method) in enumerate((("lm", "relatif"), ("lm", "influence"), ("lm2", "relatif"),
                                             ("lm2", "influence"))):
                lds = re.match(r"(-?[0-9.]+) \[(-?[0-9.]+), (-?[0-9.]+)\]", cells[1 + j])
                if s not in base or lds is None:
                    continue
                sec = secs[0 if s == "lm" else 1]        # the column gives RelatIF's seconds; influence's ≈ the same
                out[s]["rows"].append({"method": method, "config": f"EK-FAC, ensemble: {cells[0]}",
                                       "lds": float(lds.group(1)), "low": float(lds.group(2)),
                                       "high": float(lds.group(3)), "seconds": sec, "cost": sec / base[s]})
    return out


def docs_tables(md: str) -> dict:
    """The per-setting tables of ``md`` (the format ``table`` writes) as results dicts:
    ``from_docs`` without the "Ensembles on the LM" rows."""
    import re
    out, lines = {}, md.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^\*\*([a-z0-9]+(?:-k\d+)?)\*\*: (.*?); plain forward", line)
        if not m:
            continue
        name, rows = m.group(1), []
        ceiling = re.search(r"LDS ceiling ([0-9.]+)", line)
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                if rows:
                    break
                continue
            cells = [c.strip() for c in row.strip("|").split("|")]
            if len(cells) != 5 or cells[0] in ("method", "---"):
                continue
            lds = re.match(r"(-?[0-9.]+) \[(-?[0-9.]+), (-?[0-9.]+)\]", cells[2])
            if lds is None:
                rows.append({"method": cells[0], "config": cells[1], "skipped": cells[2]})
                continue
            rows.append({"method": cells[0], "config": cells[1], "lds": float(lds.group(1)),
                         "low": float(lds.group(2)), "high": float(lds.group(3)),
                         "seconds": float(cells[3]), "cost": float(cells[4])})
        k = re.search(r"the mean of (\d+) training runs", line)
        out[name] = {"setting": name, "description": m.group(2), "rows": rows,
                     "protocol": {"seeds_per_subset": int(k.group(1)) if k else 1},
                     **({"reliability": {"ceiling": float(ceiling.group(1))}} if ceiling else {})}
    return out


def merged(result: dict, md: str) -> dict:
    """``result`` with the rows of its setting's table in ``md`` that it has not rerun (same
    method and configuration) after its own: a partial rerun's table keeps the others
    (``--update-docs``; each row keeps the seconds and cost of its own run)."""
    have = {(r["method"], r["config"]) for r in result["rows"]}
    old = docs_tables(md).get(result["setting"], {}).get("rows", [])
    return dict(result, rows=result["rows"] + [r for r in old if (r["method"], r["config"]) not in have])


def defaults_table(data: dict) -> str:
    """Markdown: per setting and method, the default point, whether it is on the frontier
    ("a tie": a cheaper point has the same LDS to 3 decimals, e.g. the same scores timed
    twice), and the frontier point at no more cost (its LDS gain) when it is not."""
    lines = ["| setting | method | default LDS | cost | on the frontier? | best at no more cost |",
             "|---|---|---:|---:|---|---|"]
    for s, d in data["settings"].items():
        pts = d["points"]
        front = frontier(pts)
        for p in [p for p in pts if p["default"]]:
            cheaper = [q for q in front if q["cost"] <= p["cost"]]
            q = cheaper[-1] if cheaper else None
            if p in front:
                verdict, better = "**yes**", ""
            elif q is not None and round(q["lds"], 3) <= round(p["lds"], 3):    # the same LDS as shown: a tie
                verdict, better = "yes (a tie)", f"{q['method']}, {q['config'] or 'defaults'}: {_cost(q['cost'])}"
            else:
                verdict = f"no (−{q['lds'] - p['lds']:.3f})" if q else "no"
                better = f"{q['method']}, {q['config'] or 'defaults'}: {q['lds']:.3f} at {_cost(q['cost'])}" if q else ""
            lines.append(f"| {s} | {p['method']} | {p['lds']:.3f} | {_cost(p['cost'])} | {verdict} | {better} |")
    return "\n".join(lines)


LM_SETTINGS = ("lm", "lm2", "text", "instruct", "llama")


def targets_table(data: dict, settings=LM_SETTINGS) -> str:
    """Markdown: per LM setting, the ground truth its points are scored against (runs per
    subset, the LDS ceiling ``ga.eval.reliability`` gives it, the results file), the best
    method at its defaults (one model), the best one model in any configuration, the best from
    one training run (``one_run``: one model, or an ensemble of its run's checkpoints or of
    training continued from it) and the best point overall (ensembles and MAGIC included),
    each with LDS [CI] and cost, an ensemble's or MAGIC's kind named (issue 31 item 6: its
    targets are set against multi-run ground truths)."""
    def cell(p):
        if p is None:
            return ""
        what = "" if p["kind"] == "single" else f"{p['kind']}, "
        return (f"{p['lds']:.3f} [{p['low']:.3f}, {p['high']:.3f}] — {p['method']}, {p['config'] or 'defaults'} "
                f"({what}{_cost(p['cost'])})")
    lines = ["| setting | ground truth | best at its defaults (one model) | best one model, any configuration | "
             "best from one training run (ensembles of its checkpoints allowed) | best overall (ensembles allowed) |",
             "|---|---|---|---|---|---|"]
    for s in settings:
        if s not in data["settings"]:
            continue
        d = data["settings"][s]
        pts = d["points"]
        best = lambda ps: max(ps, key=lambda p: p["lds"]) if ps else None  # noqa: E731
        k = d.get("seeds_per_subset", 1)
        truth = (f"{k} run{'s' if k > 1 else ''} per subset, LDS ceiling "
                 + (f"{d['ceiling']:.2f}" if d.get("ceiling") else "not measured")
                 + f" (`{d['source'].split()[0].removeprefix('build/fidelity/')}`)")
        lines.append(f"| `{s}` | {truth} | {cell(best([p for p in pts if p['default']]))} | "
                     f"{cell(best([p for p in pts if p['kind'] == 'single']))} | "
                     f"{cell(best([p for p in pts if one_run(p)]))} | {cell(best(pts))} |")
    return "\n".join(lines)


#: an ensemble point whose configuration names one of these averages one training run's models
ONE_RUN_WORDS = ("1 seed(s) ×", "its run's", "continued from it", "copies of its model")


def one_run(p: dict) -> bool:
    """Whether a point needs one training run only: one model (checkpoint methods included), or
    an ensemble of that run's checkpoints or of training continued from its model."""
    return p["kind"] == "single" or (p["kind"] == "ensemble" and any(w in p["config"] for w in ONE_RUN_WORDS))


def _cost(c: float) -> str:
    return f"{c:,.0f}×" if c >= 10 else f"{c:.1f}×"


COLORS = {"influence": "C0", "relatif": "C1", "logra": "C2", "trak": "C3", "grass": "C4", "less": "C5",
          "tracin": "C6", "trackstar": "C7", "grad_dot": "C8", "grad_cos": "C9", "magic": "k", "source": "0.4"}
#: shown in the legend's colours only (their points are stars)
UNROLLED = ("magic", "source")
MARKERS = {"single": "o", "ensemble": "s", "unrolled": "*"}


def draw(data: dict, path: Path | None = FIGURE, ncols: int = 3):
    """Small multiples, one panel per setting: LDS against cost (log x) of every point
    (circles: one model; squares: ensembles; stars: MAGIC / SOURCE), the Pareto frontier as
    a step line, each method's default point large with a black edge, the ground truth's
    LDS ceiling dashed. Saved to ``path`` (when given); returns the figure."""
    import matplotlib
    import matplotlib.ticker
    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [s for s in SETTINGS if s in data["settings"]]
    nrows = max(1, math.ceil(len(names) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    for ax, s in zip(axes.flat, names):
        d = data["settings"][s]
        pts = d["points"]
        for p in pts:
            ax.scatter(p["cost"], p["lds"], s=70 if p["default"] else 60 if p["kind"] == "unrolled" else 18, marker=MARKERS[p["kind"]],
                       color=COLORS.get(p["method"], "0.5"), edgecolor="k" if p["default"] else "none",
                       linewidth=1.0, zorder=3 if p["default"] else 2, alpha=1.0 if p["default"] else 0.7)
        front = frontier(pts)
        if front:
            xs = [q["cost"] for q in front] + [max(q["cost"] for q in pts) * 1.5]
            ys = [q["lds"] for q in front] + [front[-1]["lds"]]
            ax.step(xs, ys, where="post", color="k", linewidth=0.8, alpha=0.6, zorder=1)
        if d.get("ceiling"):
            ax.axhline(d["ceiling"], color="0.5", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if max(p["cost"] for p in pts) < 10 * min(p["cost"] for p in pts):     # under a decade: label 2×, 3×, …
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 3, 5)))
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        k = d.get("seeds_per_subset", 1)
        ax.set_title(f"{s}" + (f" ({k} runs per subset)" if k > 1 else ""), fontsize=10)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("LDS")
    for ax in axes[-1, :]:
        ax.set_xlabel("cost (× one forward+backward, log)")
    from matplotlib.lines import Line2D
    used = [m for m in COLORS if m not in UNROLLED and
            any(p["method"] == m for d in data["settings"].values() for p in d["points"])]
    handles = [Line2D([], [], marker="o", linestyle="", color=COLORS[m], label=m) for m in used]
    handles += [Line2D([], [], marker="o", linestyle="", color="w", markeredgecolor="k", markersize=9,
                       label="default (large, black edge)"),
                Line2D([], [], marker="s", linestyle="", color="0.5", label="ensemble"),
                Line2D([], [], marker="*", linestyle="", color="k", markersize=9, label="MAGIC / SOURCE"),
                Line2D([], [], color="k", linewidth=0.8, label="Pareto frontier"),
                Line2D([], [], color="0.5", linestyle="--", linewidth=0.8, label="LDS ceiling")]
    fig.legend(handles=handles, loc="lower center", ncol=min(8, len(handles)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


#: the label suffix of fidelity_lm's defaults rows on the blocks only (``fidelity_lm.BLOCKS_ONLY``;
#: this module does not import the benchmarks, which import torch)
BLOCKS_ONLY = ", blocks only (layers=['transformer.h.*'])"
#: (label, method, blocks-only config, layers="all" config, by-name config, diagonal config);
#: a tuple: the first configuration the results file has (fidelity_more's rows name them shorter)
TIED = (("K-FAC influence", "influence", "K-FAC", ("K-FAC, layers='all' (tied embedding/head included)",
                                                  "K-FAC, layers='all'"), None,
         "K-FAC, layers='all', vocabulary factor diagonal (kron_diagonal_width=512)"),
        ("EK-FAC influence", "influence", ("EK-FAC", "EK-FAC (default damping)"),
         ("EK-FAC, layers='all' (tied embedding/head included)",
                                                    "EK-FAC, layers='all'"),
         "EK-FAC, blocks + transformer.wte (tied) by name",
         "EK-FAC, layers='all', vocabulary factor diagonal (kron_diagonal_width=512)"),
        ("RelatIF (EK-FAC)", "relatif", ("EK-FAC", "EK-FAC, damping=0.001", "defaults (damping=0.001)"),
         ("EK-FAC, layers='all' (tied embedding/head included)", "EK-FAC, layers='all'"), None, None),
        ("reference: Gauss-Newton, sparse k = 2048", "influence", "Gauss-Newton, sparse k=2048, blocks only (reference)",
         "Gauss-Newton, sparse k=2048, layers='all' (reference)", None, None),
        ("Grad-Dot", "grad_dot", ("defaults" + BLOCKS_ONLY,), "layers='all'", None, None),
        ("LoGra (defaults otherwise)", "logra", None, "layers='all' (defaults otherwise)", None, None))


def tied_table(results: list[dict]) -> str:
    """Markdown rows of the "Tied embeddings" table: per setting and method, LDS [CI] (cost)
    on the blocks only (the default layers until 2026-12-06: the variants that name the
    blocks, and for Grad-Dot / LoGra their defaults rows labelled ``BLOCKS_ONLY``, blank
    where a results file has none: their defaults rows now run at the default layers, the
    vocabulary layers included), with ``layers="all"``, blocks + the tied embedding by name,
    and with the vocabulary factor diagonal (the rows of ``fidelity_lm.tied_rows``)."""
    lines = []
    for res in results:
        rows = {(r["method"], r["config"]): r for r in res["rows"] if "lds" in r}
        for label, method, *configs in TIED:
            if configs[0] is None:                       # LoGra: its default call on the blocks only
                configs[0] = next((c for (m, c) in rows if m == method and c.startswith("defaults (")
                                   and c.endswith(BLOCKS_ONLY)), None)
            configs = [next((x for x in c if (method, x) in rows), None) if isinstance(c, tuple) else c
                       for c in configs]
            cells = [(f"{rows[(method, c)]['lds']:.3f} [{rows[(method, c)]['low']:.3f}, {rows[(method, c)]['high']:.3f}]"
                      f" ({_cost(rows[(method, c)]['cost'])})" if c and (method, c) in rows else "") for c in configs]
            if cells[1]:
                lines.append(f"| `{res['setting'].split('-k')[0]}` | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def splice(md: str, result: dict) -> str:
    """``md`` with the table of ``result['setting']`` (its ``**<setting>**:`` line through the
    end of the table under it) replaced by ``table(result)``; unchanged when it has none."""
    lines = md.splitlines()
    head = f"**{result['setting']}**:"
    start = next((i for i, line in enumerate(lines) if line.startswith(head)), None)
    if start is None:
        return md
    end = start + 2
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + table(result).splitlines() + lines[end:]) + ("\n" if md.endswith("\n") else "")


def replace_table(md: str, new: str) -> str:
    """``md`` with the markdown table whose header row is ``new``'s first line (through its
    last row) replaced by ``new``: ``--frontier --update-docs`` writes the defaults and targets
    tables into docs/fidelity.md. Raises ``ValueError`` when ``md`` has no such table."""
    lines, header = md.splitlines(), new.splitlines()[0]
    start = next((i for i, line in enumerate(lines) if line == header), None)
    if start is None:
        raise ValueError(f"no table with the header {header!r} in the document: add one where it belongs")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + new.splitlines() + lines[end:]) + ("\n" if md.endswith("\n") else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default=None)
    ap.add_argument("--points", action="store_true", help=f"rewrite {POINTS.relative_to(ROOT)} from the results")
    ap.add_argument("--update-docs", action="store_true",
                    help="replace the named settings' tables in docs/fidelity.md instead of printing them "
                    "(their rows the results file lacks are kept); with --frontier: its defaults and targets "
                    "tables")
    ap.add_argument("--tied", action="store_true", help="the rows of docs/fidelity.md's tied-embedding table "
                    "for the named settings")
    ap.add_argument("--frontier", action="store_true",
                    help=f"draw {FIGURE.relative_to(ROOT)} from {POINTS.relative_to(ROOT)}; print the defaults table")
    args = ap.parse_args(argv)
    if args.points:
        previous = json.loads(POINTS.read_text()) if POINTS.exists() else None
        POINTS.parent.mkdir(parents=True, exist_ok=True)
        POINTS.write_text(json.dumps(collect(BUILD, previous), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {POINTS.relative_to(ROOT)}")
    if args.frontier:
        data = json.loads(POINTS.read_text())
        draw(data)
        print(f"wrote {FIGURE.relative_to(ROOT)}\n")
        print(defaults_table(data))
        print()
        print(targets_table(data))
        if args.update_docs:          # the two tables in docs/fidelity.md, replaced by these
            md = DOCS.read_text()
            for new in (defaults_table(data), targets_table(data)):
                md = replace_table(md, new)
            DOCS.write_text(md)
            print(f"\nreplaced both tables in {DOCS.relative_to(ROOT)}")
    if args.points or args.frontier:
        return
    names = (args.settings.split(",") if args.settings
             else sorted(p.stem.removeprefix("results-") for p in BUILD.glob("results-*.json")))
    if args.tied:
        print(tied_table([load(n) for n in names]))
        return
    if args.update_docs:
        md = DOCS.read_text()
        for name in names:
            md = splice(md, merged(load(name), md))      # the rows it did not rerun kept
        DOCS.write_text(md)
        return
    for name in names:
        print(table(load(name)) + "\n")


if __name__ == "__main__":
    main()
