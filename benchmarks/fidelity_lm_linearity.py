"""Is a GPT-2 training run of ``benchmarks/fidelity_lm.py`` linear in its data weights?

The unrolled protocol's ground truth retrains the replayable run with data weights
ε = 1_S (a 50 % subset S); MAGIC's prediction is the first-order term,
f(1 + d) − f(1) ≈ ∇_ε f · d with d = 1_S − 1. This script walks along d:

    Δf(α) = f(1 + α d) − f(1)        against        α ∇_ε f · d        (α = 0.01 … 1)

for each of the first ``--queries`` queries (∇_ε f from MAGIC's cached scores, so run
``fidelity_lm.py --magic-only`` first) and prints, per subset and α, the mean |Δf|, the
mean |prediction|, their Pearson correlation over the queries and the relative error
mean|Δf − pred| / mean|Δf|. A run that is smooth in ε has |Δf| ∝ α and a relative error
→ 0 as α → 0 (the digits MLP runs of ``benchmarks/unrolled.py``); a run that is not
(a chaotic one: a perturbation grows through the steps until it saturates) has |Δf|
far above the prediction already at α = 0.01, and no first-order method can predict its
retraining.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/fidelity_lm_linearity.py --settings lm2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity_lm as F  # noqa: E402
from gradalg.eval.retraining import subset_masks  # noqa: E402

ALPHAS = (1e-6, 1e-4, 0.01, 0.1, 0.3, 1.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="lm2")
    ap.add_argument("--queries", type=int, default=8, help="a multiple of fidelity_lm.MAGIC_CHUNK")
    ap.add_argument("--subsets", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.settings.split(","):
        p = F.Prepared(F.SETTINGS[name], protocol="unrolled", queries=args.queries, retrain=False)
        grad = -F.CachedMagic(p, p.n_query).compute().values.astype(np.float64)     # (n_query, n_train) ∂f/∂ε
        queries = {k: v[:p.n_query] for k, v in p.query_batch.items()}

        def f(w):
            with torch.no_grad():
                model = p.run.train(torch.as_tensor(w, dtype=torch.float32))
                return F.query_token_loss_sums(model, queries).double().numpy()     # (n_query,)

        n = p.setting.n_train
        base = f(np.ones(n))
        print(f"[{name}] {p.setting.describe()}; {p.n_query} queries; Δf = f(1 + αd) − f(1), d = 1_S − 1")
        print(f"  {'subset':>6} {'α':>6} {'mean |Δf|':>10} {'mean |α∇f·d|':>13} {'Pearson':>8} {'rel. error':>10}")
        for j, mask in enumerate(subset_masks(n, args.subsets, F.FRACTION, F.SUBSET_SEED)):
            d = mask.astype(np.float64) - 1.0
            slope = grad @ d                                                          # (n_query,)
            for a in ALPHAS:
                t0 = time.perf_counter()
                actual, pred = f(1.0 + a * d) - base, a * slope
                print(f"  {j:>6} {a:>6g} {np.abs(actual).mean():>10.4f} {np.abs(pred).mean():>13.4f} "
                      f"{np.corrcoef(actual, pred)[0, 1]:>8.3f} {np.abs(actual - pred).mean() / np.abs(actual).mean():>10.3f}"
                      f"   ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
