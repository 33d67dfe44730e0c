"""Ensembles at the methods' defaults, and a noise-aware mean of their members (issue 31).

Every setting trained by Adam in ``benchmarks/fidelity_lm.py`` (``lm``, ``lm2``: 4 runs per
subset), ``fidelity_text.py`` (``text``, ``instruct``: 3) and ``fidelity_more.py`` (``llama``,
``conv``: 3), against its multi-run ground truth. Every member is a method **at its defaults**
(the task's default layers, nothing passed) on one model: one of the last 5 of 10 evenly
spaced checkpoints of the full-data run trained with seed ``TRAINING_SEED + s`` (s = 0 is the
setting's own run; its last checkpoint is the setting's model). Member scores are cached per
model (``build/fidelity/explore-ensembles-<key>-<method>-s<s>-c<j>.npy``), so every row is
formed from the same members.

Two ways to combine the members' (n_query, n_train) scores τ_m:

* **the mean** τ̄ = (1/M) Σ_m τ_m (``ga.methods.ensemble``);
* **a noise-aware mean**: each run s gives one score matrix (the mean of its checkpoints), the
  seeds are independent draws of the training randomness, and each entry's mean is shrunk by its
  own signal-to-noise ratio,

      τ̂_qi = τ̄_qi · τ̄_qi² / (τ̄_qi² + v_qi / S),      v_qi = the seeds' sample variance of τ_s,qi,

  the posterior mean of an entry under a normal prior whose variance is the entry's squared mean
  (a Wiener filter per entry). It uses no ground truth: an entry whose seeds disagree in sign
  is driven to 0; an entry all seeds agree on is kept. It needs S ≥ 2 seeds.

Only the LDS (``ga.eval.lds``, queries and subsets resampled) reads the ground truth.

**Points of the frontier** (``--points``): every row but the final model alone (the method's
default point already) and the noise-aware mean (not adopted) is written into
``benchmarks/results/fidelity_points.json`` as an ``ensemble`` point of its setting, in the schema
``fidelity_report.points_of`` writes, with ``"source": "benchmarks/explore_ensembles.py"``
(``fidelity_report --points`` keeps such points when it rebuilds a setting). ``--points`` reads
the cached member scores only, with every complete seed the cache holds; a missing member is an
error, never trained (the setting's own model is, in seconds, as the suite's constructors do). The members' times were not recorded, so a row's **cost** (× one forward +
backward over the training set, as every point) is counted from committed measurements:

    cost = M · c_score + R · c_run + K · (⌊steps/10⌋ / steps) · c_run

M members, R full-data runs beyond the setting's own (seeds 1 … S − 1), K stretches of continued
training; ``c_score`` = the cost of the method's default point in the setting (the same call on a
model of the same architecture, timed in its own run), ``c_run`` = one training run, from the
setting's committed 2026-12-04/05 ensemble points, whose seconds counted training the members:
(cost of RelatIF over 5 seeds − cost over the last 5 checkpoints of one run) / 4 (``TRAINING``).
The setting's own run and its checkpoints cost no training (a user has them), as in
``fidelity_ensembles``. A setting without those two points (``conv``, ``seqcls``) gets only the
rows that train nothing.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/explore_ensembles.py --settings lm2,lm --seeds 10
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/explore_ensembles.py --settings lm2,llama \
        --methods relatif,influence --points
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity_lm as F  # noqa: E402
import fidelity_more as M  # noqa: E402
import fidelity_text as X  # noqa: E402
import gradalg as ga  # noqa: E402
from explore_sparsity import lds  # noqa: E402

METHODS = {"relatif": ga.methods.relatif, "influence": ga.methods.influence}


class Setting:
    """One setting of the suite as this script needs it: ``train``, ``queries`` (the LDS's),
    ``truth``, ``key``, ``task(model)`` and ``checkpoints(seed)`` (the full-data run's 10
    evenly spaced models, seed ``TRAINING_SEED + seed``)."""

    def __init__(self, name: str):
        self.name = name
        if name in F.SETTINGS:
            p = F.Prepared(F.SETTINGS[name], seeds_per_subset=4)
            self.train, self.queries, self.key, self.task = p.train, p.queries[:p.n_query], p.key, p.task
            self.truth = p.truth.isel(query=slice(0, p.n_query))
            self._run = lambda seed: F.train_model(p.setting, p.train, checkpoints=F.CHECKPOINTS, seed=seed)[1]
            self.steps, self.lr, self.batch_size, self.data = p.setting.train_steps, 3e-3, 32, None
            self.step_loss = lambda model, batch: F.sequence_losses(model, batch).mean()
        elif name in X.SETTINGS:
            p = X.Prepared(X.SETTINGS[name], seeds_per_subset=3)
            self.train, self.queries, self.key, self.task, self.truth = p.train, p.queries, p.key, p.task, p.truth
            self._run = lambda seed: X.train_model(p.setting, p.train, checkpoints=F.CHECKPOINTS, seed=seed)[1]
            self.steps, self.lr, self.batch_size, self.data = p.setting.train_steps, 3e-3, p.setting.batch_size, None
            self.step_loss = lambda model, batch: X.training_loss(p.setting, model, X.trim(batch))
        else:
            s = M.SETTINGS[name]()
            self.train, self.queries, self.key, self.task = s.train, s.queries, s.key, s.task
            self.truth = M.ground_truth(s, seeds_per_subset=3)
            self._run = lambda seed: s.train_model(checkpoints=F.CHECKPOINTS, seed=seed)[1]
            self.steps, self.lr, self.batch_size, self.data = s.steps, s.lr, 32, s.data
            self.step_loss = lambda model, batch: s.loss(model, batch).mean()
        if self.data is None:
            self.data = ga.collate.pad_collate(self.train)
        self.n_train = len(self.train[0]) if isinstance(self.train, tuple) else len(self.train)
        self._snapshots = {}

    def snapshots(self, seed: int) -> list:
        """The run's 10 evenly spaced (model, Adam) snapshots; the last is the trained model."""
        if seed not in self._snapshots:
            self._snapshots[seed] = self._run(F.TRAINING_SEED + seed)
        return self._snapshots[seed]

    def checkpoints(self, seed: int) -> list:
        return [model for model, _ in self.snapshots(seed)]

    def continued(self, count: int) -> list:
        """``count`` snapshots of training continued from the setting's trained model with its
        own Adam state (the run's last optimizer state), each after another 10 % of the run's
        steps at the run's learning rate and batch size, batches from their own generator."""
        model, opt = self.snapshots(0)[-1]
        model = copy.deepcopy(model).train()
        adam = torch.optim.Adam(model.parameters(), lr=self.lr)
        adam.load_state_dict(opt.state_dict())
        n, out = len(self.train), []
        g = torch.Generator().manual_seed(CONTINUATION_SEED)
        for _ in range(count):
            for _ in range(max(1, self.steps // F.CHECKPOINTS)):
                b = torch.randint(0, n, (self.batch_size,), generator=g)
                batch = ({k: v[b] for k, v in self.data.items()} if isinstance(self.data, dict)
                         else tuple(v[b] for v in self.data))
                loss = self.step_loss(model, batch)
                adam.zero_grad()
                loss.backward()
                adam.step()
            out.append(copy.deepcopy(model).eval())
        return out


CONTINUATION_SEED = 1000


def member_path(key: str, method: str, seed: int, checkpoint: int) -> Path:
    return F.BUILD / f"explore-ensembles-{key}-{method}-s{seed}-c{checkpoint}.npy"


def cached_seeds(key: str, method: str, last: int = 5) -> int:
    """How many runs (seeds 0, 1, …, no gap) have all their last ``last`` members cached."""
    s = 0
    while all(member_path(key, method, s, j).exists() for j in range(F.CHECKPOINTS - last, F.CHECKPOINTS)):
        s += 1
    return s


def _missing(paths: list) -> None:
    gone = [path.name for path in paths if not path.exists()]
    if gone:
        raise FileNotFoundError(f"{len(gone)} cached member score(s) missing, e.g. {gone[0]} under {F.BUILD}: "
                                "--points never trains; run without --points to compute them")


def member_scores(p: Setting, method: str, seeds: int, last: int, cached_only: bool = False) -> np.ndarray:
    """(seeds, last, n_query, n_train) scores of ``method`` at its defaults on the last ``last``
    of ``F.CHECKPOINTS`` checkpoints of ``seeds`` full-data runs (cached per member;
    ``cached_only``: a missing one raises instead of training its run)."""
    out = np.empty((seeds, last, p.truth.sizes["query"], p.n_train))
    for s in range(seeds):
        paths = [member_path(p.key, method, s, j) for j in range(F.CHECKPOINTS - last, F.CHECKPOINTS)]
        if cached_only:
            _missing(paths)
        if not all(path.exists() for path in paths):
            t0 = time.perf_counter()
            for path, model in zip(paths, p.checkpoints(s)[-last:]):
                if not path.exists():
                    values = METHODS[method](p.task(model), p.train, p.queries).compute().values
                    F.BUILD.mkdir(parents=True, exist_ok=True)
                    np.save(path.with_suffix(".tmp.npy"), values)
                    path.with_suffix(".tmp.npy").replace(path)
            print(f"  [{p.name}] {method} seed {s}: {last} checkpoints scored in "
                  f"{time.perf_counter() - t0:.0f} s (resident {resident_mib():.0f} MiB)", flush=True)
        out[s] = [np.load(path) for path in paths]
    return out


def resident_mib() -> float:
    """This process's resident set (MiB; NaN where /proc cannot be read)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2 ** 20
    except OSError:
        return float("nan")


def continued_scores(p: Setting, method: str, count: int, cached_only: bool = False) -> np.ndarray:
    """(count, n_query, n_train) scores of ``method`` at its defaults on ``Setting.continued``'s
    snapshots (cached per snapshot; ``cached_only``: a missing one raises)."""
    paths = [F.BUILD / f"explore-ensembles-{p.key}-{method}-continued-k{j}.npy" for j in range(count)]
    if cached_only:
        _missing(paths)
    if not all(path.exists() for path in paths):
        t0 = time.perf_counter()
        for path, model in zip(paths, p.continued(count)):
            values = METHODS[method](p.task(model), p.train, p.queries).compute().values
            np.save(path.with_suffix(".tmp.npy"), values)
            path.with_suffix(".tmp.npy").replace(path)
        print(f"  [{p.name}] {method}: {count} continued snapshots scored in {time.perf_counter() - t0:.0f} s",
              flush=True)
    return np.stack([np.load(path) for path in paths])


def noise_aware_mean(per_seed: np.ndarray) -> np.ndarray:
    """τ̄ · τ̄² / (τ̄² + v/S) over the first axis (S independent seeds' score matrices)."""
    S = per_seed.shape[0]
    mean, var = per_seed.mean(0), per_seed.var(0, ddof=1)
    return mean * mean ** 2 / np.maximum(mean ** 2 + var / S, np.finfo(float).tiny)


def combinations(p: Setting, method: str, seeds: int, cached_only: bool = False) -> list[dict]:
    """The rows: ``label`` (the markdown table's), ``config`` (the point's), ``tau`` (the mean of
    the members), ``noise`` (the noise-aware mean, seeds' rows only), and what the row costs:
    ``members`` scored, ``runs`` trained beyond the setting's own, ``stretches`` of continued
    training."""
    head = f"{DEFAULTS[method]}, ensemble of"
    run = member_scores(p, method, 1, 10, cached_only)[0]            # (10, m, n): the setting's run
    rows = [dict(label="the final model (1)", config=None, tau=run[-1], members=1, runs=0, stretches=0)]
    for c in (2, 3, 5, 10):
        rows.append(dict(label=f"the last {c} of 10 checkpoints of its run ({c})", tau=run[-c:].mean(0),
                         config=f"{head} its run's last {c} of 10 checkpoints" if c < 10 else
                         f"{head} all 10 of its run's checkpoints",
                         members=c, runs=0, stretches=0))
    more = continued_scores(p, method, 5, cached_only)
    for c in (2, 5):
        rows.append(dict(label=f"the final model and {c} snapshots of training continued from it ({c + 1})",
                         config=f"{head} the model and {c} snapshots of training continued from it",
                         tau=np.concatenate([run[-1:], more[:c]]).mean(0), members=c + 1, runs=0, stretches=c))
    T = member_scores(p, method, seeds, 5, cached_only)              # (seeds, 5, m, n)
    for S in sorted({2, 5, seeds} & set(range(2, seeds + 1))):
        rows.append(dict(label=f"{S} seeds, final models ({S})", config=f"{head} {S} seeds' final models",
                         tau=T[:S, -1].mean(0), noise=noise_aware_mean(T[:S, -1]), members=S, runs=S - 1,
                         stretches=0))
        rows.append(dict(label=f"{S} seeds × last 5 checkpoints ({5 * S})",
                         config=f"{head} {S} seeds × last 5 of 10 checkpoints", tau=T[:S].mean((0, 1)),
                         noise=noise_aware_mean(T[:S].mean(1)), members=5 * S, runs=S - 1, stretches=0))
    return rows


#: each method's default point's configuration in the fidelity tables (the members are that call)
DEFAULTS = {"relatif": "defaults (damping='auto')", "influence": "defaults (curvature='auto')"}
#: (the seeds row, the one-run checkpoints row) of a setting's committed RelatIF ensemble points,
#: whose costs counted training the members: one run's training = their difference / 4
TRAINING = {"lm": ("EK-FAC, ensemble of 5 seeds", "EK-FAC, 1 seed(s) × last 5 of 10 checkpoints"),
            "lm2": ("EK-FAC, ensemble of 5 seeds", "EK-FAC, 1 seed(s) × last 5 of 10 checkpoints"),
            **{s: ("defaults, damping=0.001, ensemble of 5 seeds",
                   "defaults, damping=0.001, 1 seed(s) × last 5 of 10 checkpoints")
               for s in ("text", "instruct", "llama")}}
SOURCE = "benchmarks/explore_ensembles.py"


def costs(points: list[dict], setting: str, method: str) -> tuple[float, float | None]:
    """(c_score, c_run) of ``setting`` from its committed points (× forward + backward): the
    method's default point's cost, and one training run's (``TRAINING``; None without those points)."""
    by = {(q["method"], q["config"]): q["cost"] for q in points}
    score = by.get((method, DEFAULTS[method]))
    if score is None:
        raise KeyError(f"{setting}: no {method} point {DEFAULTS[method]!r} to cost the members by")
    seeds, one_run = TRAINING.get(setting, (None, None))
    if ("relatif", seeds) not in by or ("relatif", one_run) not in by:
        return score, None
    return score, (by[("relatif", seeds)] - by[("relatif", one_run)]) / 4


def point(method: str, row: dict, lds_of, score: float, run: float | None, stretch: float) -> dict | None:
    """One row of ``combinations`` as a frontier point (``fidelity_report.points_of``'s schema and
    this script's ``source``): LDS [CI] ``lds_of(row["tau"])``, cost M · c_score + (R + K ·
    stretch) · c_run; None for the final model alone (the default point already) or a row that
    trains when ``run`` (c_run) is None."""
    if row["config"] is None or (run is None and (row["runs"] or row["stretches"])):
        return None
    mean, (lo, hi) = lds_of(row["tau"])
    cost = row["members"] * score + (row["runs"] + row["stretches"] * stretch) * (run or 0.0)
    return {"method": method, "config": row["config"], "lds": round(mean, 6), "low": round(lo, 6),
            "high": round(hi, 6), "cost": round(cost, 4), "kind": "ensemble", "default": False, "source": SOURCE}


def points(name: str, method: str, bootstrap: int, committed: dict) -> list[dict]:
    """The rows of ``name`` / ``method`` as frontier points (from the cached members only)."""
    p = Setting(name)
    score, run = costs(committed["settings"][name]["points"], name, method)
    stretch = max(1, p.steps // F.CHECKPOINTS) / p.steps              # one stretch, a fraction of a run
    out = []
    for r in combinations(p, method, cached_seeds(p.key, method), cached_only=True):
        q = point(method, r, lambda tau: lds(tau, p.truth, bootstrap), score, run, stretch)
        if q is None:
            continue
        out.append(q)
        print(f"  [{name}] {method}, {q['config']}: {q['lds']:.3f} [{q['low']:.3f}, {q['high']:.3f}] at "
              f"{q['cost']:.0f}×", flush=True)
    return out


def write_points(path: Path, name: str, method: str, new: list[dict]) -> None:
    """Replace this script's points of ``name`` / ``method`` in the points JSON by ``new``."""
    data = json.loads(path.read_text())
    pts = data["settings"][name]["points"]
    pts[:] = [q for q in pts if not (q.get("source") == SOURCE and q["method"] == method)] + new
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def table(name: str, method: str, seeds: int, bootstrap: int) -> list[str]:
    p = Setting(name)
    rows = [f"| members ({name}, {method} at its defaults) | mean | noise-aware mean |", "|---|---:|---:|"]

    def cell(tau):
        mean, (lo, hi) = lds(tau, p.truth, bootstrap)
        return f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"
    for r in combinations(p, method, seeds):
        rows.append(f"| {r['label']} | {cell(r['tau'])} | {cell(r['noise']) if 'noise' in r else '—'} |")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="lm2,lm")
    ap.add_argument("--methods", default="relatif")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--points", action="store_true", help="write the rows into benchmarks/results/"
                    "fidelity_points.json from the cached member scores (every cached seed; never trains)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ga.options(progress=False)
    path = Path(__file__).resolve().parent / "results" / "fidelity_points.json"
    for name in args.settings.split(","):
        for method in args.methods.split(","):
            if args.points:
                write_points(path, name, method, points(name, method, args.bootstrap, json.loads(path.read_text())))
            else:
                print("\n".join(table(name, method, args.seeds, args.bootstrap)), flush=True)


if __name__ == "__main__":
    main()
