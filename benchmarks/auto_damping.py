"""Automatic damping against the fixed rules: LDS per setting × damping rule.

Every method that damps a curvature, at its defaults except ``damping=``, on the four
fidelity settings (``benchmarks/fidelity.py``: logreg, mlp; ``benchmarks/fidelity_lm.py``:
lm, lm2), against their retrained ground truths (cached under ``build/fidelity/``; run
those scripts first, ``--retrain-only`` for the LMs). Rules (``VARIANTS``):

    default        the method's current default (no ``damping=``)
    abs 1e-3       λ = 1e-3 (influence's and LoGra's default before issue 15)
    mass q         ga.linalg.DampingRule("mass", q): per block, λ_b = the eigenvalue where
                   the top eigenvalues hold q of the block's mass
    effdim f       DampingRule("effdim", f): per block, d_eff(λ_b) = f × participation ratio
    mean c         DampingRule("mean", c): per block, c × the block's mean eigenvalue
    ... global     the same rule on the pooled spectrum (one λ)

``damping="auto"`` is one of these rules per form of H (gradalg.methods.influence.AUTO_DAMPING).

No rule reads the ground truth: only the curvature. Rows go to
``build/auto_damping/results-<setting>.json`` (resumable: done rows are skipped), the
table (per rule: LDS per method × setting, its worst case and mean) by ``--report``.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/auto_damping.py --settings logreg,mlp,lm,lm2
    PYTHONPATH=. python benchmarks/auto_damping.py --report
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradalg as ga  # noqa: E402
from gradalg.linalg.autodamp import DampingRule  # noqa: E402

OUT = ROOT / "build" / "auto_damping"

VARIANTS = {
    "default": None,
    "abs 1e-3": 1e-3,
    "mass 0.9": DampingRule("mass", 0.9),
    "mass 0.95": DampingRule("mass", 0.95),
    "mass 0.99": DampingRule("mass", 0.99),
    "mass 0.999": DampingRule("mass", 0.999),
    "effdim 1": DampingRule("effdim", 1.0),
    "mean 0.1": DampingRule("mean", 0.1),
    "mean 1": DampingRule("mean", 1.0),
    "mass 0.95 global": DampingRule("mass", 0.95, per_block=False),
    "mass 0.99 global": DampingRule("mass", 0.99, per_block=False),
}


def digits_setting(name):
    import fidelity as F
    s = F.SETTINGS[name]
    s.prepare()
    gt = ga.eval.retrain(s.train_fn, F.N_TRAIN, n_subsets={"logreg": 100, "mlp": 50}[name], fraction=F.FRACTION,
                         seed=0, targets_fn=s.query_losses, target="loss",
                         store=F.CACHE / f"{s.name}-n{F.N_TRAIN}-q{F.N_QUERY}-wd{F.WD:g}-tol{s.tol_subset:g}")
    task, tr, qu = s.task(), s.train, s.queries
    m = ga.methods
    methods = {
        "influence GN": lambda d: m.influence(task, tr, qu, curvature="gauss_newton", **d),
        "influence K-FAC": lambda d: m.influence(task, tr, qu, curvature="kfac", **d),
        "influence EK-FAC": lambda d: m.influence(task, tr, qu, curvature="ekfac", **d),
        "trak": lambda d: m.trak([task], tr, qu, **d),
        "logra": lambda d: m.logra(task, tr, qu, **d),
        "grass": lambda d: m.grass(task, tr, qu, **d),
        "relatif": lambda d: m.relatif(task, tr, qu, **d),
    }
    models, optimizers, _ = s.trajectory("adam")
    methods["trackstar"] = lambda d: m.trackstar(s.task(models[-1]), tr, qu, optimizer=optimizers[-1], **d)
    return methods, gt


def lm_setting(name, n_subsets=None):
    import fidelity_lm as FL
    p = FL.Prepared(FL.SETTINGS[name], n_subsets or FL.N_SUBSETS)
    task, tr, qu, L = p.task(), p.train, p.queries[:p.n_query], FL.LAYERS
    m = ga.methods
    methods = {
        "influence GN sparse 2048": lambda d: m.influence(task, tr, qu, layers=L, projector=ga.proj.sparse(2048, seed=0),
                                                          **d),
        "influence K-FAC": lambda d: m.influence(task, tr, qu, layers=L, curvature="kfac", **d),
        "influence EK-FAC": lambda d: m.influence(task, tr, qu, layers=L, curvature="ekfac", **d),
        "trak": lambda d: m.trak(task, tr, qu, layers=L, **d),
        "logra": lambda d: m.logra(task, tr, qu, layers=L, **d),
        "grass": lambda d: m.grass(task, tr, qu, layers=L, **d),
        "relatif": lambda d: m.relatif(task, tr, qu, layers=L, curvature="ekfac", **d),
    }
    return methods, p.truth.isel(query=slice(0, p.n_query))


def run(name, only_methods=None, only_variants=None, lm_subsets=None):
    torch.set_num_threads(1)
    ga.options(progress=False)
    methods, gt = digits_setting(name) if name in ("logreg", "mlp") else lm_setting(name, lm_subsets)
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"results-{name}.json"
    rows = json.loads(out.read_text()) if out.exists() else []
    done = {(r["method"], r["variant"]) for r in rows}
    for method, fn in methods.items():
        if only_methods and method not in only_methods:
            continue
        for label, damping in VARIANTS.items():
            if (only_variants and label not in only_variants) or (method, label) in done:
                continue
            row = {"setting": name, "method": method, "variant": label}
            try:
                S = fn({} if damping is None else {"damping": damping})
                t0 = time.perf_counter()
                values = S.compute()
                row["seconds"] = time.perf_counter() - t0
                r = ga.eval.lds(values[:gt.sizes["query"]], gt, target="loss", bootstrap=500, resample="both")
                row.update(lds=float(r.mean), low=float(r.interval[0]), high=float(r.interval[1]),
                           n_subsets=int(gt.sizes["subset"]))
                print(f"[{name}] {method:26s} {label:18s} LDS {row['lds']:.3f} [{row['low']:.3f}, {row['high']:.3f}]"
                      f" {row['seconds']:.1f} s", flush=True)
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                print(f"[{name}] {method:26s} {label:18s} skipped: {row['skipped']}", flush=True)
            rows = json.loads(out.read_text()) if out.exists() else []     # another process may have added rows
            rows = [x for x in rows if (x["method"], x["variant"]) != (method, label)] + [row]
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(rows, indent=1))
            tmp.replace(out)


def report(settings):
    """Markdown: per method, LDS per setting × rule, and each rule's worst case and mean."""
    rows = []
    for s in settings:
        f = OUT / f"results-{s}.json"
        if f.exists():
            rows += json.loads(f.read_text())
    by = {(r["setting"], r["method"], r["variant"]): r for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = []
    for method in methods:
        present = [s for s in settings if any((s, method, v) in by for v in VARIANTS)]
        lines += [f"\n**{method}**\n", "| rule | " + " | ".join(present) + " | worst | mean |",
                  "|---|" + "---:|" * (len(present) + 2)]
        for v in VARIANTS:
            cells, values = [], []
            for s in present:
                r = by.get((s, method, v))
                if r is None:
                    cells.append("")
                elif "skipped" in r:
                    cells.append("refused")
                else:
                    cells.append(f"{r['lds']:.3f} [{r['low']:.3f}, {r['high']:.3f}]")
                    values.append(r["lds"])
            if not any(cells):
                continue
            summary = [f"{min(values):.3f}", f"{np.mean(values):.3f}"] if len(values) == len(present) else ["", ""]
            lines.append(f"| {v} | " + " | ".join(cells) + " | " + " | ".join(summary) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="logreg,mlp,lm,lm2")
    ap.add_argument("--methods", default=None, help="comma-separated method labels")
    ap.add_argument("--variants", default=None, help="comma-separated labels of VARIANTS")
    ap.add_argument("--report", action="store_true", help="print the table from the results files")
    ap.add_argument("--lm-subsets", type=int, default=None,
                    help="score the LMs on their first N retrained subsets (default fidelity_lm's 50)")
    args = ap.parse_args(argv)
    settings = args.settings.split(",")
    if args.report:
        print(report(settings))
        return
    for name in settings:
        run(name, set(args.methods.split(",")) if args.methods else None,
            set(args.variants.split(",")) if args.variants else None, args.lm_subsets)


if __name__ == "__main__":
    main()
