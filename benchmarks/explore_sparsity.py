"""Where a language model's LDS is lost: the scores' sign, size and language (issue 31).

On the synthetic-language settings of ``benchmarks/fidelity_lm.py`` (``lm``, ``lm2``) every
training sequence has a language label. This script scores the queries with a method at its
defaults (RelatIF, influence) and reads the LDS of the *same scores* reduced in ways that need
no retraining, against the setting's multi-run ground truth:

* the language alone: τ_qi = 1 if lang(i) = lang(q) else 0 (and the per-query means of the
  scores within / across languages): how much of the LDS the language explains;
* the scores within the query's language only (the rest set to 0), and across it only;
* the positive scores only (max(τ, 0)), the top m per query, the m largest |τ|;
* a power of the scores, sign(τ)·|τ|^p, and soft thresholds sign(τ)·max(|τ| − c·sd_q, 0).

Every reduction but the language ones keeps each query's ranking of the training examples
(the power and the positive part are monotone); only the sums over a subset, which the LDS
correlates with the retrained losses, change. These are measurements, not a method: a score
that is summed over a group predicts the group's effect to first order, and what a
reduction gains here says which scores carry the retrained effect, not that the reduction is
right elsewhere (it is not measured on any other setting).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/explore_sparsity.py --settings lm2,lm
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import xarray as xr

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity_lm as F  # noqa: E402
import gradalg as ga  # noqa: E402



def reductions(S: np.ndarray, same: np.ndarray | None) -> dict[str, np.ndarray]:
    """Each reduction of the (n_query, n_train) scores ``S`` by name; ``same`` (n_query,
    n_train) is 1 where the training sequence is in the query's language (None: a setting
    without languages, no language reductions)."""
    out = {"scores as they are": S}
    if same is not None:
        m_same = (S * same).sum(1, keepdims=True) / same.sum(1, keepdims=True)
        m_other = (S * (1 - same)).sum(1, keepdims=True) / (1 - same).sum(1, keepdims=True)
        out["language alone (1 if same)"] = same
        out["per-language means of the scores"] = np.where(same > 0, m_same, m_other)
        out["within the query's language only"] = np.where(same > 0, S, 0.0)
        out["across languages only"] = np.where(same > 0, 0.0, S)
    out["positive part max(τ, 0)"] = np.maximum(S, 0.0)
    for m in (16, 64):
        out[f"top {m} per query"] = np.where(S >= np.sort(S, 1)[:, -m][:, None], S, 0.0)
        out[f"{m} largest |τ| per query"] = np.where(np.abs(S) >= np.sort(np.abs(S), 1)[:, -m][:, None], S, 0.0)
    for p in (1.5, 2.0, 3.0):
        out[f"sign(τ)·|τ|^{p:g}"] = np.sign(S) * np.abs(S) ** p
    sd = S.std(1, keepdims=True)
    for c in (1.0, 2.0):
        out[f"soft threshold at {c:g}·sd"] = np.sign(S) * np.maximum(np.abs(S) - c * sd, 0.0)
    return out


MONOTONE = ("scores as they are", "positive part max(τ, 0)", "top 16 per query", "sign(τ)·|τ|^1.5",
            "sign(τ)·|τ|^2", "soft threshold at 1·sd")


def _cell(text: str) -> str:
    """``text`` in a markdown table cell (its ``|`` escaped)."""
    return text.replace("|", "\\|")


def lds(tau: np.ndarray, truth: xr.Dataset, bootstrap: int) -> tuple[float, tuple]:
    S = xr.DataArray(tau, dims=("query", "train"),
                     coords={"query": truth["query"].values, "train": np.arange(tau.shape[1])})
    r = ga.eval.lds(S, truth, target="loss", bootstrap=bootstrap, resample="both")
    return float(r.mean), tuple(r.interval) if r.interval is not None else (float("nan"),) * 2


def language_table(name: str, runs: int, methods, bootstrap: int) -> str:
    """The language diagnostics of ``lm`` / ``lm2``: every reduction of the defaults' scores."""
    p, truth, rows = lm_rows(name, runs, only=methods)
    same = (p.lang_q[:p.n_query, None] == p.lang[None, :]).astype(float)
    scores = {method: S for (method, _), S in rows.items()}
    cols = {m: {k: lds(v, truth, bootstrap) for k, v in reductions(scores[m], same).items()} for m in methods}
    lines = [f"`{name}` ({runs}-run ground truth, {truth.sizes['subset']} subsets, {p.n_query} queries)", "",
             "| reduction | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for k in next(iter(cols.values())):
        lines.append(f"| {_cell(k)} | " + " | ".join(f"{c[k][0]:.3f} [{c[k][1][0]:.3f}, {c[k][1][1]:.3f}]"
                                              for c in cols.values()) + " |")
    return "\n".join(lines)


def lm_rows(name: str, runs: int = 4, only=None):
    """(the prepared setting, its ``runs``-run ground truth, {(method, config): scores}) of ``lm``
    / ``lm2``'s default rows (the task's default layers; ``fidelity_lm.method_rows``' first rows,
    not the blocks-only twins; ``only``: these methods), computed once into
    ``build/fidelity/explore-sparsity-<key>-<method>-<slug>.npy``."""
    import hashlib
    p = F.Prepared(F.SETTINGS[name], seeds_per_subset=runs)
    rows = {}
    for method, config, thunk in F.method_rows(p):
        if F.BLOCKS_ONLY in config or not (config == "" or config.startswith(("defaults", "3 checkpoints"))) or (
                only and method not in only):
            continue
        slug = hashlib.sha256(f"{method}|{config}".encode()).hexdigest()[:10]
        cache = F.BUILD / f"explore-sparsity-{p.key}-{method}-{slug}.npy"
        if not cache.exists():
            t = time.perf_counter()
            np.save(cache, np.asarray(thunk().compute()[:p.n_query].transpose("query", "train").values))
            print(f"  {name} {method} {config}: {time.perf_counter() - t:.1f} s", flush=True)
        rows[method, config] = np.load(cache)
    return p, p.truth.isel(query=slice(0, p.n_query)), rows


DIGITS_METHODS = ("influence", "relatif", "trak", "logra", "grass", "grad_dot", "grad_cos", "tracin", "less",
                  "trackstar")


def digits_rows(name: str):
    """(ground truth, {(method, "defaults"): scores}) of a digits setting of
    ``benchmarks/fidelity.py`` (``logreg``, ``mlp``, ``mlp_adam``, ``conv_wd``, …): every
    method at its defaults, called as that benchmark calls it, computed once into
    ``build/fidelity/explore-sparsity-<setting>-<method>.npy``."""
    import fidelity as D
    setting = D.SETTINGS[name]
    setting.prepare()
    truth = D.ground_truth(setting)
    rows = {}
    for method in DIGITS_METHODS:
        cache = F.BUILD / f"explore-sparsity-digits-{name}-{method}.npy"
        if not cache.exists():
            S = D.call_method(method, setting, {}).compute()
            np.save(cache, np.asarray(S.transpose("query", "train").values))
        rows[method, "defaults"] = np.load(cache)
    return truth, rows


def cached_rows(name: str):
    """(ground truth, {(method, config): (n_query, n_train) scores}) of a setting's default rows
    whose scores its benchmark has cached (``--configs defaults``), without computing any."""
    if name in ("text", "instruct"):
        import fidelity_text as T
        p = T.Prepared(T.SETTINGS[name])
        rows = {}
        for method, config, _ in T.method_rows(p):
            slug = T.hashlib.sha256(f"{method}|{config}".encode()).hexdigest()[:10]
            path = T.BUILD / f"scores-{p.key}-{method}-{slug}.npz"
            if config.startswith("defaults") and path.exists():
                with np.load(path) as z:
                    rows[method, config] = z["values"]
        return p.truth, rows
    import fidelity_more as M
    import torch
    s = M.SETTINGS[name]()
    truth = M.ground_truth(s)
    model = s.new_model(M.TRAINING_SEED)
    snapshots = [(model, torch.optim.Adam(model.parameters()))] * M.CHECKPOINTS
    rows = {}
    for method, config, _ in M.method_rows(s, model, snapshots):
        path = M.scores_path(s, method, config)
        if config.startswith("defaults") and path.exists():
            with np.load(path) as z:
                rows[method, config] = z["values"]
    return truth, rows


def monotone_table(names, bootstrap: int) -> str:
    """Per setting, the best default row's LDS under each monotone reduction, and each
    reduction's change of every default row."""
    per = {}
    for name in names:
        if name in F.SETTINGS:
            _, truth, rows = lm_rows(name)
        elif name in ("logreg", "mlp", "mlp_gelu", "mlp_adam", "conv_wd"):
            truth, rows = digits_rows(name)
        else:
            truth, rows = cached_rows(name)
        per[name] = {row: {k: lds(v, truth, bootstrap) for k, v in reductions(S, None).items() if k in MONOTONE}
                     for row, S in rows.items()}
    lines = ["| setting (rows) | " + " | ".join(map(_cell, MONOTONE)) + " |", "|---|" + "---:|" * len(MONOTONE)]
    for name, rows in per.items():
        best = {k: max(rows.values(), key=lambda r: r[k][0])[k][0] for k in MONOTONE}
        lines.append(f"| `{name}` best default ({len(rows)}) | " + " | ".join(f"{best[k]:.3f}" for k in MONOTONE) + " |")
        deltas = {k: [r[k][0] - r[MONOTONE[0]][0] for r in rows.values()] for k in MONOTONE}
        lines.append(f"| `{name}` change of each row: min / mean / max | " + " | ".join(
            f"{min(d):+.3f} / {np.mean(d):+.3f} / {max(d):+.3f}" for d in deltas.values()) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="lm2,lm", help="language diagnostics (lm, lm2)")
    ap.add_argument("--methods", default="relatif,influence")
    ap.add_argument("--seeds-per-subset", type=int, default=4)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--monotone", default=None,
                    help="settings for the monotone reductions of every cached default row "
                         "(lm, lm2, text, instruct, llama, conv, seqcls)")
    args = ap.parse_args(argv)
    if args.monotone:
        print(monotone_table(args.monotone.split(","), args.bootstrap))
        return
    for name in args.settings.split(","):
        print("\n" + language_table(name, args.seeds_per_subset, args.methods.split(","), args.bootstrap))


if __name__ == "__main__":
    main()
