"""gradalg against peer libraries on the same model and data: scores and wall time.

Run it in a SEPARATE virtual environment that has the peers (never install them into
gradalg's own environment), with gradalg on the path::

    python3 -m venv /tmp/peers
    /tmp/peers/bin/pip install torch==2.13.0 kronfluence traker xarray pandas scipy tqdm scikit-learn
    PYTHONPATH=. /tmp/peers/bin/python benchmarks/peers.py            # 1 torch thread
    PYTHONPATH=. /tmp/peers/bin/python benchmarks/peers.py --only ekfac

(pin ``torch==2.13.0`` on the same command line so that pip keeps the CPU build).

Setting: ``sklearn.datasets.load_digits`` (bundled), the 80/20 split of the quickstart,
an MLP 64 → 16 → 10 with tanh (1,210 parameters) trained in float32 with Adam and a
small weight decay; every training example (1,437) and 50 test images as queries; both
layers (weights and biases) attributed.

EK-FAC / K-FAC against Kronfluence (``kronfluence.Analyzer``):

* same curvature data: the **empirical** Fisher (true labels; Kronfluence
  ``use_empirical_fisher=True``), which removes the sampling noise, so the math is the
  same on both sides: gradalg ``Q @ ga.ekfac(G).damp(λ).inv() @ G.T`` (``ga.kfac`` for
  K-FAC);
* gradalg's method as a user calls it, ``ga.methods.influence(..., curvature="ekfac")``,
  whose curvature is the exact Gauss-Newton (``ga.tasks.classification`` gives its
  per-class terms), against Kronfluence's default true Fisher (one label sampled per
  example): the same matrix in expectation, so agreement is limited by the sample;
* the damping λ is the same number on both sides (both add it to the eigenvalues).

TRAK against traker (``trak.TRAKer``, CPU: ``BasicProjector`` with Gaussian entries,
float32):

* the exact limit: traker's ``NoOpProjector`` (unprojected features) and gradalg's TRAK
  expression without a projector: the same math;
* projected, k = 1024, each with its own random matrices: both estimate the exact
  scores, so they agree with each other only as far as each agrees with the limit;
  reported against each other and against the exact scores.

The kernels are matched: traker's features are X = P g/√p with N(0, 1) entries in P
(p = parameters), gradalg's Φ = P g with N(0, 1/k) entries, so traker's
``lambda_reg`` λ_t equals gradalg's damping times k/p (times 1/p unprojected). TRAK's
damping is 10⁻³ of the kernel's mean eigenvalue.

Printed: per method, the Spearman rank correlation of the two libraries' scores over
the training set, per query, averaged over the queries (with the minimum), and each
library's wall time (one thread; Kronfluence and traker write their results to a
temporary folder, as they always do).
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gradalg as ga  # noqa: E402

N_QUERY = 50
LAYERS = ["fc1", "fc2"]
DAMPING = 1e-3            # influence: added to the (EK-)FAC eigenvalues on both sides
TRAK_K = 1024
TRAK_REL_DAMPING = 1e-3   # TRAK: λ = this × the kernel's mean eigenvalue


# ----------------------------------------------------------------------------- setting
def setting():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    i_train, i_test = train_test_split(np.arange(len(y)), test_size=0.2, random_state=0, stratify=digits.target)
    train = (X[i_train], y[i_train])
    queries = (X[i_test][:N_QUERY], y[i_test][:N_QUERY])
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(64, 16))
    model.add_module("act", nn.Tanh())
    model.add_module("fc2", nn.Linear(16, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(300):
        opt.zero_grad()
        F.cross_entropy(model(train[0]), train[1]).backward()
        opt.step()
    return model.eval(), train, queries


def rank_correlation(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Per-query Spearman correlation of two (query, train) score matrices: (mean, min)."""
    rho = ga.eval.spearman(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), axis=1)
    return float(np.mean(rho)), float(np.min(rho))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


class Dataset(torch.utils.data.Dataset):
    def __init__(self, X, y):
        self.X, self.y = X, y

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return self.X[i], self.y[i]


# ----------------------------------------------------------------------------- Kronfluence
def kronfluence_scores(model, train, queries, strategy: str, empirical: bool, workdir: str) -> np.ndarray:
    """(query, train) pairwise scores from ``kronfluence.Analyzer``."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):
            x, y = batch
            logits = model(x)
            if sample:
                with torch.no_grad():
                    y = torch.multinomial(torch.softmax(logits.detach(), -1), 1).flatten()
            return F.cross_entropy(logits, y, reduction="sum")

        def compute_measurement(self, batch, model):
            x, y = batch
            return F.cross_entropy(model(x), y, reduction="sum")

        def get_influence_tracked_modules(self):
            return LAYERS

    task = Classification()
    torch.manual_seed(0)                           # Kronfluence draws its labels from torch's global RNG
    model = prepare_model(copy.deepcopy(model), task)
    analyzer = Analyzer(f"peers-{strategy}", model, task, cpu=True, disable_tqdm=True, output_dir=workdir,
                        log_level=logging.WARNING)
    factor_args = FactorArguments(strategy=strategy, use_empirical_fisher=empirical)
    analyzer.fit_all_factors("factors", Dataset(*train), per_device_batch_size=256, factor_args=factor_args,
                             overwrite_output_dir=True)
    analyzer.compute_pairwise_scores("scores", "factors", Dataset(*queries), Dataset(*train),
                                     per_device_query_batch_size=N_QUERY, per_device_train_batch_size=256,
                                     score_args=ScoreArguments(damping_factor=DAMPING), overwrite_output_dir=True)
    return analyzer.load_pairwise_scores("scores")["all_modules"].numpy()


def gradalg_kron(model, train, queries, strategy: str) -> np.ndarray:
    """The same expression on the empirical Fisher: Q @ (EK-)FAC(G)⁻¹ @ G.T."""
    task = ga.tasks.classification(copy.deepcopy(model))
    G, Q = ga.grads(task, train, LAYERS), ga.grads(task, queries, LAYERS)
    H = ga.ekfac(G) if strategy == "ekfac" else ga.kfac(G)
    return (Q @ H.damp(DAMPING).inv() @ G.T).compute().values


def gradalg_influence_method(model, train, queries, strategy: str, sampled: bool = False) -> np.ndarray:
    """``ga.methods.influence``: exact Gauss-Newton terms, or (sampled) one drawn label per example."""
    task = ga.tasks.classification(copy.deepcopy(model))
    if sampled:   # the same task without its exact per-class terms: the method falls back to a sampled label
        task = ga.Task(task.model, task.loss, sampled_loss=task.sampled_loss, name="sampled")
    return ga.methods.influence(task, train, queries, layers=LAYERS, curvature=strategy,
                                damping=DAMPING).compute().values


def compare_influence(model, train, queries, workdir, rows):
    for strategy in ("ekfac", "kfac"):
        name = strategy.upper().replace("KFAC", "K-FAC").replace("EK-FAC", "EK-FAC")
        kf_emp, t_kf = timed(lambda: kronfluence_scores(model, train, queries, strategy, True, workdir))
        ga_emp, t_ga = timed(lambda: gradalg_kron(model, train, queries, strategy))
        rows.append((f"{name}, empirical Fisher", "Kronfluence", *rank_correlation(ga_emp, kf_emp), t_ga, t_kf,
                     "same math"))
        kf_true, t_kf = timed(lambda: kronfluence_scores(model, train, queries, strategy, False, workdir))
        ga_gn, t_ga = timed(lambda: gradalg_influence_method(model, train, queries, strategy))
        rows.append((f"{name}, ga.methods.influence (exact GN) vs Kronfluence true Fisher (1 sampled label)",
                     "Kronfluence", *rank_correlation(ga_gn, kf_true), t_ga, t_kf,
                     "same matrix in expectation; Kronfluence's is a 1-sample estimate"))
        ga_one, t_one = timed(lambda: gradalg_influence_method(model, train, queries, strategy, sampled=True))
        rows.append((f"{name}, 1 sampled label on both sides (other draws)", "Kronfluence",
                     *rank_correlation(ga_one, kf_true), t_one, float("nan"), "two independent 1-sample estimates"))
        rows.append((f"  gradalg 1 sampled label vs gradalg exact GN", "(exact GN)",
                     *rank_correlation(ga_one, ga_gn), float("nan"), float("nan"), "the sampling noise alone"))
        print("  " + "\n  ".join(map(str, rows[-4:])), flush=True)


# ----------------------------------------------------------------------------- TRAK
def traker_scores(model, train, queries, k: int | None, lambda_reg: float, workdir: str) -> np.ndarray:
    """(query, train) TRAK scores from ``trak.TRAKer`` on the CPU (k=None: no projection)."""
    from trak import TRAKer
    from trak.projectors import NoOpProjector

    model = copy.deepcopy(model)
    p = sum(q.numel() for q in model.parameters())
    kwargs = dict(proj_dim=k) if k else dict(projector=NoOpProjector(grad_dim=p, proj_dim=0, seed=0,
                                                                       proj_type="na", device="cpu"))
    save_dir = tempfile.mkdtemp(dir=workdir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traker = TRAKer(model=model, task="image_classification", train_set_size=len(train[0]), save_dir=save_dir,
                        device="cpu", use_half_precision=False, lambda_reg=lambda_reg, projector_seed=0,
                        logging_level=logging.WARNING, **kwargs)
        traker.load_checkpoint(model.state_dict(), model_id=0)
        for start in range(0, len(train[0]), 256):
            batch = (train[0][start:start + 256], train[1][start:start + 256])
            traker.featurize(batch=batch, num_samples=len(batch[0]))
        traker.finalize_features()
        traker.start_scoring_checkpoint(exp_name="queries", checkpoint=model.state_dict(), model_id=0,
                                        num_targets=len(queries[0]))
        traker.score(batch=queries, num_samples=len(queries[0]))
        scores = traker.finalize_scores(exp_name="queries")
    return np.asarray(scores).T


def gradalg_trak_exact(task, train, queries, damping) -> np.ndarray:
    """TRAK's expression of ``ga.methods.trak`` without the projection."""
    Phi = ga.grads(task, train, LAYERS, objective="output")
    phi = ga.grads(task, queries, LAYERS, objective="output")
    weights = ga.row_weights(task.output_weight, "1 - p")
    return (phi @ (ga.fisher(Phi) * Phi.n).damp(damping).inv() @ (Phi * weights).T).compute().values


def compare_trak(model, train, queries, workdir, rows):
    task = ga.tasks.classification(copy.deepcopy(model))
    p = sum(q.numel() for q in model.parameters())
    Phi = ga.grads(task, train, LAYERS, objective="output")
    trace = float((Phi @ Phi.T).diag().compute().sum())           # tr(ΦᵀΦ), any projection preserves it
    lam_exact = TRAK_REL_DAMPING * trace / p
    lam_k = TRAK_REL_DAMPING * trace / TRAK_K

    ga_exact, t_ga = timed(lambda: gradalg_trak_exact(task, train, queries, lam_exact))
    tr_exact, t_tr = timed(lambda: traker_scores(model, train, queries, None, lam_exact / p, workdir))
    rows.append(("TRAK, exact (no projection)", "traker", *rank_correlation(ga_exact, tr_exact), t_ga, t_tr,
                 "same math"))
    print(f"  {rows[-1]}", flush=True)

    ga_k, t_ga = timed(lambda: ga.methods.trak(task, train, queries, layers=LAYERS, k=TRAK_K,
                                               damping=lam_k).compute().values)
    tr_k, t_tr = timed(lambda: traker_scores(model, train, queries, TRAK_K, lam_k * TRAK_K / p, workdir))
    rows.append((f"TRAK, k={TRAK_K}, each its own projection", "traker", *rank_correlation(ga_k, tr_k), t_ga, t_tr,
                 "two independent random projections"))
    rows.append((f"  gradalg k={TRAK_K} vs the exact scores", "(exact)", *rank_correlation(ga_k, ga_exact),
                 float("nan"), float("nan"), "projection error of gradalg's estimate"))
    rows.append((f"  traker k={TRAK_K} vs the exact scores", "(exact)", *rank_correlation(tr_k, ga_exact),
                 float("nan"), float("nan"), "projection error of traker's estimate"))
    print("  " + "\n  ".join(map(str, rows[-3:])), flush=True)


# ----------------------------------------------------------------------------- main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="ekfac,trak", help="comma-separated: ekfac (EK-FAC and K-FAC), trak")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ga.options(progress=False)
    versions = {"torch": torch.__version__, "gradalg": ga.__version__}
    for name, module in (("kronfluence", "kronfluence"), ("traker", "trak")):
        try:
            from importlib.metadata import version
            __import__(module)
            versions[name] = version(name)
        except Exception as exc:  # noqa: BLE001 - reported
            versions[name] = f"not importable: {type(exc).__name__}: {exc}"
    print("# " + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"; {torch.get_num_threads()} thread(s)")
    model, train, queries = setting()
    with torch.no_grad():
        acc = (model(queries[0]).argmax(1) == queries[1]).float().mean()
    print(f"# digits MLP 64-16-10 (1,210 parameters), {len(train[0])} training examples, {N_QUERY} queries, "
          f"query accuracy {acc:.2f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        if "ekfac" in args.only and not versions["kronfluence"].startswith("not"):
            compare_influence(model, train, queries, workdir, rows)
        if "trak" in args.only and not versions["traker"].startswith("not"):
            compare_trak(model, train, queries, workdir, rows)
    print()
    print("| comparison | peer | Spearman, mean over queries | min | gradalg s | peer s | note |")
    print("|---|---|---:|---:|---:|---:|---|")
    for what, peer, mean, low, t_ga, t_peer, note in rows:
        fmt = (lambda t: "" if t != t else f"{t:.2f}")  # noqa: E731 - NaN → blank
        print(f"| {what} | {peer} | {mean:.4f} | {low:.4f} | {fmt(t_ga)} | {fmt(t_peer)} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
