"""Rows read outside a pass, old tree against new, in alternating processes: the executor's
unplanned pull path (``iter_chunks``, before session 46) against planned windows of rows
(``Executor.window`` / ``windows``, one plan per window).

Two measurements on a 2-layer GPT-2 (n_embd 64, T = 32, random weights, nothing
downloaded), every Conv1D of ``transformer.h.*``, batches of 16:

* ``store``: ``ga.store.write(P(G), chunk_rows=32)`` of 256 training sequences projected by
  ``ga.proj.kron(k=16)`` (8 chunks: 8 windows, each a plan of its own on the new tree);
* ``datainf``: DataInf's self-scores ``(Q @ ga.datainf(P(G), 0.1) @ Q.T).diag()`` of 16
  queries over 128 training sequences: the diag pass applies DataInf to each batch of
  queries, each application reading the training rows outside that pass (new tree: by
  windows, here one window of all 128 rows).

Each measurement runs once as a warm-up, then 3 times timed. Reported: the process's CPU
seconds per measurement (on a shared machine wall seconds count the wait for a core) and a
checksum of its numbers (the trees must agree).

    .venv/bin/python benchmarks/window_rows.py --trees /work/old /work/new --rounds 3

runs ``--rounds`` rounds, each tree once per round in a fresh process with
``PYTHONPATH=<tree>``, alternating, prints one JSON line per run, then the median CPU
seconds per tree and measurement and their ratio (new / old).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from alternating import alternate


def measure(tree: str) -> dict:
    import numpy as np
    import torch

    import gradalg as ga
    from alternating import tiny_gpt2

    torch.set_num_threads(1)
    T = 32
    model, lm_loss = tiny_gpt2(T)
    g = torch.Generator().manual_seed(0)
    X = torch.randint(0, 256, (256, T), generator=g)          # (256, T) training sequences
    XQ = torch.randint(0, 256, (16, T), generator=g)          # (16, T) queries
    task = ga.Task(model, lm_loss, name="gpt2-2x64")
    P = ga.proj.kron(k=16, seed=0)
    folder = tempfile.mkdtemp()

    def store():
        G = ga.grads(task, (X,), "transformer.h.*")
        with ga.options(batch_size=16, progress=False):
            stored = ga.store.write(P(G), os.path.join(folder, "g.zarr"), chunk_rows=32, overwrite=True)
        return float(sum(v.double().sum() for v in stored.to_dense().values()))

    def datainf():
        G = ga.grads(task, (X[:128],), "transformer.h.*")
        Q = ga.grads(task, (XQ,), "transformer.h.*")
        with ga.options(batch_size=16, progress=False):
            out = (P(Q) @ ga.datainf(P(G), 0.1) @ P(Q).T).diag().compute(ga.LocalExecutor())
        return float(np.asarray(out.values, dtype=np.float64).sum())

    result = {"tree": tree}
    for name, fn in (("store", store), ("datainf", datainf)):
        fn()
        cpu0 = time.process_time()
        for _ in range(3):
            checksum = fn()
        result[name] = {"cpu_s": round(time.process_time() - cpu0, 3), "checksum": checksum}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="two checkouts, compared in alternation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    runs = alternate(__file__, args.trees, args.rounds)
    summary = {}
    for name in ("store", "datainf"):
        old, new = (statistics.median(r[name]["cpu_s"] for r in runs[t]) for t in args.trees)
        summary[name] = {"old_cpu_s": old, "new_cpu_s": new, "new_over_old": round(new / old, 3)}
    print(json.dumps({"median": summary, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
