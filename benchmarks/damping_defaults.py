"""Damping defaults, absolute versus relative to the curvature's spectrum, measured by LDS.

The setting of ``benchmarks/fidelity.py`` (digits, 500 training examples, 100 queries,
50 retrained 50 % subsets, float64; the MLP 64 → 32 → 10 by default). For the influence
function with the Gauss-Newton (direct), K-FAC and EK-FAC curvatures, compare

    absolute   λ = 1e-3                                  (the default before issue 15)
    relative   λ = c × mean eigenvalue of H, c ∈ {1e-4, …, 1}   (0.1 is Kronfluence's)

each without and with the objective's weight decay (wd = 1e-3, what the models were trained
with; ``weight_decay=`` adds wd·I).  ``--curvatures``, ``--variants``, ``--wd`` pick a subset. Every number is one ``Scores.compute()``; the ground
truth is cached under ``benchmarks/.cache`` (shared with fidelity.py).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/damping_defaults.py [--settings mlp,logreg]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fidelity as F  # noqa: E402

import gradalg as ga  # noqa: E402

VARIANTS = {
    "absolute 1e-3": dict(damping=1e-3),
    "relative 1e-4": dict(relative_damping=1e-4),
    "relative 1e-3": dict(relative_damping=1e-3),
    "relative 0.01": dict(relative_damping=0.01),
    "relative 0.1": dict(relative_damping=0.1),
    "relative 0.5": dict(relative_damping=0.5),
    "relative 1": dict(relative_damping=1.0),
}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", default="mlp")
    parser.add_argument("--curvatures", default="gauss_newton,kfac,ekfac")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated labels of VARIANTS")
    parser.add_argument("--wd", default="0,1e-3", help="weight decays passed (0: none)")
    args = parser.parse_args(argv)
    for name in args.settings.split(","):
        setting = F.SETTINGS[name]
        setting.prepare()
        gt = ga.eval.retrain(setting.train_fn, F.N_TRAIN, n_subsets=F.N_SUBSETS, fraction=F.FRACTION, seed=0,
                             targets_fn=setting.query_losses, target="loss",
                             store=F.CACHE / f"{setting.name}-n{F.N_TRAIN}-q{F.N_QUERY}-wd{F.WD:g}"
                                             f"-tol{setting.tol_subset:g}")
        print(f"[{name}] {setting.description}", flush=True)
        print(f"  {'curvature':14s} {'damping':16s} {'wd':>6s}  LDS [95% CI]", flush=True)
        for curvature in args.curvatures.split(","):
            for label in args.variants.split(","):
                kwargs = VARIANTS[label]
                for wd in (float(x) or None for x in args.wd.split(",")):
                    S = ga.methods.influence(setting.task(), setting.train, setting.queries, curvature=curvature,
                                             weight_decay=wd, **kwargs)
                    r = ga.eval.lds(S.compute(), gt, target="loss", bootstrap=1000)
                    print(f"  {curvature:14s} {label:16s} {wd or 0:6g}  {r.mean:.3f} "
                          f"[{r.interval[0]:.3f}, {r.interval[1]:.3f}]", flush=True)


if __name__ == "__main__":
    main()
