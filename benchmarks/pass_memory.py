"""Each pass's measured peak growth against its plan's estimate, at forced batch sizes,
for the cases of ``tests/budget_scripts/peak_memory.py``, under glibc's default allocator
and with its mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_=131072``: tensors of 128 KiB
and more mapped and unmapped each time, so the resident set follows the live tensors).

    python benchmarks/pass_memory.py [CASE ...] [--batches 4,8,16] [--n N]

Each run is a fresh process (one thread): the case's model, data and warm-up, then the
plan at ``memory_budget`` 8 GiB with ``batch_size`` forced (``batch_tokens`` lifted), each
pass's peak measured from its own start (``isolate_pass_peaks``), and, for the first pass
over data, the peak of each of its first batches (the kernel's mark reset after each).
Printed: per pass, the estimate, the measured growth under both allocators and their
ratios to the estimate, and the ratio of the pass's seconds (mmap / default); the per-batch
peaks show where a pass outgrows its first batch.

What it showed (2026-12-07, this 2-core machine, stored rows in one buffer per tensor):
LoGra on the 2-layer GPT-2, pass 0 = K-FAC + store of 300 rows, estimated 7.1 / 11.3 /
19.6 MiB at batch 4 / 8 / 16, measured 12.0 / 19.4 / 33.5 (1.69-1.72x) by default and
9.7 / 14.2 / 20.6 (1.37 / 1.27 / 1.05x) with the threshold fixed, that pass then 2.0 /
1.5 / 1.46x slower (every batch's large tensors faulted in again). Its first batch peaks
at or under the plan (3.8 / 7.3 / 16.2 MiB), the second at 1.6-1.9x and the rest stay
there: glibc's heap, not a tensor the plan misses. The small Llama's K-FAC + store pass:
0.98-1.02x of its estimate under both allocators (its jobs' own per-example work is larger).
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 2**20
ALLOCATORS = {"default": {}, "mmap 128 KiB": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def child(case: str, batch: int, n: int | None) -> None:
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "budget_scripts")]
    import torch
    import peak_memory as pm
    import gradalg as ga
    from gradalg.exec import allocator

    torch.set_num_threads(1)
    build, default_n = pm.CASES[case]
    n = n or default_n
    scores = build(n)
    ga.devices.local_profile()
    with ga.options(progress=False):
        scores(8).compute()
    gc.collect()
    isolated, batches, guard, start = pm.isolate_pass_peaks(), [], allocator.ResidentGuard.after_batch, 0

    def after_batch(self):            # the peak of each of the first pass's first batches
        if len(batches) < 6 and len(isolated) == 0:
            batches.append(pm.peak_rss() - start)
            pm.reset_peak()
        guard(self)
    allocator.ResidentGuard.after_batch = after_batch
    with ga.options(progress=False, memory_budget=8 * 2**30, batch_size=batch, batch_tokens=10**9,
                    release_memory_above=0):
        ex, start = ga.exec.LocalExecutor(), pm.current_rss()
        scores(n).compute(executor=ex)
    passes = [{"jobs": [j.kind for j in p.jobs], "batch": p.batch_size, "estimated": p.cost.peak_bytes,
               "measured": m["peak_rss_growth_bytes"], "seconds": st["seconds"]}
              for p, m, st in zip(ex.last_plan.passes, isolated, ex.pass_stats)]
    print(json.dumps({"passes": passes, "batch_peaks": batches}))


def main(argv: list[str]) -> None:
    cases = [a for a in argv if not a.startswith("--") and not a[0].isdigit()] or ["gpt2_logra", "llama_kfac"]
    opt = {a.split("=")[0]: a.split("=")[1] for a in argv if a.startswith("--") and "=" in a}
    batches = [int(b) for b in opt.get("--batches", "4,8,16").split(",")]
    for case in cases:
        for batch in batches:
            runs = {}
            for name, env in ALLOCATORS.items():
                out = subprocess.run([sys.executable, __file__, "--child", case, str(batch), opt.get("--n", "0")],
                                     capture_output=True, text=True, check=True,
                                     env={**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
                runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{case} batch {batch}")
            for i, p in enumerate(runs["default"]["passes"]):
                measured = [r["passes"][i]["measured"] for r in runs.values()]
                slower = runs["mmap 128 KiB"]["passes"][i]["seconds"] / p["seconds"]
                print(f"  pass {i} {'+'.join(p['jobs']):<14} est {p['estimated'] / MiB:7.2f} MiB  "
                      + "  ".join(f"{k} {m / MiB:6.2f} ({m / max(p['estimated'], 1):.2f}x)"
                                  for k, m in zip(runs, measured)) + f"  time mmap/default {slower:.2f}")
            for k, r in runs.items():
                base = r["batch_peaks"]
                print(f"  {k}: the first pass's batches' peaks (growth, MiB): "
                      + ", ".join(f"{b / MiB:.1f}" for b in base))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) or None)
    else:
        main(sys.argv[1:])
