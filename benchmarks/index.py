"""A gradient index at scale: build time, disk size, query latency and recall@10.

N synthetic projected rows (k = 128, float32) with cluster structure are written
through the store API: a bias-free ``Linear(128 → 1)`` whose loss is its output has
per-example gradient x_i, projected by ``ga.proj.gaussian(128)``; the inputs x_i are
drawn around 1,000 centres. ``ga.store.index`` then builds a faiss index of the store
(IVF by default), and 32 queries (drawn like the rows) are searched for their top 10
by inner product: latency of ``index.search`` (faiss candidates + exact float64
re-ranking from the stored rows, the queries' capture included), recall@10 against
the exact top 10 (brute force over every stored row, float64), and, side by side, the
exact streaming ``S.topk(10)`` over the store.

    nice python benchmarks/index.py [--n 1000000] [--kind ivf] [--nlist 1024] [--spread 4]
                                    [--candidates C] [--nprobe P] [--workdir DIR]

Targets (docs/results_at_scale.md): ≤ 1 s for 32 queries, recall@10 ≥ 0.95.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import torch

import gradalg as ga

K, D_IN, CENTRES, N_QUERY, TOP = 128, 128, 1000, 32, 10


def linear_task():
    torch.manual_seed(0)
    model = torch.nn.Linear(D_IN, 1, bias=False)
    return ga.Task(model, lambda m, b: m(b[0]).sum(), name="linear-128")


def clustered(n: int, seed: int, spread: float = 4.0) -> torch.Tensor:
    """Rows around CENTRES centres of scale ``spread`` with unit noise (smaller: overlapping clusters)."""
    g = torch.Generator().manual_seed(seed)
    centres = spread * torch.randn(CENTRES, D_IN, generator=torch.Generator().manual_seed(0))
    return centres[torch.randint(0, CENTRES, (n,), generator=g)] + torch.randn(n, D_IN, generator=g)


def exact_top(rows: np.ndarray, q: np.ndarray, k: int, block: int = 131_072) -> np.ndarray:
    """Positions of the exact top k by ⟨q, g⟩ (float64, brute force over blocks of rows)."""
    best_v = np.full((q.shape[0], 0), -np.inf)
    best_p = np.zeros((q.shape[0], 0), dtype=np.int64)
    for a in range(0, rows.shape[0], block):
        s = q @ np.asarray(rows[a:a + block], dtype=np.float64).T
        v = np.concatenate([best_v, s], axis=1)
        p = np.concatenate([best_p, np.broadcast_to(np.arange(a, a + s.shape[1]), s.shape)], axis=1)
        keep = np.argsort(-v, axis=1, kind="stable")[:, :k]
        best_v, best_p = np.take_along_axis(v, keep, 1), np.take_along_axis(p, keep, 1)
    return best_p


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--kind", default="ivf", choices=["flat", "ivf", "hnsw"])
    parser.add_argument("--nlist", type=int, default=1024)
    parser.add_argument("--candidates", type=int, default=None)
    parser.add_argument("--spread", type=float, default=4.0, help="scale of the centres (noise: 1)")
    parser.add_argument("--nprobe", type=int, default=None)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--skip-topk", action="store_true", help="skip the exact streaming S.topk baseline")
    args = parser.parse_args()

    work = args.workdir or tempfile.mkdtemp(prefix="gradalg-index-")
    store = os.path.join(work, "train.zarr")
    task, P = linear_task(), ga.proj.gaussian(K, seed=1)
    X, Xq = clustered(args.n, 1, args.spread), clustered(N_QUERY, 2, args.spread)
    G, Q = P(ga.grads(task, (X,), batch_size=8192)), P(ga.grads(task, (Xq,)))
    print(f"N = {args.n:,} projected rows × {K} (float32, centres ×{args.spread:g}), {N_QUERY} queries, "
          f"top {TOP}, kind {args.kind}, "
          f"torch threads {torch.get_num_threads()}")
    with ga.options(progress=False, check_reduction=False):
        t = time.perf_counter()
        ga.store.write(G, store, chunk_rows=65_536, overwrite=True)
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        idx = ga.store.index(store, metric="ip", kind=args.kind, overwrite=True,
                             nlist=args.nlist if args.kind == "ivf" else None)
        build_s = time.perf_counter() - t
        idx.search(Q, TOP, candidates=args.candidates, nprobe=args.nprobe)   # warm-up: page the index in
        latencies = []
        for _ in range(3):
            t = time.perf_counter()
            got = idx.search(Q, TOP, candidates=args.candidates, nprobe=args.nprobe)
            latencies.append(time.perf_counter() - t)
        q64, _ = idx.query_rows(Q)
        truth = exact_top(idx.rows, q64.double().numpy(), TOP)
        positions = {i: p for p, i in enumerate(idx.reader.ids)}
        found = np.vectorize(positions.__getitem__)(got["train"].values)
        recall = np.mean([len(set(a) & set(b)) / TOP for a, b in zip(found, truth)])
        topk_s = float("nan")
        if not args.skip_topk:
            t = time.perf_counter()
            (Q @ ga.store.open(store).T).topk(TOP)
            topk_s = time.perf_counter() - t
    store_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store) for f in fs)
    print(f"{'store write':28s} {write_s:9.1f} s   {store_bytes / 2**20:9.1f} MiB on disk")
    print(f"{'index build (' + idx.meta['factory'] + ')':28s} {build_s:9.1f} s   "
          f"{idx.disk_bytes() / 2**20:9.1f} MiB on disk (faiss index + row copy)")
    print(f"{'search, 32 queries':28s} {min(latencies):9.3f} s   (best of 3; median {np.median(latencies):.3f} s; "
          f"{got.attrs['candidates']} candidates re-scored exactly per query)")
    print(f"{'recall@10 vs exact':28s} {recall:9.3f}")
    if not args.skip_topk:
        print(f"{'exact streaming S.topk(10)':28s} {topk_s:9.1f} s   (over the store; ratio to the index search: "
              f"{topk_s / min(latencies):.0f}×)")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
