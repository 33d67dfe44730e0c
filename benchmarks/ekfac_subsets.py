"""EK-FAC statistics on a subset: what ``covariance_max_examples`` / ``lambda_max_examples``
save in time and cost in fidelity.

For each setting, EK-FAC influence (``ga.methods.influence(curvature="ekfac")``) with both
statistics estimated on the first m = n·f training examples, f ∈ {1, 1/2, 1/4, 1/8}
(the training sets are in random order, so a prefix is a random sample):

    factors   process CPU time (and wall time) of the factor passes alone, best of 3 (of 1
              for "wide") after a warm-up: a fresh ``LocalExecutor`` resolving the EK-FAC
              operator (the covariance pass over m examples, its eigendecompositions and
              the eigenvalue-correction pass over m examples). CPU time does not count
              waiting for a core on a loaded machine.
    total     wall time of the whole ``Scores.compute()`` (queries, factors, scores)
    ρ(full)   Spearman correlation of each query's scores with the full-data EK-FAC
              scores (f = 1), mean over queries
    LDS       (digits MLP only) ``ga.eval.lds`` against ``N_SUBSETS`` retrained halves,
              the ground truth of ``benchmarks/fidelity.py`` (its helpers and its cache
              under ``build/fidelity/``; about 80 s to build when absent)

Settings (the fidelity benchmarks' own, reused):

    mlp     digits, 64 → 32 → 10 tanh MLP trained to convergence (benchmarks/fidelity.py),
            500 training examples, 100 queries; EK-FAC of the exact Gauss-Newton rows
            (10 per example), damping = the objective's weight decay
    gpt2    the "lm" language-recovery GPT-2 of benchmarks/fidelity_lm.py (2 layers,
            n_embd 64, 300 Adam steps), 256 training sequences, 64 queries, default damping;
            no retraining (Spearman against full-data EK-FAC only)
    wide    the peers harness's shape (benchmarks/peers.py): GPT-2 4 layers × 256, random
            init, 256 random-token training sequences of T = 64, 32 queries (where the
            eigendecompositions, which a subset does not shrink, weigh more); factors timed once

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/ekfac_subsets.py [--settings mlp,gpt2,wide]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradalg as ga  # noqa: E402
from gradalg.methods.influence import gauss_newton_objective  # noqa: E402

FRACTIONS = (1, 2, 4, 8)         # m = n // f
N_SUBSETS = 50                   # retrained halves for the MLP's LDS


def spearman_per_query(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([spearmanr(x, y).statistic for x, y in zip(a, b)]))


def factor_seconds(task, train, layers, m, repeats=3) -> tuple[float, float]:
    """Best (wall, process CPU) seconds of resolving EK-FAC on the first m examples (a
    fresh executor each time)."""
    C = ga.grads(task, train, layers, objective=gauss_newton_objective(task))
    H = ga.ekfac(C, covariance_max_examples=m, lambda_max_examples=m)
    wall = cpu = float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        ga.LocalExecutor().operator(H.expr)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall, cpu


def sweep(name, task, train, queries, n, layers=None, kwargs=None, truth=None, repeats=3):
    factor_seconds(task, train, layers, n // FRACTIONS[-1], 1)      # warm-up: first-touch allocations
    rows, full = [], None
    for f in FRACTIONS:
        m = None if f == 1 else n // f
        wall, cpu = factor_seconds(task, train, layers, m, repeats)
        S = ga.methods.influence(task, train, queries, layers=layers, curvature="ekfac",
                                 covariance_max_examples=m, lambda_max_examples=m, **(kwargs or {}))
        t0 = time.perf_counter()
        values = S.compute()
        total = time.perf_counter() - t0
        v = values.values
        if full is None:
            full = v
        rho = spearman_per_query(v, full)
        lds = ga.eval.lds(values, truth, target="loss", bootstrap=0).mean if truth is not None else None
        rows.append((name, f, n if m is None else m, n, cpu, wall, total, rho, lds))
        print(f"  {name} 1/{f}: m={n if m is None else m}  factors {cpu:.2f} s CPU ({wall:.2f} s wall)  "
              f"total {total:.2f} s  rho {rho:.3f}" + ("" if lds is None else f"  LDS {lds:.3f}"), flush=True)
    return rows


def run_mlp():
    import fidelity as fb
    setting = fb.SETTINGS["mlp"]
    t0 = time.perf_counter()
    setting.prepare()
    truth = ga.eval.retrain(setting.train_fn, fb.N_TRAIN, n_subsets=N_SUBSETS, fraction=fb.FRACTION, seed=0,
                            targets_fn=setting.query_losses, target="loss",
                            store=fb.CACHE / f"{setting.name}-n{fb.N_TRAIN}-q{fb.N_QUERY}-wd{fb.WD:g}"
                                             f"-tol{setting.tol_subset:g}")
    print(f"[mlp] model and ground truth ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return sweep("digits MLP", setting.task(), setting.train, setting.queries, fb.N_TRAIN,
                 kwargs=dict(damping=0.0, weight_decay=fb.WD), truth=truth)


def run_gpt2():
    import fidelity_lm as fl
    t0 = time.perf_counter()
    p = fl.Prepared(fl.SETTINGS["lm"], retrain=False)        # the corpus (no ground truth) ...
    p.model = fl.train_model(p.setting, p.train)               # ... and the full-data model
    print(f"[gpt2] model trained in {time.perf_counter() - t0:.0f} s", flush=True)
    return sweep("GPT-2 (lm)", p.task(), p.train, p.queries, len(p.train), layers=fl.LAYERS)


def run_gpt2_wide(n=256, n_query=32, T=64):
    """The peers harness's model shape (4 layers × 256, random init), random tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=T, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (n + n_query, T), generator=g)
    train = {"input_ids": ids[:n], "attention_mask": torch.ones(n, T, dtype=torch.long)}
    queries = {"input_ids": ids[n:], "attention_mask": torch.ones(n_query, T, dtype=torch.long)}
    task = ga.tasks.causal_lm(model, name="gpt2-4x256")
    return sweep(f"GPT-2 4×256, T={T}", task, train, queries, n, layers=["transformer.h.*"], repeats=1)


def table(rows) -> str:
    lines = ["| setting | fraction | examples (m of n) | factor passes, CPU (wall) | speed-up (CPU) | "
             "influence total, wall | Spearman vs full | LDS |",
             "|---|---|---|---|---|---|---|---|"]
    base = {}
    for name, f, m, n, cpu, wall, total, rho, lds in rows:
        base.setdefault(name, cpu)
        lines.append(f"| {name} | 1/{f} | {m} of {n} | {cpu:.2f} s ({wall:.2f} s) | {base[name] / cpu:.1f}× | "
                     f"{total:.2f} s | {rho:.3f} | {'—' if lds is None else f'{lds:.3f}'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="mlp,gpt2,wide")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    load = os.getloadavg()
    rows = []
    if "mlp" in args.settings:
        rows += run_mlp()
    if "gpt2" in args.settings.split(","):
        rows += run_gpt2()
    if "wide" in args.settings.split(","):
        rows += run_gpt2_wide()
    print()
    print(table(rows))
    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, total "
          f"{time.perf_counter() - start:.0f} s, 1 thread, load average at start {load[0]:.2f} / "
          f"{os.cpu_count()} cores, at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
