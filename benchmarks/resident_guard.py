"""The resident-set guard's trims, memory and time: the pass's growth against its first
batch's (``exec/allocator.py`` ``ResidentGuard``, this checkout) against the rule it
replaced (the whole process's resident set against 1.25× the process's after the first
batch, reproduced here as ``ProcessWide``) and against a trim after every batch
(``release_growth=1.0``).

    python benchmarks/resident_guard.py [CASE ...] [--batches 4,16] [--repeats 3] [--n N]

Cases: ``gpt2_logra`` (``tests/budget_scripts/peak_memory.py``: LoGra on the 2-layer,
64-wide GPT-2, 32 tokens), ``gpt2_ekfac`` (EK-FAC influence on the same model's
unprojected gradients), ``gpt2_50k`` (LoGra on a 4-layer, 256-wide GPT-2 with GPT-2's
50,257-token vocabulary, 64 tokens; 0.6 GB resident). Each run is a fresh process (one
thread): the case's model and data, a warm-up run on 8 examples, then the run at
``memory_budget`` 8 GiB, ``batch_size`` forced and every pass over data guarded
(``release_memory_above=0``), each pass's peak measured from its own start. The rules
alternate process by process (old, new, every, old, new, every, ...). Printed per case and
batch, for the first pass over data (the largest): the median over repeats of its seconds,
its peak growth, its growth after its last batch and its trims per rule, and the ratios
new / old.

What it showed (2026-12-07, this 2-core machine under load 3-5, so seconds are noisy; the
first pass over data; medians of 5 runs, the 50k case of 3):

    case        batch  trims new (every)  peak new/old        pass time new/old  every/old
    gpt2_logra      4        6 (75)      11.7/12.1 MiB 0.97        0.81          1.05
    gpt2_logra     16        2 (19)      33.2/33.2 MiB 1.00        1.02          1.22
    gpt2_ekfac      4       12 (75)      93.4/120.2 MiB 0.78       1.02          1.15
    gpt2_ekfac     16        5 (19)     102.9/122.5 MiB 0.84       1.04          1.18
    gpt2_50k        4        1 (40)       398/399 MiB 1.00         0.99          1.02
    gpt2_50k       16        1 (10)      1554/1551 MiB 1.00        0.97          1.07

The rule replaced never trimmed in any of them (no pass grew the process's resident set,
0.5 GB and more, by 25 % after its first batch). The unprojected EK-FAC pass keeps 16-22 %
less resident for about the same time; LoGra's peak is unchanged (2-6 trims); the 50k
model's first batch already holds its largest tensors (one trim). The documented rule
without the re-arm (the reference fixed at the first batch; measured once with a copy of
it patched in) trimmed after 74 of 75 and 18 of 19 batches on all three small cases, and
LoGra's pass took 2-2.7x as long in single runs: their growth includes the rows the pass keeps.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 2**20
RULES = ("old", "new", "every")


def _cases():
    import torch
    import models
    import peak_memory as pm
    import gradalg as ga

    def gpt2(n, n_layer=2, n_embd=64, vocab=101, T=32, projected=True):
        model = models.gpt2(dtype=torch.float32, n_layer=n_layer, n_embd=n_embd, vocab=vocab)
        ids = torch.randint(1, vocab, (n + 4, T), generator=torch.Generator().manual_seed(0))
        mask, task, P = torch.ones_like(ids), models.lm_task(model), ga.proj.kron(k=16, seed=0)

        def scores(m):
            G, Q = ga.grads(task, (ids[:m], mask[:m])), ga.grads(task, (ids[n:], mask[n:]))
            if projected:
                G, Q = P(G), P(Q)
            return Q @ ga.ekfac(G).damp(1e-3).inv() @ G.T
        return scores
    return {"gpt2_logra": (pm.CASES["gpt2_logra"][0], 300),
            "gpt2_ekfac": (lambda n: gpt2(n, projected=False), 300),
            "gpt2_50k": (lambda n: gpt2(n, n_layer=4, n_embd=256, vocab=50257, T=64), 160)}


def child(case: str, batch: int, n: int, rule: str) -> None:
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "budget_scripts")]
    import torch
    import peak_memory as pm
    import gradalg as ga
    from gradalg.exec import allocator, runner

    class ProcessWide:
        """The rule before: the process's resident set against ``growth`` × its value after the first batch."""

        def __init__(self, growth):
            self.growth, self.reference, self.trims = growth, None, 0

        def after_batch(self):
            rss = allocator.resident_bytes() if self.growth > 1.0 else None
            if rss is not None and self.reference is None:
                self.reference = rss
                return
            if rss is None or rss > self.growth * self.reference:
                allocator.release_free_memory()
                self.trims += 1

    guards, made = [], ProcessWide if rule == "old" else allocator.ResidentGuard

    def guard(growth):
        guards.append(made(growth))
        guards[-1].start_rss = allocator.resident_bytes()
        return guards[-1]
    torch.set_num_threads(1)
    build, default_n = _cases()[case]
    scores = build(n or default_n)
    ga.devices.local_profile()
    with ga.options(progress=False):
        scores(8).compute()
    gc.collect()
    runner.ResidentGuard = guard
    isolated = pm.isolate_pass_peaks()
    ends = []
    release = runner.release_free_memory      # the pass-end trim: the growth just before it
    runner.release_free_memory = lambda: (ends.append(allocator.resident_bytes()), release())[1]
    with ga.options(progress=False, memory_budget=8 * 2**30, batch_size=batch, batch_tokens=10**9,
                    release_memory_above=0, release_growth=1.0 if rule == "every" else 1.25):
        ex = ga.exec.LocalExecutor()
        t = time.perf_counter()
        scores(n or default_n).compute(executor=ex)
        total = time.perf_counter() - t
    first = next(i for i, p in enumerate(ex.last_plan.passes) if p.trim_after_batches)
    g = guards[0]
    print(json.dumps({"seconds": ex.pass_stats[first]["seconds"], "total": total, "trims": g.trims,
                      "peak": isolated[first]["peak_rss_growth_bytes"], "end": ends[0] - g.start_rss,
                      "batches": -(-ex.last_plan.passes[first].key.n // batch)}))


def main(argv: list[str]) -> None:
    cases = [a for a in argv if not a.startswith("--")] or ["gpt2_logra", "gpt2_ekfac", "gpt2_50k"]
    opt = {a.split("=")[0]: a.split("=")[1] for a in argv if a.startswith("--") and "=" in a}
    batches = [int(b) for b in opt.get("--batches", "4,16").split(",")]
    repeats = int(opt.get("--repeats", "3"))
    for case in cases:
        for batch in batches:
            runs = {r: [] for r in RULES}
            for _ in range(repeats):
                for rule in RULES:
                    out = subprocess.run([sys.executable, __file__, "--child", case, str(batch),
                                          opt.get("--n", "0"), rule], capture_output=True, text=True, check=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
                    runs[rule].append(json.loads(out.stdout.strip().splitlines()[-1]))
            med = {r: {k: statistics.median(x[k] for x in v) for k in v[0]} for r, v in runs.items()}
            print(f"{case} batch {batch} ({med['new']['batches']:.0f} batches in its first pass over data, "
                  f"{repeats} runs per rule)")
            for r, m in med.items():
                print(f"  {r:<6} pass {m['seconds']:7.3f} s  run {m['total']:7.3f} s  peak {m['peak'] / MiB:7.2f} MiB  "
                      f"after last batch {m['end'] / MiB:7.2f} MiB  trims {m['trims']:4.0f}")
            o, w = med["old"], med["new"]
            print(f"  new/old: pass time {w['seconds'] / o['seconds']:.2f}  peak {w['peak'] / max(o['peak'], 1):.2f}  "
                  f"after last batch {w['end'] / max(o['end'], 1):.2f}; every/old pass time "
                  f"{med['every']['seconds'] / o['seconds']:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main(sys.argv[1:])
