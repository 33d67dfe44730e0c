"""The resident set over a loop of computations (a researcher scoring checkpoints), old tree
against new, in alternating processes.

Each ``compute()`` used to leave its intermediates (the executor's run state: resolved
operators, kept rows, the last plan) in reference cycles, freed only when Python's cyclic
garbage collector happened to run a full collection, which it does on counts of allocated
objects, not on memory: the resident set grew by each computation's intermediates.

The loop: a 2-layer GPT-2 (n_embd 64, T = 32, random weights, nothing downloaded,
:func:`alternating.tiny_gpt2`), ``--n`` training sequences and 8 queries; ``--loops`` times,
a fresh copy of the model (``copy.deepcopy``, as a new checkpoint would be) and the scores of
``--method`` (``ga.methods.<method>(task, train, queries).compute()``, default arguments),
the result dropped; ``--curvature datainf`` passes that curvature, and ``--use explain`` runs
``explain(analyze=True)`` instead and drops the Explain (which holds the executor that ran: a
resolved DataInf operator in its run state was in a cycle with it until session 49).
No ``gc.collect()`` is called in the loop. Reported per run: the
resident set (MiB) after each computation, then after ``gc.collect()`` and ``malloc_trim``
at the end, and the number of full (generation 2) collections the GC ran during the loop.

    .venv/bin/python benchmarks/loop_memory.py --trees /work/old /work/new --rounds 2

prints one JSON line per run, then per tree the median resident set after the first and the
last computation, the growth between them per computation, the highest after any computation
(freed memory the allocator keeps makes the new tree's resident set go up and down by one
computation's worth), and the growth per computation of both trees (wrap it in ``flock /work/bigmem.lock`` on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import statistics

from alternating import alternate


def measure(method: str, n: int, loops: int, curvature: str | None = None, use: str = "compute") -> dict:
    import copy
    import ctypes
    import gc

    import torch

    import gradalg as ga
    from alternating import tiny_gpt2

    torch.set_num_threads(1)
    ga.options(progress=False, fingerprint_cache=False)
    model, _ = tiny_gpt2()
    g = torch.Generator().manual_seed(0)
    items = [{"input_ids": r} for r in torch.randint(1, 256, (n + 8, 32), generator=g)]
    train, queries = items[:n], items[n:]

    def rss() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    gc.collect()
    full0 = gc.get_stats()[2]["collections"]
    after = []
    for _ in range(loops):
        m = copy.deepcopy(model)
        S = getattr(ga.methods, method)(ga.tasks.causal_lm(m), train, queries,
                                        **({"curvature": curvature} if curvature else {}))
        S.compute() if use == "compute" else S.explain(analyze=True)
        del S
        del m
        after.append(round(rss(), 1))
    full = gc.get_stats()[2]["collections"] - full0
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return {"rss_mib": after, "end_collected_trimmed_mib": round(rss(), 1), "full_collections": full}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="two checkouts, compared in alternation")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--method", default="relatif")
    parser.add_argument("--n", type=int, default=256, help="training sequences")
    parser.add_argument("--loops", type=int, default=8)
    parser.add_argument("--curvature", default="", help="the method's curvature (default: its own)")
    parser.add_argument("--use", choices=("compute", "explain"), default="compute")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"tree": args.child, "method": args.method,
                          **measure(args.method, args.n, args.loops, args.curvature or None, args.use)}))
        return
    runs = alternate(__file__, args.trees, args.rounds, ["--method", args.method, "--n", args.n, "--loops", args.loops,
                                                          "--curvature", args.curvature, "--use", args.use])
    growth = {}
    for tree, results in runs.items():
        first = statistics.median(r["rss_mib"][0] for r in results)
        last = statistics.median(r["rss_mib"][-1] for r in results)
        high = statistics.median(max(r["rss_mib"]) for r in results)
        end = statistics.median(r["end_collected_trimmed_mib"] for r in results)
        growth[tree] = (last - first) / max(args.loops - 1, 1)
        print(f"{tree}: {args.method} {args.curvature} {args.use}, resident after computation 1: {first:.0f} MiB, after {args.loops}: {last:.0f} MiB "
              f"({growth[tree]:+.1f} MiB per computation), highest {high:.0f} MiB; collected and trimmed at the end: "
              f"{end:.0f} MiB")
    old, new = args.trees
    print(f"growth per computation, new / old: {growth[new]:.1f} / {growth[old]:.1f} MiB")


if __name__ == "__main__":
    main()
