"""The executor's own overhead on a small compute, old tree against new, in alternating processes.

One measurement: ``grad_dot`` scores ``(Q @ G.T).compute()`` of a 2-layer GPT-2 (n_embd 64,
T = 32, random weights, nothing downloaded) over 64 training and 8 query sequences, batches
of 16, every Conv1D of ``transformer.h.*`` attributed; one warm-up compute, then 10 timed,
each a fresh executor (planning included). Reported: the process's CPU seconds for the 10
(on a shared machine wall seconds count the wait for a core; CPU seconds do not) and a
checksum of the scores (the trees must agree).

    .venv/bin/python benchmarks/exec_overhead.py --trees /work/old /work/new --rounds 2

runs ``--rounds`` rounds, each tree once per round in a fresh process with
``PYTHONPATH=<tree>``, alternating, and prints one JSON line per run, then the median CPU
seconds per tree and their ratio (new / old).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from alternating import alternate


def measure(tree: str) -> dict:
    import torch

    import gradalg as ga
    from alternating import tiny_gpt2

    torch.set_num_threads(1)
    T = 32
    model, lm_loss = tiny_gpt2(T)
    g = torch.Generator().manual_seed(0)
    X = torch.randint(0, 256, (64, T), generator=g)           # (64, T) training sequences
    XQ = torch.randint(0, 256, (8, T), generator=g)           # (8, T) queries
    task = ga.Task(model, lm_loss, name="gpt2-2x64")

    def once():
        G = ga.grads(task, (X,), "transformer.h.*")
        Q = ga.grads(task, (XQ,), "transformer.h.*")
        with ga.options(batch_size=16, progress=False):
            return (Q @ G.T).compute(ga.LocalExecutor())         # (8, 64)

    once()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(10):
        out = once()
    return {"tree": tree, "cpu_s": round(time.process_time() - cpu0, 3),
            "wall_s": round(time.perf_counter() - wall0, 3), "checksum": float(out.values.astype("float64").sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="two checkouts, compared in alternation")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    runs = alternate(__file__, args.trees, args.rounds)
    old, new = (statistics.median(r["cpu_s"] for r in runs[t]) for t in args.trees)
    print(json.dumps({"median_cpu_s": {"old": old, "new": new}, "new_over_old": round(new / old, 3),
                      "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
