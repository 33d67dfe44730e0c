"""EK-FAC's eigenvalue correction on one block: the code before session 39 against the reused buffers.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/ekfac_correction.py
    ... benchmarks/ekfac_correction.py --shapes 4,58,2048,2048 4,32,2048,2048     # c,t,in,out

Per (out, in) block and chunk of c examples of t positions each (an OLMoE-width expert
holds its routed tokens, t ≈ 30–100 of T = 128), the correction rotates the factors,
R_i = (D_i Q_S)ᵀ (A_i Q_A), and adds Σ_i R_i² to float64 sums. ``old``: the code before
session 39, ``(einsum(...) ** 2).sum(0).to(float64)`` (four fresh tensors per block and
chunk, tens of MB each); ``new``: ``EKFACAccumulator``'s path, ``rotate_factors`` into a
reused buffer, squared in place, summed into a second reused buffer and added without a
float64 copy. Prints each one's CPU milliseconds (best of ``--reps``), whether the sums are
bit-identical, and the new path's estimate from this machine's device profile (the rotation
GEMMs and :func:`gradalg.plan.jobs.kron.correction_traffic`).

The whole-model comparison in docs/performance.md (session 39, GPT-2 4 × 768) ran
``ga.methods.influence(task, train, queries, curvature="ekfac").explain(analyze=True)`` in
alternating processes with ``PYTHONPATH`` on this tree and on ``git archive c56d8a6 gradalg``.
"""
from __future__ import annotations

import argparse
import time

import torch

from gradalg.capture.factors import Factors
from gradalg.linalg.kron import rotate_factors
from gradalg.plan.cost import bmm_cost, gemm_cost
from gradalg.devices import profile
from gradalg.plan.jobs.kron import correction_traffic


def cpu_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4,128,2048,2048", "4,58,2048,2048", "4,32,2048,2048",
                                                     "4,58,1024,2048"], help="c,t,in,out per block")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    prof = profile("cpu")
    print(f"# device profile {prof.name}; CPU ms, best of {args.reps}")
    for spec in args.shapes:
        c, t, i, o = (int(x) for x in spec.split(","))
        g = torch.Generator().manual_seed(0)
        F = Factors(torch.randn(c, t, i, generator=g), torch.randn(c, t, o, generator=g))
        Q_A = torch.linalg.eigh(torch.randn(i, i, dtype=torch.float64, generator=g).T @
                                torch.randn(i, i, dtype=torch.float64, generator=g))[1].to(torch.float32)
        Q_S = torch.linalg.eigh(torch.randn(o, o, dtype=torch.float64, generator=g).T @
                                torch.randn(o, o, dtype=torch.float64, generator=g))[1].to(torch.float32)
        old_sums, new_sums = torch.zeros(o, i, dtype=torch.float64), torch.zeros(o, i, dtype=torch.float64)
        buf, summed = torch.empty(c, o, i), torch.empty(o, i)

        def old():
            rotated = rotate_factors(F, Q_S, Q_A)
            old_sums.add_((rotated ** 2).sum(0).to(torch.float64))

        def new():
            rotated = rotate_factors(F, Q_S, Q_A, out=buf)
            rotated.square_()
            new_sums.add_(torch.sum(rotated, 0, out=summed))

        t_old, t_new = cpu_ms(old, args.reps), cpu_ms(new, args.reps)
        equal = torch.equal(old_sums, new_sums)
        est = (gemm_cost(c * t, i, i) + gemm_cost(c * t, o, o) + bmm_cost(c, o, i, t)
               + correction_traffic(c, o, i, 4)).seconds(prof)
        print(f"c={c} t={t} in={i} out={o}: old {t_old:.1f} ms, new {t_new:.1f} ms ({t_new / t_old:.2f}×), "
              f"sums bit-identical {equal}; new estimated {1e3 * est:.1f} ms")


if __name__ == "__main__":
    main()
