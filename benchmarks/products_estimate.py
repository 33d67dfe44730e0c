"""Estimate ÷ measured seconds per call of the curvature-products passes of ``ga.methods.influence``
at its defaults on a digits setting of ``benchmarks/fidelity.py`` (``explain(analyze=True)``):
one JSON line per products pass, with the pass's line of ``explain()`` (its vmap chunks), per call
the wall seconds and this process's CPU seconds (``est/meas_cpu``: the estimate over the CPU seconds,
what a loaded machine's comparison should read); then per size of call (its vectors: a
near-minimum probe's 1-vector calls and the formation's 256-vector calls share one pass: before
groups of calls the plan priced each at 256, now each group at its own vectors) the CPU seconds per call against the job's price of one call of that size.

Old against new: the first argument names the tree whose ``gradalg`` to import (another worktree:
the code before a change); run one process per tree:

    for tree in /work/main .; do OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 \\
        .venv/bin/python benchmarks/products_estimate.py $tree conv_wd; done
"""
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(tree: str, setting: str) -> None:
    tree = str(Path(tree).resolve())
    sys.path.insert(0, tree)
    import torch

    import gradalg as ga                       # the named tree's, before fidelity.py adds its own
    assert Path(ga.__file__).resolve().is_relative_to(tree), ga.__file__
    sys.path.insert(1, str(HERE))
    import fidelity as F

    torch.set_num_threads(1)
    ga.options(progress=False)
    s = F.SETTINGS[setting]
    s.prepare()
    S = ga.methods.influence(s.task(), s.train, s.queries)
    per_call = _timed_calls(ga)
    t0 = time.perf_counter()
    shown = S.explain(analyze=True)
    wall = time.perf_counter() - t0
    for m in sorted({m for m, _, _ in per_call}):      # the calls by their vectors: the estimate of one such call
        rows = [(cpu, est) for k, cpu, est in per_call if k == m]
        cpu = sum(c for c, _ in rows) / len(rows)
        print(json.dumps({"tree": tree, "setting": setting, "vectors": m, "calls": len(rows), "est_call_s": rows[0][1],
                          "meas_cpu_call_s": cpu, "est/meas_cpu": rows[0][1] / cpu, "load": os.getloadavg()[0]}),
              flush=True)
    for r in shown.passes():
        if "measured_calls" in r:
            print(json.dumps({"tree": tree, "setting": setting, "jobs": r["jobs"], "calls": r["measured_calls"],
                              "est_call_s": r["estimated_call_seconds"], "meas_call_s": r["measured_call_seconds"],
                              "est/meas": r["estimated_call_seconds"] / r["measured_call_seconds"],
                              "meas_cpu_call_s": r.get("measured_cpu_seconds", float("nan")) / r["measured_calls"],
                              "est/meas_cpu": r["estimated_call_seconds"] * r["measured_calls"]
                              / r.get("measured_cpu_seconds", float("nan")),
                              "load": os.getloadavg()[0], "wall": wall}, ensure_ascii=False), flush=True)


def _timed_calls(ga) -> list:
    """``[(vectors, CPU seconds, estimated seconds), ...]``, one per call of a products pass, filled
    as they run: each call's estimate is the job's price of one call of that many vectors
    (``call_cost`` on this machine's profile), as the pass would price a call of its own size."""
    from dataclasses import replace

    import torch
    from gradalg.devices import local_profile
    from gradalg.plan.jobs import ProductPass
    prof, out, call = local_profile(), [], ProductPass.__call__

    def timed(self, V):
        cpu = time.process_time()
        result = call(self, V)
        cpu = time.process_time() - cpu
        m, job = int(V.shape[0]), self.job
        dtype = next(job.target.task.model.parameters()).dtype
        if hasattr(job, "groups"):      # a job in groups of calls: the price of a call of m vectors
            cost = job.call_cost(dtype, prof, m)
        else:                           # the code before groups: one vectors field
            cost = replace(job, vectors=m).call_cost(dtype, prof)
        out.append((m, cpu, prof.time_of(cost, dtype)))
        return result
    ProductPass.__call__ = timed
    return out


if __name__ == "__main__":
    main(*(sys.argv[1:3] if len(sys.argv) > 2 else (str(HERE.parent), sys.argv[1] if len(sys.argv) > 1 else "mlp")))
