"""A self-score with a held side, old tree against new, in alternating processes.

``(G₁ @ G₂.T).diag()`` between two checkpoints of a 2-layer GPT-2 (n_embd 64, T = 32,
random weights, nothing downloaded) over the same ``--n`` training sequences, every Conv1D
of ``transformer.h.*`` attributed (factored rows): the two sides read different models, so
the plan collects G₁ (held) and streams G₂, aligning the held rows to each streamed chunk
by example id (``DiagJob(held=...)``). One warm-up compute, then ``--repeats`` timed ones.
Reported per run: the process's CPU seconds, its peak resident set (``VmHWM``; each run
is a fresh process) and a checksum of the diagonal (the trees must agree).

    .venv/bin/python benchmarks/diag_held.py --trees /work/old /work/new --rounds 2

Each round runs each tree once in a fresh process with ``PYTHONPATH=<tree>``, alternating;
then the medians per tree and their ratios (new / old) are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from alternating import alternate


def peak_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def measure(tree: str, n: int, repeats: int) -> dict:
    import torch

    import gradalg as ga
    from alternating import tiny_gpt2

    torch.set_num_threads(1)
    T = 32
    first, lm_loss = tiny_gpt2(T, seed=0)
    second, _ = tiny_gpt2(T, seed=1)
    X = torch.randint(0, 256, (n, T), generator=torch.Generator().manual_seed(0))    # (n, T)

    data = (X,)
    G1 = ga.grads(ga.Task(first, lm_loss, name="ckpt-1"), data, "transformer.h.*")
    G2 = ga.grads(ga.Task(second, lm_loss, name="ckpt-2"), data, "transformer.h.*")

    def once():
        with ga.options(batch_size=16, progress=False, check_models=False):   # two checkpoints, on purpose
            return (G1 @ G2.T).diag().compute(ga.LocalExecutor())      # (n,)

    once()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        out = once()
    return {"tree": tree, "cpu_s": round(time.process_time() - cpu0, 3),
            "wall_s": round(time.perf_counter() - wall0, 3), "peak_mb": round(peak_mb(), 1),
            "checksum": float(out.values.astype("float64").sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="two checkouts, compared in alternation")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--n", type=int, default=256, help="training sequences (chunks of 16)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.n, args.repeats)))
        return
    runs = alternate(__file__, args.trees, args.rounds, ("--n", args.n, "--repeats", args.repeats))
    old, new = ({key: statistics.median(r[key] for r in runs[t]) for key in ("cpu_s", "peak_mb")} for t in args.trees)
    print(json.dumps({"median": {"old": old, "new": new},
                      "new_over_old": {key: round(new[key] / old[key], 3) for key in old},
                      "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
