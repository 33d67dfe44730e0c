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

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/explore_ensembles.py --settings lm2,lm --seeds 10
"""
from __future__ import annotations

import argparse
import copy
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


def member_scores(p: Setting, method: str, seeds: int, last: int) -> np.ndarray:
    """(seeds, last, n_query, n_train) scores of ``method`` at its defaults on the last ``last``
    of ``F.CHECKPOINTS`` checkpoints of ``seeds`` full-data runs (cached per member)."""
    out = np.empty((seeds, last, p.truth.sizes["query"], p.n_train))
    for s in range(seeds):
        paths = [F.BUILD / f"explore-ensembles-{p.key}-{method}-s{s}-c{j}.npy"
                 for j in range(F.CHECKPOINTS - last, F.CHECKPOINTS)]
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


def continued_scores(p: Setting, method: str, count: int) -> np.ndarray:
    """(count, n_query, n_train) scores of ``method`` at its defaults on ``Setting.continued``'s
    snapshots (cached per snapshot)."""
    paths = [F.BUILD / f"explore-ensembles-{p.key}-{method}-continued-k{j}.npy" for j in range(count)]
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


def table(name: str, method: str, seeds: int, bootstrap: int) -> list[str]:
    p = Setting(name)
    truth = p.truth
    T = member_scores(p, method, seeds, 5)              # (seeds, 5, m, n)
    rows = [f"| members ({name}, {method} at its defaults) | mean | noise-aware mean |", "|---|---:|---:|"]

    def cell(tau):
        mean, (lo, hi) = lds(tau, truth, bootstrap)
        return f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"
    run = member_scores(p, method, 1, 10)[0]            # (10, m, n): every checkpoint of the setting's run
    rows.append(f"| the final model (1) | {cell(run[-1])} | — |")
    for c in (2, 3, 5, 10):
        rows.append(f"| the last {c} of 10 checkpoints of its run ({c}) | {cell(run[-c:].mean(0))} | — |")
    more = continued_scores(p, method, 5)
    for c in (2, 5):
        rows.append(f"| the final model and {c} snapshots of training continued from it ({c + 1}) | "
                    f"{cell(np.concatenate([run[-1:], more[:c]]).mean(0))} | — |")
    for S in sorted({2, 5, seeds} & set(range(2, seeds + 1))):
        rows.append(f"| {S} seeds, final models ({S}) | {cell(T[:S, -1].mean(0))} | "
                    f"{cell(noise_aware_mean(T[:S, -1]))} |")
        rows.append(f"| {S} seeds × last 5 checkpoints ({5 * S}) | {cell(T[:S].mean((0, 1)))} | "
                    f"{cell(noise_aware_mean(T[:S].mean(1)))} |")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="lm2,lm")
    ap.add_argument("--methods", default="relatif")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--bootstrap", type=int, default=1000)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ga.options(progress=False)
    for name in args.settings.split(","):
        for method in args.methods.split(","):
            print("\n".join(table(name, method, args.seeds, args.bootstrap)), flush=True)


if __name__ == "__main__":
    main()
