"""Markdown tables from the fidelity results (``build/fidelity/results-<setting>.json``).

Written by ``benchmarks/fidelity.py`` (digits: logreg, mlp) and
``benchmarks/fidelity_lm.py`` (GPT-2: lm, lm2). One table per setting: LDS with its
95 % bootstrap interval (over queries and subsets), the wall time of
``Scores.compute()`` and that time over one plain forward + backward pass over the
training set.

    python benchmarks/fidelity_report.py                 # every setting found
    python benchmarks/fidelity_report.py --settings lm,lm2
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

BUILD = Path(__file__).resolve().parents[1] / "build" / "fidelity"


def load(setting: str, root: Path = BUILD) -> dict:
    return json.loads((root / f"results-{setting}.json").read_text())


def table(result: dict) -> str:
    bases = [r["seconds"] / r["cost"] for r in result["rows"] if r.get("cost")]     # each run measured its own
    base = (f"{min(bases) * 1e3:.1f}–{max(bases) * 1e3:.1f} ms (measured in each run)" if bases and
            max(bases) > 1.05 * min(bases) else f"{result['fwd_bwd_seconds'] * 1e3:.1f} ms")
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default=None)
    args = ap.parse_args(argv)
    names = (args.settings.split(",") if args.settings
             else sorted(p.stem.removeprefix("results-") for p in BUILD.glob("results-*.json")))
    for name in names:
        print(table(load(name)) + "\n")


if __name__ == "__main__":
    main()
