"""Operators held by the scores pass of K-FAC / EK-FAC influence on a GPT-2 with a 50k vocabulary.

Each curvature runs in its own process (peak resident set per run): ``layers="all"``, random
init, 8 training sequences and 2 queries of 64 tokens, one thread. Prints per run the
process's peak RSS, every pass's estimate against its measured peak growth, and the bytes
of the resolved operators the executor holds after the run (tensors shared between the
operators of a damp → inverse chain counted once).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ops_memory.py --layers 2
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch


def held_operator_bytes(state) -> int:
    """Bytes of the distinct tensors behind the executor's resolved operators."""
    seen, total = set(), 0

    def visit(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            key = (x.untyped_storage().data_ptr(), x.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += key[1]
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                visit(v)
        elif hasattr(x, "__dict__"):
            for v in vars(x).values():
                visit(v)

    for op in list(state.ops.values()) + list(state.kron.values()):
        visit(op)
    return total


def one(curvature: str, n_layer: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel
    import gradalg as ga
    from gradalg.exec.local import LocalExecutor
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=768, n_head=12, vocab_size=50257)).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [{"input_ids": torch.randint(0, 50257, (64,), generator=g)} for _ in range(10)]
    task = ga.tasks.causal_lm(model)
    S = ga.methods.influence(task, seqs[:8], seqs[8:], curvature=curvature, layers="all")
    ex = LocalExecutor()
    scores = ex.scores(S.expr)
    passes = []
    for p, st in zip(ex.last_plan.passes, ex.pass_stats):
        est = p.fixed_bytes + p.per_example_bytes * (p.batch_size or 1)
        passes.append({"pass": p.label[:60], "estimate_gb": est / 1e9,
                       "growth_gb": (st["peak_rss_growth_bytes"] or 0) / 1e9, "bound": st["peak_rss_is_bound"],
                       "seconds": st["seconds"]})
    return {"curvature": curvature, "n_layer": n_layer,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
            "held_operator_gb": held_operator_bytes(ex.state) / 1e9, "passes": passes,
            "scores_sum": float(scores.double().sum()), "scores_00": float(scores[0, 0])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--curvature", nargs="*", default=["kfac", "ekfac"])
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        torch.set_num_threads(1)
        print(json.dumps(one(args.curvature[0], args.layers)))
        return
    for c in args.curvature:
        out = subprocess.run([sys.executable, __file__, "--child", "--layers", str(args.layers), "--curvature", c],
                             capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:])
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['curvature']:6s} {r['n_layer']} layers: peak RSS {r['peak_rss_gb']:.2f} GB, held operators "
              f"{r['held_operator_gb']:.3f} GB, scores sum {r['scores_sum']!r}, S[0,0] {r['scores_00']!r}")
        for p in r["passes"]:
            print(f"    {p['pass']:45s} estimate {p['estimate_gb']:.3f} GB, measured growth {p['growth_gb']:.3f} GB"
                  + (" (bound)" if p["bound"] else "") + f", {p['seconds']:.1f} s")


if __name__ == "__main__":
    main()
