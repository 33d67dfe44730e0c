"""The SJLT kernel: one CSR product (now) against ``index_add_`` scatter-adds (before).

``gradalg.proj.kernels.sjlt_apply`` computes ``x Sᵀ`` for an (n, d) batch of flattened
gradients and a (k, d) sparse JL matrix with s non-zeros per column. It scattered each
column into its output with ``index_add_`` along dim 1, whose CPU cost per index barely
shrinks with n: at the planner's CPU batches (``batch_tokens`` = 512 positions, 4
sequences of 128) the kernel took most of a TRAK pass. It now multiplies by the matrix
as a cached CSR tensor. This script times both on one thread, alternating within each
repeat, on a GPT-2 MLP layer's gradient (d = 1024 × 257) and on a slice the factored
path materializes, and prints the medians and their ratio; it asserts the two give the
same numbers.

    .venv/bin/python benchmarks/sjlt.py                 # k = 512, s in {1, 4}, n in {1, 4, 16, 64}
    .venv/bin/python benchmarks/sjlt.py --k 4096 --repeats 9
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import gradalg as ga  # noqa: E402
from gradalg.proj import sparse_tables  # noqa: E402
from gradalg.proj.kernels import sjlt_apply, sjlt_scatter_add as scatter_adds  # noqa: E402  (the previous kernel)


def timed(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--d", type=int, default=1024 * 257, help="input coordinates (a GPT-2 4x256 MLP layer)")
    ap.add_argument("--s", default="1,4")
    ap.add_argument("--n", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"x Sᵀ, x (n, {args.d}) float32, S ({args.k}, {args.d}); one thread; medians of {args.repeats} "
          "alternating repeats (each the mean of 3 calls)")
    print(f"{'s':>2} {'n':>4} {'table':>6} {'index_add_ ms':>14} {'CSR ms':>8} {'speed-up':>9}")
    for s in (int(v) for v in args.s.split(",")):
        P = ga.proj.sparse(args.k, s=s, per_block=True)
        full = sparse_tables.sjlt(P, "bench", args.d)
        t0 = time.perf_counter()
        full.csr(torch.float32)
        build = time.perf_counter() - t0
        for n in (int(v) for v in args.n.split(",")):
            x = torch.randn(n, args.d)
            for name, S, xs in (("whole", full, x), ("slice", None, x[:, : args.d // 4])):
                # a slice is a fresh SJLT each call (the factored path's row slices): CSR built each time
                make = (lambda: full) if S is not None else (lambda: full.columns(0, args.d // 4))
                if not torch.equal(sjlt_apply(xs, make()), scatter_adds(xs, make())):
                    raise AssertionError(f"s={s} n={n} {name}: the CSR product and the scatter-adds differ")
                old, new = [], []
                for _ in range(args.repeats):
                    old.append(timed(lambda: scatter_adds(xs, make()), 3))
                    new.append(timed(lambda: sjlt_apply(xs, make()), 3))
                o, w = statistics.median(old), statistics.median(new)
                print(f"{s:>2} {n:>4} {name:>6} {o * 1e3:>14.2f} {w * 1e3:>8.2f} {o / w:>8.2f}x")
        print(f"   (s={s}: building the whole table's CSR once took {build * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
