"""Dask scaling: 1 vs 2 worker processes on a capture-bound workload.

Projected Grad-Dot (Kronecker projection, k = 256 per layer) of 16 queries against
N training sequences of a GPT-2 built from a config (2 layers, width 128, T = 64,
vocabulary 512). Capture (forward + backward per batch) dominates, so the work splits
across workers. Each worker has one thread; cluster start-up and a warm-up run are
excluded. Prints wall times, the speed-up, the largest score difference to the local
executor, and the peak resident memory per worker.

    python benchmarks/scaling.py [--n 512] [--repeats 2]
"""
from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch
import torch.nn.functional as F


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(n: int):
    import gradalg as ga
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(0, 512, (n, 64), generator=gen)
    queries = torch.randint(0, 512, (16, 64), generator=gen)

    def loss(m, batch):
        (ids,) = batch
        logits = m(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="sum")

    task = ga.Task(model, loss, name="gpt2-2x128")
    layers = "transformer.h.*.mlp.*"
    P = ga.proj.kron(k=256, seed=0)
    return P(ga.grads(task, (queries,), layers)) @ P(ga.grads(task, (train,), layers, batch_size=16)).T


def timed(S, executor, repeats):
    best = float("inf")
    out = None
    for _ in range(repeats):
        start = time.perf_counter()
        out = np.asarray(S.compute(executor=executor).values)
        best = min(best, time.perf_counter() - start)
    return best, out


def main():
    import gradalg as ga

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    S = build(args.n)
    with ga.options(progress=False):
        t_local, ref = timed(S, None, args.repeats)
        rows = [("local executor, 1 thread", t_local, 0.0, _peak_rss_mib())]
        for workers in (1, 2):
            with ga.exec.DaskExecutor(n_workers=workers, threads_per_worker=1) as dx:
                timed(build(32), dx, 1)   # warm-up: workers import torch and transformers
                t, out = timed(S, dx, args.repeats)
                peak = max(dx.client.run(_peak_rss_mib).values())
                rows.append((f"dask, {workers} worker process(es)", t, float(np.abs(out - ref).max()), peak))
    print(f"\nProjected Grad-Dot, 16 queries x {args.n} sequences (GPT-2 2x128, T=64), best of {args.repeats}")
    print(f"{'executor':<30} {'seconds':>9} {'max |diff|':>11} {'peak RSS/worker MiB':>20}")
    for name, t, diff, peak in rows:
        print(f"{name:<30} {t:>9.2f} {diff:>11.2e} {peak:>20.0f}")
    speedup = rows[1][1] / rows[2][1]
    print(f"\nspeed-up 2 workers vs 1: {speedup:.2f}x (target >= 1.6x on 2 cores)")


if __name__ == "__main__":
    main()
