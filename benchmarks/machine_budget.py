"""What the memory budget bounds: a run's peak resident memory against its budget.

Each case runs in a fresh process (one thread): a GPT-2-shaped model (random init,
vocabulary 50,257, tied head; ``--n-layer`` blocks of width 768), ``--n-train`` training
sequences and 2 queries of ``--tokens`` tokens, ``ga.tasks.causal_lm(model)`` and the
method at its defaults, under the budget asked for (``machine``: the default,
``memory_fraction`` of MemAvailable when the plan is made; or bytes such as ``512MB``).
Printed per case: the budget and its source, the process's resident memory before the
run (torch, the model's weights, the data: what the budget does not count, because it
is already out of MemAvailable), its peak during the run (VmHWM), the growth between
the two, the plan's estimated peak, and growth / budget, peak / budget, growth / estimate.
The attributed layers are the blocks' linears (``transformer.h.*``; ``--every-layer``:
the head and embeddings too). Measured after a warm-up run of the method on one sequence
(imports, kernels' first allocations; as ``tests/test_budgets.py`` does), ``--cold``
without.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/machine_budget.py
    ... benchmarks/machine_budget.py --n-layer 12 --methods grad_dot logra --budgets machine 512MB
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_case(method: str, budget: str, n_layer: int, n_train: int, tokens: int, warm: bool = True,
             every_layer: bool = False) -> dict:
    """One case, in this process (``--case``); ``warm``: after a run of the method on one
    training sequence (imports, kernels' first allocations), with the peak mark reset."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import gradalg as ga

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=768, n_head=12, vocab_size=50257,
                                       n_positions=max(tokens, 64))).eval()
    g = torch.Generator().manual_seed(1)

    def items(n):
        return [{"input_ids": torch.randint(0, 50257, (tokens,), generator=g),
                 "attention_mask": torch.ones(tokens, dtype=torch.long)} for _ in range(n)]

    train, queries = items(n_train), items(2)
    task = ga.tasks.causal_lm(model)
    layers = None if every_layer else ["transformer.h.*"]
    ga.devices.local_profile()           # measured once per machine, not part of the run
    options = dict(progress=False, memory_budget=None if budget == "machine" else budget)
    if warm:
        with ga.options(progress=False):
            getattr(ga.methods, method)(task, train[:1], queries[:1], layers=layers).compute()
        import gc
        gc.collect()
        _reset_peak()
    with ga.options(**options):
        S = getattr(ga.methods, method)(task, train, queries, layers=layers)
        ex = ga.exec.LocalExecutor()
        before = _rss()
        try:
            p = ex.plan(S.expr)
            S.compute(executor=ex)
            refused = None
        except ga.MemoryBudgetError as err:
            p, refused = None, str(err)[:300]
    peak = _peak()
    out = {"method": method, "n_layer": n_layer, "warm": warm, "rss_before": before, "peak_rss": peak,
           "growth": peak - before, "refused": refused}
    if p is not None:
        out.update(budget=p.budget.bytes, budget_text=p.budget.describe(), estimated_peak=p.peak_bytes,
                   batch_sizes=[q.batch_size for q in p.passes])
        out.update(growth_over_budget=out["growth"] / p.budget.bytes, peak_over_budget=peak / p.budget.bytes,
                   growth_over_estimate=out["growth"] / max(p.peak_bytes, 1.0))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-train", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--methods", nargs="+", default=["grad_dot", "logra"])
    ap.add_argument("--budgets", nargs="+", default=["machine", "128MB", "512MB"])
    ap.add_argument("--cold", action="store_true", help="no warm-up run before the measured one")
    ap.add_argument("--every-layer", action="store_true", help="every layer (head, embeddings), not transformer.h.*")
    ap.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], args.case[1], args.n_layer, args.n_train, args.tokens, not args.cold,
                                  args.every_layer)))
        return
    print(f"{'method':<10} {'budget':<58} {'before':>8} {'peak':>8} {'growth':>8} {'est.':>8} "
          f"{'grow/bud':>8} {'peak/bud':>8} {'grow/est':>8} batches")
    for budget in args.budgets:
        for method in args.methods:
            cmd = [sys.executable, __file__, "--case", method, budget, "--n-layer", str(args.n_layer),
                   "--n-train", str(args.n_train), "--tokens", str(args.tokens)] + (["--cold"] if args.cold else []) + (["--every-layer"] if args.every_layer else [])
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                print(method, budget, "failed:", done.stderr[-1500:])
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            mb = 2**20
            if r["refused"]:
                print(f"{method:<10} refused: {r['refused']}")
                continue
            print(f"{method:<10} {r['budget_text'][:58]:<58} {r['rss_before'] / mb:>6.0f}MB {r['peak_rss'] / mb:>6.0f}MB "
                  f"{r['growth'] / mb:>6.0f}MB {r['estimated_peak'] / mb:>6.0f}MB {r['growth_over_budget']:>8.2f} "
                  f"{r['peak_over_budget']:>8.2f} {r['growth_over_estimate']:>8.2f} {r['batch_sizes']}")


if __name__ == "__main__":
    main()
