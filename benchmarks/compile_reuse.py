"""Compile once: new queries against a compiled expression versus computing from scratch.

Model: an MLP 64 → 128 → 128 → 10 (random weights, float32), layers fc1, fc2, fc3.
Data: random inputs; ``--train`` training examples (default 4,096), batches of 256 new
queries per round. Curvatures: projected Fisher (``ga.proj.kron(k=256)``, dense 768²
inverse) and EK-FAC (damped inverse). Measured side by side, interleaved round by round:

    fresh     ``(Q_new @ H @ G.T).compute()``: curvature pass(es), training pass, scores
    compiled  ``C.scores(Q_new)`` with ``C = ga.compile(Q @ H @ G.T)`` (compiled once,
              before the rounds; its own time is printed once)

Both include planning and the default safety checks; ``compiled`` includes its check of
the model weights (``check_weights="full"``: every weight re-hashed). With ``--threads 1``
the ratio uses process CPU time (a shared machine's waiting for a core is not counted).

    .venv/bin/python benchmarks/compile_reuse.py --threads 1            # ~1 min
    .venv/bin/python benchmarks/compile_reuse.py --threads 1 --train 1024 --rounds 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gradalg as ga  # noqa: E402

LAYERS = ["fc1", "fc2", "fc3"]


def build(n_train: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(64, 128))
    model.add_module("a1", nn.Tanh())
    model.add_module("fc2", nn.Linear(128, 128))
    model.add_module("a2", nn.Tanh())
    model.add_module("fc3", nn.Linear(128, 10))
    X = torch.randn(n_train, 64)
    y = torch.randint(0, 10, (n_train,))
    return model.eval(), (X, y)


def curvatures(task, train):
    P = ga.proj.kron(k=256, seed=0)
    G = ga.grads(task, train, layers=LAYERS)
    return {
        "projected fisher": (P, ga.fisher(P(G)).damp(1e-3, relative=True).inv(), P(G)),
        "ekfac": (None, ga.ekfac(G).damp(1e-3, relative=True).inv(), G),
    }


def clock(fn, cpu: bool):
    start = time.process_time() if cpu else time.perf_counter()
    out = fn()
    return out, (time.process_time() if cpu else time.perf_counter()) - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", type=int, default=4096)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = args.threads == 1
    model, train = build(args.train)
    task = ga.tasks.classification(model)
    print(f"MLP 64-128-128-10, {args.train:,} training examples, {args.queries} new queries per round, "
          f"{'CPU' if cpu else 'wall'} seconds")
    gen = torch.Generator().manual_seed(1)
    for name, (P, H, Gside) in curvatures(task, train).items():
        side = P if P is not None else (lambda G: G)
        first = (torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen))
        C, t_compile = clock(lambda: ga.compile(side(ga.grads(task, first, layers=LAYERS)) @ H @ Gside.T), cpu)
        ratios, diffs = [], []
        for _ in range(args.rounds):
            new = (torch.randn(args.queries, 64, generator=gen), torch.randint(0, 10, (args.queries,), generator=gen))
            Q = side(ga.grads(task, new, layers=LAYERS))
            fresh, t_fresh = clock(lambda: (Q @ H @ Gside.T).compute(), cpu)
            reused, t_reused = clock(lambda: C.scores(Q), cpu)
            ratios.append(t_fresh / t_reused)
            diffs.append(float(abs(fresh - reused).max() / abs(fresh).max()))
        print(f"  {name:17s} compile {t_compile:6.2f} s   fresh/compiled per query batch: median "
              f"{statistics.median(ratios):5.1f}×  (rounds {', '.join(f'{r:.1f}' for r in ratios)})   "
              f"max relative difference {max(diffs):.1e}")


if __name__ == "__main__":
    main()
