"""Perturbed copies of the trained model as an ensemble (``ga.methods.perturbed``; issue 31).

Every member is a method **at its defaults** on a copy of the setting's trained model whose
every parameter tensor t is moved by N(0, (s · rms(θ_t))²) noise (``ga.methods.perturbed``,
seed 0); the row's scores are the members' mean (``ga.methods.ensemble``). No other run is
trained and nothing of the training (checkpoints, optimizer) is read. Each setting is read
against its multi-run ground truth (``lm``, ``lm2``: 4 runs per subset; ``text``, ``instruct``,
``llama``, ``conv``, ``seqcls``: 3; the digits settings' deterministic training: 1). Member
scores are cached (``build/fidelity/explore-perturbed-<key>-<method>-s<scale>-m<k>.npy``), so
a rerun only reads them.

Columns: the model alone; per scale s, one copy, the mean of M copies (LDS with its 95 %
interval), and the copies' mean training loss (the trained model's in the first column): how
far the noise moves the model.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/explore_perturbed.py --settings lm,lm2 --scales 0.1,0.3
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/explore_perturbed.py --settings mlp --methods influence

``--points`` writes the language settings' mean-of-M rows into
``benchmarks/results/fidelity_points.json`` as ``ensemble`` points (``"source":
"benchmarks/explore_perturbed.py"``) from the cached member scores: cost M · c_score, c_score the
method's default point's cost in the same setting (``explore_ensembles.costs``); nothing is trained,
so the copies are a one-run point (``fidelity_report.ONE_RUN_WORDS``: "copies of its model").
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity as D  # noqa: E402
import explore_ensembles as E  # noqa: E402
import gradalg as ga  # noqa: E402
from explore_sparsity import lds  # noqa: E402

BUILD = Path(__file__).resolve().parent.parent / "build" / "fidelity"


class Digits:
    """A digits setting of ``benchmarks/fidelity.py`` with ``explore_ensembles.Setting``'s face."""

    def __init__(self, name: str):
        s = D.SETTINGS[name]
        s.prepare()
        self.name, self.train, self.queries, self.truth = name, s.train, s.queries, D.ground_truth(s)
        self.model, self.task = s.full, s.task
        self.key = f"{name}-n{D.N_TRAIN}-q{D.N_QUERY}"
        self.train_loss = lambda model: float(torch.nn.functional.cross_entropy(model(s.train[0]), s.train[1]))


class Language:
    """An Adam-trained setting of ``explore_ensembles`` (its trained model: the run's last checkpoint)."""

    def __init__(self, name: str):
        p = E.Setting(name)
        self.name, self.train, self.queries, self.truth, self.key, self.task = \
            name, p.train, p.queries, p.truth, p.key, p.task
        self.model = p.checkpoints(0)[-1]
        self.train_loss = lambda model: float(p.step_loss(model, p.data))


def setting(name: str):
    return Digits(name) if name in D.SETTINGS else Language(name)


def scores(p, method: str, task) -> np.ndarray:
    return getattr(ga.methods, method)(task, p.train, p.queries).compute().values


def members(p, method: str, scale: float, count: int) -> tuple[np.ndarray, float]:
    """(count, n_query, n_train) member scores at ``scale`` (cached) and the copies' mean training loss."""
    tasks = ga.methods.perturbed(p.task(p.model), members=count, scale=scale, seed=0)
    out = []
    for k, task in enumerate(tasks):
        path = BUILD / f"explore-perturbed-{p.key}-{method}-s{scale:g}-m{k}.npy"
        if not path.exists():
            np.save(path, scores(p, method, task))
        out.append(np.load(path))
    with torch.no_grad():
        loss = float(np.mean([p.train_loss(t.model) for t in tasks]))
    return np.stack(out), loss


SOURCE = "benchmarks/explore_perturbed.py"
POINTS = Path(__file__).resolve().parent / "results" / "fidelity_points.json"


def config(method: str, scale: float, count: int) -> str:
    return f"{E.DEFAULTS[method]}, ensemble of {count} perturbed copies of its model (s = {scale:g})"


def write_points(p, method: str, scales, count: int, bootstrap: int) -> None:
    """Replace this script's points of ``p`` / ``method`` by its mean-of-``count`` rows (cached members only)."""
    data = json.loads(POINTS.read_text())
    pts = data["settings"][p.name]["points"]
    score, _ = E.costs(pts, p.name, method)
    new = []
    for s in scales:
        paths = [BUILD / f"explore-perturbed-{p.key}-{method}-s{s:g}-m{k}.npy" for k in range(count)]
        E._missing(paths)
        mean, (lo, hi) = lds(np.mean([np.load(q) for q in paths], axis=0), p.truth, bootstrap)
        new.append({"method": method, "config": config(method, s, count), "lds": round(mean, 6),
                    "low": round(lo, 6), "high": round(hi, 6), "cost": round(count * score, 4),
                    "kind": "ensemble", "default": False, "source": SOURCE})
        print(f"  [{p.name}] {new[-1]['config']}: {mean:.3f} [{lo:.3f}, {hi:.3f}] at {count * score:.0f}×", flush=True)
    pts[:] = [q for q in pts if not (q.get("source") == SOURCE and q["method"] == method)] + new
    POINTS.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def cell(tau, truth, bootstrap) -> str:
    m, (lo, hi) = lds(tau, truth, bootstrap)
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="lm,lm2,llama,text,instruct")
    ap.add_argument("--methods", default="relatif")
    ap.add_argument("--scales", default="0.1,0.3")
    ap.add_argument("--members", type=int, default=6)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--points", action="store_true", help="write the language settings' rows into "
                    "benchmarks/results/fidelity_points.json from the cached member scores")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    BUILD.mkdir(parents=True, exist_ok=True)
    scales = [float(s) for s in args.scales.split(",")]
    head = ("| setting | method | model alone (train loss) | "
            + " | ".join(f"s = {s:g}: one copy | s = {s:g}: mean of {args.members} (train loss)" for s in scales) + " |")
    lines = [head, "|---|---|---:|" + "---:|---:|" * len(scales)]
    for name in args.settings.split(","):
        t0 = time.perf_counter()
        p = setting(name)
        for method in args.methods.split(","):
            if args.points:
                write_points(p, method, scales, args.members, args.bootstrap)
                continue
            path = BUILD / f"explore-perturbed-{p.key}-{method}-model.npy"
            if not path.exists():
                np.save(path, scores(p, method, p.task(p.model)))
            with torch.no_grad():
                row = [name, method, f"{cell(np.load(path), p.truth, args.bootstrap)} ({p.train_loss(p.model):.3g})"]
            for s in scales:
                T, loss = members(p, method, s, args.members)
                row += [cell(T[0], p.truth, args.bootstrap),
                        f"{cell(T.mean(0), p.truth, args.bootstrap)} ({loss:.3g})"]
            lines.append("| " + " | ".join(f"`{row[0]}`" if i == 0 else c for i, c in enumerate(row)) + " |")
            print(lines[-1], f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
