"""Fidelity of unrolled attribution (MAGIC, SOURCE) on the digits MLP of benchmarks/fidelity.py.

Data and model as in ``benchmarks/fidelity.py``: ``load_digits``, 500 training examples,
100 queries, float64, MLP 64 → 32 → 10 with tanh (same initialisation). The
counterfactual is a *training run* (``ga.unroll.TrainingRun``): a fixed initialisation,
batch order and optimizer; the ground truth retrains that run on each of 50 random
subsets (``ga.eval.retrain`` with ``train_fn = run.train(weights=mask)``: the examples
left out get weight 0, batches keep their order and, with reduction="mean", their
normaliser) and records the 100 query losses. LDS is ``ga.eval.lds(..., target="loss")`` with a 95 % bootstrap
interval over queries.

Settings (``--settings``), each 10 epochs of batch 50 from fidelity.py's initialisation
(100 steps, batch order from seed 0):

    sgd                SGD lr 0.3, weight decay 1e-3
    sgd-momentum       SGD lr 0.1, momentum 0.9, weight decay 1e-3
    adamw              AdamW lr 3e-3, weight decay 1e-2

with the batch loss Σ_B ε_i ℓ_i / Σ_B ε_i (``reduction="weighted_mean"``: a left-out
example makes its batches smaller, the step size stays), and ``sgd-momentum-mean`` /
``adamw-mean`` with (1/|B|) Σ_B ε_i ℓ_i (``"mean"``: dropping half the data also halves
every gradient).

LDS on subsets keeping 50 % (the usual protocol) and 90 % (dropping 10 %) of the
training set (``--fractions``). Methods: MAGIC (checkpointing "sqrt"); SOURCE with L
segments and 2 checkpoints per segment (SGD runs); the influence function
(Gauss-Newton and EK-FAC, damping = the run's weight decay) at the run's final model,
the textbook baseline.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/unrolled.py --threads 1
    python benchmarks/unrolled.py --settings sgd --subsets 50
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gradalg as ga  # noqa: E402
import fidelity as fid  # noqa: E402 - the digits data, the MLP and the L-BFGS ground truth

CACHE = Path(__file__).resolve().parent / ".cache"


def ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


SETTINGS = {
    # name: (optimizer, batch reduction, damping of the influence baseline)
    "sgd": (lambda: ga.unroll.SGD(0.3, weight_decay=fid.WD), "weighted_mean", fid.WD),
    "sgd-momentum": (lambda: ga.unroll.SGD(0.1, momentum=0.9, weight_decay=fid.WD), "weighted_mean", fid.WD),
    "sgd-momentum-mean": (lambda: ga.unroll.SGD(0.1, momentum=0.9, weight_decay=fid.WD), "mean", fid.WD),
    "adamw": (lambda: ga.unroll.AdamW(3e-3, weight_decay=1e-2), "weighted_mean", 1e-3),
    "adamw-mean": (lambda: ga.unroll.AdamW(3e-3, weight_decay=1e-2), "mean", 1e-3),
}


def make_run(name, train):
    optimizer, reduction, damping = SETTINGS[name]
    run = ga.unroll.TrainingRun(fid._mlp(), ce, train, optimizer(), batch_size=50, epochs=10, seed=0,
                                reduction=reduction)
    return run, damping


def lds_row(label, scores, truths, seconds):
    cells = []
    for gt in truths:
        r = ga.eval.lds(scores, gt, target="loss")
        cells.append(f"{r.mean:.3f} [{r.interval[0]:.3f}, {r.interval[1]:.3f}]")
    print(f"  {label:44s} " + "  ".join(cells) + f"   {seconds:7.1f} s", flush=True)
    return label, cells, seconds


def run_setting(name, n_subsets, source_segments, fractions):
    train, queries = fid.digits()
    run, wd = make_run(name, train)
    X, y = train
    t0 = time.perf_counter()

    def train_fn(indices):
        w = torch.zeros(fid.N_TRAIN, dtype=torch.float64)
        w[torch.as_tensor(indices)] = 1
        return run.train(w)

    def query_losses(model):
        with torch.no_grad():
            return F.cross_entropy(model(queries[0]), queries[1], reduction="none")

    truths = [ga.eval.retrain(train_fn, fid.N_TRAIN, n_subsets=n_subsets, fraction=f, seed=0,
                              targets_fn=query_losses, target="loss", store=CACHE / f"unrolled-{name}-{f:g}-{n_subsets}")
              for f in fractions]
    header = " | ".join(f"LDS, {f:.0%} kept" for f in fractions)
    print(f"\n[{name}] {run!r}, reduction={run.reduction}: ground truth ready in {time.perf_counter() - t0:.0f} s"
          f"\n  {'method':44s} {header}   time", flush=True)
    rows = []
    t = time.perf_counter()
    S = ga.methods.magic(run, queries).compute()
    rows.append(lds_row("magic (checkpointing='sqrt')", S, truths, time.perf_counter() - t))
    if isinstance(run.optimizer, ga.unroll.SGD):
        for L in source_segments:
            for curv in ("ekfac", "gauss_newton") if L == 1 else ("ekfac",):
                t = time.perf_counter()
                S = ga.methods.source(run, TensorDataset(*queries), n_segments=L, checkpoints_per_segment=2,
                                      curvature=curv).compute()
                rows.append(lds_row(f"source (L={L}, {curv}, 2 checkpoints/segment)", S, truths,
                                    time.perf_counter() - t))
    final = run.train()
    task = ga.tasks.classification(final)
    for curv in ("gauss_newton", "ekfac"):
        t = time.perf_counter()
        S = ga.methods.influence(task, TensorDataset(*train), TensorDataset(*queries), curvature=curv, damping=0.0,
                                 weight_decay=wd).compute()
        rows.append(lds_row(f"influence at θ_T ({curv}, damping {wd:g})", S, truths,
                            time.perf_counter() - t))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--fractions", default="0.5,0.9")
    parser.add_argument("--subsets", type=int, default=50)
    parser.add_argument("--segments", default="1,3")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    segments = [int(s) for s in args.segments.split(",") if s]
    start = time.perf_counter()
    for name in args.settings.split(","):
        run_setting(name, args.subsets, segments, [float(f) for f in args.fractions.split(",")])
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
