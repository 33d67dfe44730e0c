"""Sum vs mean over each training sequence's tokens (issue 31 item 2), measured on the cached
scores of every ``defaults_suite`` row of the LM settings trained on the per-sequence *mean*
token loss (lm, lm2, text, llama: ``L_i / T_i`` averaged over the batch, T_i = sequence i's
counted target tokens).

``ga.tasks.causal_lm``'s loss is the *sum* ``L_i`` (Kronfluence's and Bergson's convention, and
what the HF Trainer's token mean over a batch weighs each sequence by). The objective these
settings were trained on weighs sequence i by 1/T_i, so the first-order effect of removing it
is ∝ ∇(L_i / T_i) = ∇L_i / T_i: a method's training-side gradient rescaled by 1/T_i, i.e.
``G.scale(1 / T)``. For methods linear in the training gradient with a curvature that does not
depend on that scale (gradient dot/cos, TracIn, the preconditioned scores with H fixed) that is
exactly column i of the scores × 1/T_i; for influence it leaves H as the sum-loss Gauss-Newton
(the objective's H is Σ_i H_i / T_i), a first-order check. The query side does not matter: a
constant per query (sum vs mean over the query's tokens) leaves each query's LDS unchanged.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/explore_normalisation.py

Writes ``build/fidelity/explore-normalisation.json`` (setting → row → sum / mean LDS).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import xarray as xr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradalg as ga  # noqa: E402

import defaults_suite as D  # noqa: E402


def counted_tokens(name: str) -> np.ndarray:
    """(n_train,) T_i: the target tokens of each training sequence (length − 1)."""
    if name in ("lm", "lm2"):
        import fidelity_lm as FL
        s = FL.SETTINGS[name]
        train, _ = FL.make_corpus(s, s.n_train // len(s.steps), s.corpus_seed)
    elif name == "text":
        import fidelity_text as FT
        _, train, _ = FT.make_data(FT.SETTINGS[name])
    else:
        import fidelity_more as FM
        train = FM.SETTINGS[name]().train
    return np.array([float(x["attention_mask"].sum()) - 1 for x in train])


def main():
    out = {}
    for name in ("lm", "lm2", "text", "llama"):
        T = counted_tokens(name)
        data = D._read(name)
        truth = D.load_truth(data["truth"])
        print(f"[{name}] T_i in [{T.min():.0f}, {T.max():.0f}], mean {T.mean():.1f}", flush=True)
        out[name] = {"T_min": T.min(), "T_max": T.max(), "rows": {}}
        for r in data["rows"]:
            if "scores" not in r or "lds" not in r:
                continue
            with np.load(D.cached(r["scores"])) as z:
                v = np.asarray(z["values"])[:truth.sizes["query"]]
            res = ga.eval.lds(xr.DataArray(v / T[None, :], dims=("query", "train")), truth, target="loss",
                              bootstrap=200, resample="both")
            key = f"{r['method']} | {r['config']}"
            out[name]["rows"][key] = dict(sum=r["lds"], sum_low=r["low"], mean=float(res.mean),
                                          mean_low=float(res.interval[0]), mean_high=float(res.interval[1]))
            print(f"  [{name}] {key:60s} sum {r['lds']:.3f}  mean {res.mean:.3f} "
                  f"[{res.interval[0]:.3f}, {res.interval[1]:.3f}]  Δ {res.mean - r['lds']:+.3f}", flush=True)
        (D.BUILD / "explore-normalisation.json").write_text(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
