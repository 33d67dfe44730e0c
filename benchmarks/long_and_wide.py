"""Token blocks and float32 Kronecker factors, measured side by side on this machine.

    python benchmarks/long_and_wide.py                  # T in 1024, 2048; widths 1024, 2048
    python benchmarks/long_and_wide.py --T 1024 4096 --widths 2048 4096

1. The ghost kernel ⟨G_i, G_j⟩ = Σ_{t,s}(a_it·a_js)(d_it·d_js) on random factors (2 × 4
   examples, in = out = 64), unblocked and in blocks of ``--block`` positions: seconds
   (best of ``--repeat``, configurations interleaved) and the largest intermediate it
   allocates (elements × 4 bytes, from the kernel's own slices), and the two results'
   relative difference.
2. One symmetric positive semi-definite factor of each width (a spectrum over 4 decades):
   ``torch.linalg.eigh`` in float64, and in float32 with gradalg's float64 check
   (``checked_eigh``), seconds and the eigenvalue error bound δ/‖M‖ the check reports.
   On a CPU the check (3 d³ float64 multiply-adds) costs about as much as the float64
   eigh it replaces; on a GPU it is a few GEMMs.
"""
from __future__ import annotations

import argparse
import time

import torch

from gradalg.capture import factors as F
from gradalg.curvature.kron import checked_eigh


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def ghost_rows(Ts, block, repeat):
    rows = []
    for T in Ts:
        g = torch.Generator().manual_seed(T)
        L = F.Factors(torch.randn(2, T, 64, generator=g), torch.randn(2, T, 64, generator=g))
        R = F.Factors(torch.randn(4, T, 64, generator=g), torch.randn(4, T, 64, generator=g))
        results = {}
        for name, tb in (("unblocked", None), (f"blocks of {block}", block)):
            seconds, out = best(lambda: F.ghost_inner(L, R, 2**26, tb), repeat)
            results[name] = (seconds, out, F.ghost_workspace_elements(2, 4, T, T, 2**26, tb) * 4)
        (s0, o0, m0), (s1, o1, m1) = results.values()
        rows.append((T, s0, m0, s1, m1, float((o1 - o0).norm() / o0.norm())))
    print(f"ghost kernel, 2×4 examples, in = out = 64, float32 (block {block})")
    print(f"{'T':>6} {'unblocked s':>12} {'its peak MB':>12} {'blocked s':>10} {'its peak MB':>12} "
          f"{'time ratio':>10} {'rel diff':>9}")
    for T, s0, m0, s1, m1, diff in rows:
        print(f"{T:>6} {s0:>12.3f} {m0 / 1e6:>12.1f} {s1:>10.3f} {m1 / 1e6:>12.2f} {s1 / s0:>10.2f} {diff:>9.1e}")


def eigh_rows(widths, repeat):
    print("\nKronecker factor eigendecomposition (spectrum over 4 decades)")
    print(f"{'d':>6} {'float64 s':>10} {'float32+check s':>16} {'ratio':>6} {'check s':>8} {'δ/‖M‖':>9}")
    for d in widths:
        g = torch.Generator().manual_seed(d)
        X = torch.randn(2 * d, d, generator=g, dtype=torch.float64) * torch.logspace(0, -2, d, dtype=torch.float64)
        M64 = X.T @ X / (2 * d)
        M32 = M64.float()
        s64, _ = best(lambda: torch.linalg.eigh(M64), repeat)
        s32e, _ = best(lambda: torch.linalg.eigh(M32), repeat)
        s32, (_, _, check) = best(lambda: checked_eigh(M32, 1e-2), repeat)
        print(f"{d:>6} {s64:>10.2f} {s32:>16.2f} {s32 / s64:>6.2f} {s32 - s32e:>8.2f} {check.relative:>9.1e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--widths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ghost_rows(args.T, args.block, args.repeat)
    eigh_rows(args.widths, args.repeat)


if __name__ == "__main__":
    main()
