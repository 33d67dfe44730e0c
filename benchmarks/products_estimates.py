"""Are products passes (HVP / Gauss-Newton products for CG, LiSSA, Arnoldi) priced true?
Measured against estimated seconds per call, old pricing against new.

Each workload runs ``influence(..., solver="cg")`` (Gauss-Newton products) and
``influence(..., curvature="hessian", solver="lissa")`` (Hessian products) for a few
iterations with ``Scores.explain(analyze=True)``, which plans, runs the plan and measures
the products pass over every call of its solver; one call is compared with one estimated
call (the plan's estimate is for the solver's bound on the calls). Columns: estimated
seconds per call before this pricing (``old``: the work at its plain-op price, a module
call per leaf module and primal sweep, a captured batch's fixed cost per batch), now
(``new``: the device profile's measured ``product_work`` and ``product_seconds``,
:mod:`gradalg.plan.jobs.products`), measured CPU seconds per call (one thread: this
process's work without the waits for a core a shared machine causes) and wall seconds,
and measured / estimated for both. A warm-up run per workload first (torch.func's first
call in a process loads its machinery, once), but GPT-2 small (its calls take seconds).

Workloads: **mlp** (64 → 256 → 256 → 10, 256 examples), **cnn** (``tests/models.cnn``,
128 images), **gpt2-4l** (GPT-2 4 × 256, vocabulary 2,048, T = 64, 16 sequences,
``ga.tasks.causal_lm``: the block linears), **gpt2-small** (12 × 768, vocabulary 50,257,
tied head, random init, 4 sequences of 64 tokens; about 5 GB: run it under the machine's
memory lock). Batches of 32.

    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/products_estimates.py --workloads mlp,cnn,gpt2-4l
    flock /work/bigmem.lock env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/products_estimates.py --workloads gpt2-small
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import gradalg as ga  # noqa: E402
from gradalg import devices  # noqa: E402
from gradalg.plan.cost import Cost, data_tokens_hint  # noqa: E402
from gradalg.plan.estimates import _leaf_modules  # noqa: E402
from gradalg.plan.jobs.products import PRODUCT_SWEEPS, product_work  # noqa: E402

BATCH = 32


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).eval()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    return ga.tasks.classification(model), (X, y), (X[:2], y[:2])


def cnn():
    import models
    model = models.cnn(dtype=torch.float32)
    X, y = models.image_data(n=128, dtype=torch.float32)
    return ga.tasks.classification(model), (X, y), (X[:2], y[:2])


def gpt2(n_layer: int, width: int, vocab: int, n: int, T: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layer, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab)
    config._attn_implementation = "eager"      # torch.func's forward AD has no rule for the fused attention
    model = GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(0)
    return (ga.tasks.causal_lm(model), {"input_ids": torch.randint(0, vocab, (n, T), generator=g)},
            {"input_ids": torch.randint(0, vocab, (2, T), generator=g)})


WORKLOADS = {"mlp": mlp, "cnn": cnn, "gpt2-4l": lambda: gpt2(4, 256, 2048, 16),
             "gpt2-small": lambda: gpt2(12, 768, 50257, 4)}


def old_estimate(job, prof) -> float:
    """One call as priced before the products were calibrated: the work at its plain-op
    price, a module call per leaf module and primal sweep, a captured batch per batch."""
    t = job.target
    B = max(1, min(job.batch, t.data.n))
    batches = -(-t.data.n // B)
    work = product_work(t.task.model, B, data_tokens_hint(t.data), job.vectors, t.kind, t.space.dim, 4)
    fixed = Cost(calls=batches * _leaf_modules(t.task.model) * PRODUCT_SWEEPS[t.kind][0], batches=batches)
    return prof.time_of(work.scaled(batches) + fixed)


def run(name, iters: int, log) -> list[dict]:
    task, train, queries = WORKLOADS[name]()
    settings = {"cg": dict(curvature="gauss_newton", solver="cg", solver_settings={"max_iter": iters}),
                "lissa": dict(curvature="hessian", solver="lissa", solver_settings={"depth": iters, "scale": 1e4})}
    rows = []
    for key, kw in settings.items():
        with ga.options(batch_size=BATCH, progress=False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            explained = ga.methods.influence(task, train, queries, damping=0.1, **kw).explain(analyze=True)
        prof = explained.plan.device
        for i, row in enumerate(explained.passes()):
            if "measured_calls" not in row:
                continue
            job = explained.plan.passes[i].jobs[0]
            calls = row["measured_calls"]
            cpu, wall = row.get("measured_cpu_seconds", row["measured_seconds"]) / calls, row["measured_seconds"] / calls
            old, new = old_estimate(job, prof), row["estimated_call_seconds"]
            entry = dict(workload=name, solver=key, kind=job.target.kind, vectors=job.vectors, calls=calls,
                         old=old, new=new, cpu=cpu, wall=wall)
            rows.append(entry)
            log(f"{name:10s} {key:5s} {job.target.kind:12s} m={job.vectors} calls={calls:2d}  old {old:8.4f}  "
                f"new {new:8.4f}  cpu {cpu:8.4f}  wall {wall:8.4f}  cpu/old {cpu / old:6.2f}  cpu/new {cpu / new:5.2f}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,cnn,gpt2-4l")
    parser.add_argument("--iters", type=int, default=3, help="CG max_iter / LiSSA depth: calls of the pass")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prof = devices.local_profile()
    load0 = os.getloadavg()[0]
    print(f"# products passes, estimated vs measured per call; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); load average {load0:.2f}")
    print(f"# {prof.calibration()}")
    rows = []
    for name in args.workloads.split(","):
        if name != "gpt2-small":                     # one run only there: a call takes seconds
            run(name, 1, lambda s: None)             # warm-up: torch.func's first call, allocator
        rows += run(name, args.iters, lambda s: print(s, flush=True))
    worst = max(rows, key=lambda r: max(r["cpu"] / r["new"], r["new"] / r["cpu"]))
    print(f"\nsummary: {len(rows)} passes; new within [0.5, 2]: {sum(0.5 <= r['cpu'] / r['new'] <= 2 for r in rows)}, "
          f"old: {sum(0.5 <= r['cpu'] / r['old'] <= 2 for r in rows)}; worst new {worst['cpu'] / worst['new']:.2f} "
          f"({worst['workload']} {worst['solver']}); load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
