"""Damping rules of the dense Gauss-Newton influence, many at once, on the settings where
``curvature="auto"`` is the dense Gauss-Newton (logreg, mlp, conv): issue 31 item 3's pooled-λ
variants of ``damping="auto"`` and item 6's digits-MLP damping grid.

H (undamped, the library's own ``CURVATURE_TABLE["gauss_newton"]`` in the default layers), the
training gradients G (n, d) and the query gradients Q (m, d) are materialised once per setting
(cached in ``build/explore/<setting>.npz``); each rule's λ_b (one per block b of H's space, from
:func:`gradalg.linalg.autodamp.rule_lambda` on H_bb's eigenvalues, or one λ from the pooled
spectrum) gives the scores ``Q (H + diag(λ_b I_b) + wd I)⁻¹ Gᵀ`` by one float64 Cholesky solve,
and their LDS against the setting's cached ground truth (``defaults_suite.load_truth``;
``bootstrap`` resamples for the interval). No rule reads the ground truth. The library rows
``defaults (curvature='auto')`` (pooled mean 1) and ``damping='auto'`` (per-block mass 0.95)
are recomputed here as a check: their LDS must equal the suite's.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/explore_damping.py --settings logreg,mlp,conv

Writes ``build/fidelity/explore-damping-<setting>.json`` (rule → λ per block, LDS, interval).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradalg as ga  # noqa: E402
from gradalg.linalg.autodamp import DampingRule, rule_lambda  # noqa: E402

import defaults_suite as D  # noqa: E402

LOCAL = ROOT / "build" / "explore"


def materialise(name: str):
    """(H (d, d), G (n, d), Q (m, d), block slices, truth spec) of one setting, cached."""
    path = LOCAL / f"{name}.npz"
    ctx = None
    if not path.exists():
        from gradalg.methods.influence import CURVATURE_TABLE, grads
        ctx = D.context(name)
        t0 = time.perf_counter()
        H = CURVATURE_TABLE["gauss_newton"].build(ctx.task, ctx.train, ctx.layers, lambda g: g, "direct", {})
        Hd = H.to_dense().to(torch.float64).numpy()
        offsets = H.space.offsets()

        def flat(gs):
            dense = gs.to_dense()
            return np.concatenate([dense[b].reshape(dense[b].shape[0], -1).to(torch.float64).numpy()
                                   for b in offsets], axis=1)
        G = flat(grads(ctx.task, ctx.train, ctx.layers))
        Q = flat(grads(ctx.task, ctx.queries, ctx.layers))
        LOCAL.mkdir(parents=True, exist_ok=True)
        np.savez(path, H=Hd, G=G, Q=Q, names=np.array(list(offsets)),
                 starts=np.array([s.start for s in offsets.values()]),
                 stops=np.array([s.stop for s in offsets.values()]),
                 truth=json.dumps(ctx.truth_spec), seconds=time.perf_counter() - t0)
    z = np.load(path)
    blocks = {str(n): slice(int(a), int(b)) for n, a, b in zip(z["names"], z["starts"], z["stops"])}
    return z["H"], z["G"], z["Q"], blocks, json.loads(str(z["truth"]))


def lambdas(H, blocks, rule: str, value: float, floor: float = 0.0):
    """λ per coordinate (d,) of ``rule``: ``pooled-<kind>`` one λ from H's full spectrum, ``block-<kind>``
    λ_b from H_bb's; ``floor`` > 0: λ_b at least floor × H's pooled mean eigenvalue."""
    scope, kind = rule.split("-")
    d = H.shape[0]
    lam = np.zeros(d)
    pooled_mean = np.trace(H) / d
    if scope == "pooled":
        mu = torch.from_numpy(np.linalg.eigvalsh((H + H.T) / 2))
        lam[:] = rule_lambda(DampingRule(kind, value), mu)
    else:
        for s in blocks.values():
            hb = H[s, s]
            mu = torch.from_numpy(np.linalg.eigvalsh((hb + hb.T) / 2))
            lam[s] = rule_lambda(DampingRule(kind, value), mu)
    return np.maximum(lam, floor * pooled_mean)


def scores(H, G, Q, lam, wd=0.0):
    A = H + np.diag(lam + wd)
    L = np.linalg.cholesky((A + A.T) / 2)
    X = np.linalg.solve(L.T, np.linalg.solve(L, G.T))          # A⁻¹ Gᵀ (d, n)
    return Q @ X                                                 # (m, n)


RULES = [  # (label, rule, value, floor, wd)
    ("pooled mean 1 (default)", "pooled-mean", 1.0, 0.0, 0.0),
    ("block mass 0.95 (auto)", "block-mass", 0.95, 0.0, 0.0),
    ("pooled mean 0.1", "pooled-mean", 0.1, 0.0, 0.0),
    ("pooled mean 0.3", "pooled-mean", 0.3, 0.0, 0.0),
    ("pooled mean 3", "pooled-mean", 3.0, 0.0, 0.0),
    ("pooled mean 10", "pooled-mean", 10.0, 0.0, 0.0),
    ("pooled mass 0.9", "pooled-mass", 0.9, 0.0, 0.0),
    ("pooled mass 0.95", "pooled-mass", 0.95, 0.0, 0.0),
    ("pooled mass 0.99", "pooled-mass", 0.99, 0.0, 0.0),
    ("block mass 0.9", "block-mass", 0.9, 0.0, 0.0),
    ("block mass 0.99", "block-mass", 0.99, 0.0, 0.0),
    ("block mean 1", "block-mean", 1.0, 0.0, 0.0),
    ("block mean 0.3", "block-mean", 0.3, 0.0, 0.0),
    ("pooled effdim 1", "pooled-effdim", 1.0, 0.0, 0.0),
    ("block effdim 1", "block-effdim", 1.0, 0.0, 0.0),
    ("block mass 0.95, floor 0.1 pooled mean", "block-mass", 0.95, 0.1, 0.0),
    ("block mass 0.95, floor 0.3 pooled mean", "block-mass", 0.95, 0.3, 0.0),
    ("block mass 0.95, floor 1 pooled mean", "block-mass", 0.95, 1.0, 0.0),
    ("block mean 1, floor 1 pooled mean", "block-mean", 1.0, 1.0, 0.0),
]


def lds(values, truth, bootstrap):
    import xarray as xr
    v = xr.DataArray(values[:truth.sizes["query"]], dims=("query", "train"))
    r = ga.eval.lds(v, truth, target="loss", bootstrap=bootstrap, resample="both")
    out = {"lds": float(r.mean)}
    if bootstrap:
        out.update(low=float(r.interval[0]), high=float(r.interval[1]))
    return out


def run(name: str, bootstrap: int, wd: float | None):
    H, G, Q, blocks, spec = materialise(name)
    truth = D.load_truth(spec)
    out_path = D.BUILD / f"explore-damping-{name}.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    rules = list(RULES)
    if wd:
        rules += [(f"weight decay {wd:g} only", "pooled-mean", 1e-300, 0.0, wd),
                  (f"pooled mean 1 + weight decay {wd:g}", "pooled-mean", 1.0, 0.0, wd),
                  (f"block mass 0.95 + weight decay {wd:g}", "block-mass", 0.95, 0.0, wd)]
    pooled_mean = np.trace(H) / H.shape[0]
    sizes = {b: s.stop - s.start for b, s in blocks.items()}
    print(f"[{name}] d={H.shape[0]} blocks={sizes} pooled mean eigenvalue {pooled_mean:.3e}", flush=True)
    for label, rule, value, floor, w in rules:
        lam = lambdas(H, blocks, rule, value, floor)
        row = lds(scores(H, G, Q, lam, w), truth, bootstrap)
        row["lambda_over_pooled_mean"] = {b: float(lam[s.start] / pooled_mean) for b, s in blocks.items()}
        results[label] = row
        ci = f" [{row['low']:.3f}, {row['high']:.3f}]" if "low" in row else ""
        lam_txt = ", ".join(f"{v:.2g}" for v in row["lambda_over_pooled_mean"].values())
        print(f"  [{name}] {label:42s} LDS {row['lds']:.3f}{ci}   λ_b/mean: {lam_txt}", flush=True)
        out_path.write_text(json.dumps(results, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="logreg,mlp,conv")
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--wd", type=float, default=None, help="also rules with this weight decay added")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ga.options(progress=False)
    for name in args.settings.split(","):
        run(name, args.bootstrap, args.wd)


if __name__ == "__main__":
    main()
