"""Ensembles on the three-run settings: a method at its defaults averaged over models trained
with other seeds, on random 50 % subsets, or over checkpoints (issue 31 item 6).

For ``text`` / ``instruct`` (``benchmarks/fidelity_text.py``) and ``llama`` / ``conv`` /
``seqcls`` (``benchmarks/fidelity_more.py``), against the same ground truths (3 runs per
subset, targets averaged). ``ga.methods.ensemble(method, tasks, train, queries)`` =
``ga.mean`` of one expression per member (the method at its defaults on each member's task).
Each row's method runs at its defaults on the task's default layers, or with
``layers="all"`` where its configuration says so. Members, as ``fidelity_lm.py --rows
ensembles``:

* **seeds**: the setting's own full-data model (seed 0) and M − 1 more trained on every
  example with seeds 1 … M − 1 (initialisation and batch stream);
* **subsets** (TRAK's recipe): M models, model m on the m-th random 50 % subset of
  ``ga.eval.subset_masks(n, M, 0.5, seed=1)`` (independent of the ground truth's seed 0)
  with seed m + 1;
* **checkpoints**: the last c of 10 evenly spaced snapshots of each of S full-data runs
  (seeds 0 … S − 1).

Members are trained once per process and shared between rows; a row's **seconds** are the
scoring's wall time plus the training time of every member it uses beyond the setting's own
run (its seed-0 run and that run's snapshots are free: a user has them), so the cost column
(÷ one forward + backward over the training set, measured in the same process) is what the
ensemble costs a user. Rows go into the setting's standard results file
(``build/fidelity/results-<setting>-k3.json``), scores cached under
``build/fidelity/ensemble-<key>-<row>.npz``, keyed by the row's label and checked, as the
standard rows' caches are (:func:`fidelity_lm.cache_is_current`), against the row's expression
token kept beside the scores (:func:`row_token`: the method at the row's arguments on the
setting's own model, every resolved argument and default included): an entry written under
another default, or before tokens were kept, is recomputed with the reason printed, not
served under its label.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/fidelity_ensembles.py --settings text,instruct,llama
    ... --methods relatif       # rows of these methods only
    ... --first 5               # the first 5 rows of ROWS only
    ... --rows 7,10             # rows 7 and 10 of ROWS only
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradalg as ga  # noqa: E402

BUILD = ROOT / "build" / "fidelity"
ENSEMBLE_SUBSET_SEED, SNAPSHOTS = 1, 10

#: (method name, members' kind, members or runs, last checkpoints, the method's arguments) rows:
#: the method at its defaults on the task's default layers, then with every layer the capture
#: attributes (``layers="all"``: the embedding / head too, which lifts one model most on text)
#: RelatIF's rows keep damping=1e-3, its default when they were measured (2026-12-05; "auto" since):
#: the label names it, so that the cached scores stay what the label says
ALL = {"layers": "all"}
R, RALL = {"damping": 1e-3}, {"layers": "all", "damping": 1e-3}
ROWS = (("relatif", "seeds", 5, 1, R), ("relatif", "checkpoints", 1, 5, R),
        ("relatif", "seeds", 5, 1, RALL), ("relatif", "seeds", 10, 1, RALL), ("influence", "seeds", 10, 1, ALL),
        ("relatif", "checkpoints", 5, 5, RALL), ("relatif", "subsets", 10, 1, RALL),
        ("relatif", "checkpoints", 1, 10, R), ("relatif", "subsets", 10, 1, R), ("relatif", "seeds", 10, 1, R),
        ("relatif", "checkpoints", 5, 5, R), ("influence", "checkpoints", 1, 5, {}),
        ("influence", "seeds", 10, 1, {}), ("influence", "subsets", 10, 1, {}),
        ("logra", "checkpoints", 1, 5, {}), ("logra", "seeds", 10, 1, {}))


def label_of(kind: str, members: int, last: int, kwargs: dict | None = None) -> str:
    head = "defaults" + "".join(f", {k}={v!r}" for k, v in (kwargs or {}).items())
    if kind == "seeds":
        return f"{head}, ensemble of {members} seeds"
    if kind == "subsets":
        return f"{head}, ensemble of {members} models on 50 % subsets"
    return f"{head}, {members} seed(s) × last {last} of {SNAPSHOTS} checkpoints"


class Members:
    """The setting's ensemble members, trained on first use and kept: ``train(indices, seed,
    checkpoints)`` → model, or (model, [(snapshot, optimizer)]) with checkpoints > 0."""

    def __init__(self, train, n_train: int, base_model):
        self.train, self.n_train, self.base = train, n_train, base_model
        self.kept: dict = {}

    def _get(self, key, make):
        if key not in self.kept:
            t0 = time.perf_counter()
            value = make()
            self.kept[key] = (value, time.perf_counter() - t0)
        return self.kept[key]

    def models(self, kind: str, members: int, last: int):
        """(models, training seconds a user pays for them)."""
        out, seconds = [], 0.0
        if kind == "seeds":
            out.append(self.base)
            for m in range(1, members):
                model, sec = self._get(("seed", m), lambda m=m: self.train(None, m, 0))
                out.append(model)
                seconds += sec
        elif kind == "subsets":
            masks = ga.eval.subset_masks(self.n_train, members, 0.5, seed=ENSEMBLE_SUBSET_SEED)
            for m in range(members):      # subset_masks' row m does not depend on how many are drawn
                model, sec = self._get(("subset", m), lambda m=m: self.train(np.flatnonzero(masks[m]), m + 1, 0))
                out.append(model)
                seconds += sec
        else:
            for s in range(members):
                (_, snaps), sec = self._get(("run", s), lambda s=s: self.train(None, s, SNAPSHOTS))
                out += [x for x, _ in snaps[-last:]]
                seconds += sec if s > 0 else 0.0
        return out, seconds


#: members scored together: ``ga.methods.ensemble`` over chunks of at most this many, their
#: means averaged with the chunks' sizes as weights (the same mean; 25 members of 58 k
#: coordinates in one expression held more than 4 GB)
MEMBER_CHUNK = 5


def ensemble_scores(method: str, tasks, train, queries, **kwargs) -> np.ndarray:
    """(n_query, n_train) scores of ``ga.methods.ensemble`` of ``method`` at its defaults but
    ``kwargs``: (1/M) Σ_m τ_m, computed ``MEMBER_CHUNK`` members at a time."""
    total = 0.0
    for start in range(0, len(tasks), MEMBER_CHUNK):
        part = tasks[start:start + MEMBER_CHUNK]
        values = ga.methods.ensemble(getattr(ga.methods, method), part, train, queries, **kwargs).compute()
        total = total + np.asarray(values.transpose("query", "train").values) * len(part)
    return total / len(tasks)


def row_token(ctx, method: str, kwargs: dict) -> str | None:
    """The content token (``scores.expr.token``) of ``method`` at the row's arguments on the
    setting's own model (``ctx.members.base``, the seed-0 full-data run every kind starts from):
    it names every resolved argument, the method's defaults included, so an entry cached under
    another default no longer matches. The members themselves are this script's deterministic
    training, which the label names (kind, count, checkpoints); they are not trained to check the
    cache. Building the expression computes nothing."""
    from fidelity_lm import expression_token
    return expression_token(getattr(ga.methods, method)(ctx.task(ctx.members.base), ctx.train, ctx.queries,
                                                         **kwargs))


def cached_ensemble(path: Path, token: str | None, compute):
    """(values (n_query, n_train), seconds, forward + backward seconds) from ``path`` when its
    stored token is ``token`` (:func:`fidelity_lm.cache_is_current`), else ``compute()`` →
    the same triple, written to ``path`` with ``token``."""
    from fidelity_lm import cache_is_current
    if path.exists():
        with np.load(path) as z:
            if cache_is_current(z, token, path):
                return z["values"], float(z["seconds"]), float(z["fwd_bwd_seconds"])
    values, seconds, base = compute()
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, values=values, seconds=seconds, fwd_bwd_seconds=base, token=token)
    tmp.replace(path)
    return values, seconds, base


def rows(ctx, only=None, first=None, picked=None):
    """Every ``ROWS`` entry of ``ctx`` (its members, task, data, truth, key, base, write):
    scores (cached), LDS and cost, written with ``ctx.write(row)``."""
    import xarray as xr
    chosen = ROWS[:first] if picked is None else [ROWS[i] for i in picked]
    for method, kind, members, last, kwargs in chosen:
        if only and method not in only:
            continue
        config = label_of(kind, members, last, kwargs)
        row = {"setting": ctx.label, "method": method, "config": config}
        slug = hashlib.sha256(f"{method}|{config}".encode()).hexdigest()[:10]
        path = BUILD / f"ensemble-{ctx.key}-{method}-{slug}.npz"
        try:
            def compute(method=method, kind=kind, members=members, last=last, kwargs=kwargs):
                models, train_seconds = ctx.members.models(kind, members, last)
                t0 = time.perf_counter()
                values = ensemble_scores(method, [ctx.task(m) for m in models], ctx.train, ctx.queries, **kwargs)
                return values, time.perf_counter() - t0 + train_seconds, ctx.base

            values, seconds, base = cached_ensemble(path, row_token(ctx, method, kwargs), compute)
            result = ga.eval.lds(xr.DataArray(values, dims=("query", "train"), name=method), ctx.truth,
                                 target="loss", bootstrap=1000, resample="both")
            row.update(seconds=seconds, fwd_bwd_seconds=base, cost=seconds / base, lds=result.mean,
                       low=result.interval[0], high=result.interval[1])
            print(f"  {method:10s} {config:52s} LDS {row['lds']:6.3f} [{row['low']:.3f}, {row['high']:.3f}]"
                  f"  {seconds:7.1f} s ({row['cost']:.0f}× fwd+bwd)", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
            print(f"  {method:10s} {config:52s} skipped: {row['skipped']}", flush=True)
        ctx.write(row)


class TextContext:
    """``fidelity_text``'s setting: its Prepared (ground truth from the cache) and writer."""

    def __init__(self, name: str):
        import fidelity_text as ft
        self.ft, p = ft, ft.Prepared(ft.SETTINGS[name])
        self.p, self.key, self.label = p, p.key, f"{name}-k{ft.SEEDS_PER_SUBSET}"
        self.truth, self.train, self.queries = p.truth, p.train, p.queries
        self.base = p.fwd_bwd_seconds()
        self.members = Members(self._train, len(p.train), p.model)

    def _train(self, indices, seed, checkpoints):
        items = self.p.train if indices is None else [self.p.train[i] for i in indices]
        return self.ft.train_model(self.p.setting, items, seed=seed, checkpoints=checkpoints)

    def task(self, model):
        return self.p.task(model)

    def write(self, row):
        ft = self.ft
        ft._write(ft.BUILD / f"results-{self.label}.json", self.label, self.p, ft.N_SUBSETS,
                  ft.SEEDS_PER_SUBSET, self.base, row)


class MoreContext:
    """``fidelity_more``'s setting: its ground truth (from the cache), model and writer."""

    def __init__(self, name: str):
        import fidelity_more as fm
        self.fm, s = fm, fm.SETTINGS[name]()
        self.s, self.key, self.label = s, s.key, f"{name}-k{fm.SEEDS_PER_SUBSET}"
        self.truth = fm.ground_truth(s)
        reliability = ga.eval.reliability(self.truth)
        model = s.train_model()
        self.base = s.fwd_bwd_seconds(model)
        self.train, self.queries = s.train, s.queries
        self.header = fm._header(s, self.label, fm.N_SUBSETS, fm.SEEDS_PER_SUBSET, reliability, self.base)
        self.members = Members(lambda idx, seed, c: s.train_model(idx, seed=seed, checkpoints=c), s.n_train, model)

    def task(self, model):
        return self.s.task(model)

    def write(self, row):
        self.fm._write(self.fm.BUILD / f"results-{self.label}.json", self.header, row)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="text,instruct,llama")
    ap.add_argument("--methods", default=None, help="comma-separated method names")
    ap.add_argument("--first", type=int, default=None, help="only the first N rows of ROWS")
    ap.add_argument("--rows", default=None, help="only these rows of ROWS (comma-separated indices)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ga.options(progress=False)
    only = set(args.methods.split(",")) if args.methods else None
    for name in args.settings.split(","):
        ctx = TextContext(name) if name in ("text", "instruct") else MoreContext(name)
        print(f"[{ctx.label}] ensembles; plain forward+backward {ctx.base:.3f} s", flush=True)
        rows(ctx, only, args.first, [int(i) for i in args.rows.split(",")] if args.rows else None)


if __name__ == "__main__":
    main()
