"""Low-rank query gradients: exact scores vs rank-r held queries (``query_gradient_rank=``).

Model (built from a config, random weights, nothing downloaded)::

    GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=128,
               resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)

Data: random token ids, T = 128; ``--n-train`` training sequences (256), ``--n-query``
queries (64); batches of 32. Attributed layers: the Conv1D blocks of ``transformer.h.*``
(c_attn 768×257, attn.c_proj 256×257, mlp.c_fc 1024×257, mlp.c_proj 256×1025; 16 blocks).

Methods (``--method``): ``grad_dot`` (``ga.methods.grad_dot``; held queries are factors
T·(in + out) exactly) or ``ekfac`` (``ga.methods.influence(curvature="ekfac")``: the held
queries are H⁻¹q, dense out·in per block exactly). For each of exact and ranks 1, 4, 16,
64 (``--ranks``), in one process, one after the other: the wall and CPU seconds of
``.compute()`` (query pass with the SVDs, training pass(es), scoring; planning included),
the bytes of the held query side at rest (``rows_bytes`` of the scores job's held rows:
r·(out + in) per row and truncated block) and while scoring (:func:`held_bytes`), the kernels run (ghost / dense block
products, the executor's trace), and the Spearman correlation with the exact scores, over
all (query, train) pairs and the mean over queries of each query's ranking of the training set.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lowrank_queries.py            # ~3 min here
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lowrank_queries.py --n-train 64 --n-query 16
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gradalg as ga  # noqa: E402
from gradalg.expr import Identity  # noqa: E402
from gradalg.plan.jobs import ScoresJob  # noqa: E402
from gradalg.plan.memory import rows_bytes  # noqa: E402
from gradalg.plan.shapes import ModelFacts  # noqa: E402

T, BATCH, VOCAB = 128, 32, 2048
LAYERS = ["transformer.h.*"]


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=T, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def lm_loss(model, batch):
    ids = batch[0]
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def sampled_loss(model, batch, rng):
    """Loss at labels drawn from the model's own predictions (the Gauss-Newton curvature's
    sampled objective, for EK-FAC); ``rng``: gradalg's per-example random numbers."""
    ids = batch[0]
    logits = model(input_ids=ids).logits[:, :-1]
    with torch.no_grad():
        labels = rng.sample(logits.softmax(-1))
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's ρ of two vectors (ranks by argsort; ties have measure zero here)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def expression(method, task, X, XQ, rank):
    if method == "grad_dot":
        return ga.methods.grad_dot(task, (X,), (XQ,), layers=LAYERS, query_gradient_rank=rank)
    return ga.methods.influence(task, (X,), (XQ,), layers=LAYERS, curvature="ekfac", query_gradient_rank=rank)


def run(method, task, X, XQ, rank):
    S = expression(method, task, X, XQ, rank)
    gc.collect()
    with ga.options(batch_size=BATCH, progress=False):
        ex = ga.LocalExecutor()
        start, cpu = time.perf_counter(), time.process_time()
        values = np.asarray(S.compute(ex).values)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    job = next(j for j in ex.last_plan.jobs.values() if isinstance(j, ScoresJob))
    return values, wall, cpu, held_bytes(job), {k: v for k, v in ex.trace.items() if k in ("ghost", "dense")}


def held_bytes(job: ScoresJob, elem: int = 4) -> tuple[float, float]:
    """(at rest, while scoring) bytes of the held query side. At rest: the collected rows
    in their storage (factors or flat). While scoring, added: the rows preconditioned in
    the scores sink, dense n·dim (an exact influence: ``Q`` is held, ``H⁻¹Q`` formed there),
    and the factored held blocks the dense kernel materializes once (n·out·in each)."""
    rest = rows_bytes(job.held, job.held_storage, ModelFacts(dtype=torch.float32))   # token rows: T from the data
    n = job.held.n
    if not isinstance(job.target.op, Identity):
        return rest, rest + n * job.held.space.dim * elem
    extra = sum(n * b.dim * elem for b in job.held.space.blocks
                if job.held_storage.get(b.name) == "factors" and job.kernels.get(b.name) != "ghost")
    return rest, rest + extra


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", choices=("grad_dot", "ekfac"), default="grad_dot")
    ap.add_argument("--n-train", type=int, default=256)
    ap.add_argument("--n-query", type=int, default=64)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 16, 64])
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = build_model()
    task = ga.Task(model, lm_loss, sampled_loss=sampled_loss, name="gpt2-4x256")
    g = torch.Generator().manual_seed(0)
    X = torch.randint(0, VOCAB, (args.n_train, T), generator=g)
    XQ = torch.randint(0, VOCAB, (args.n_query, T), generator=g)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.2f}")
    print(f"# {args.method}: GPT-2 4×256 (vocab {VOCAB}), T={T}, {args.n_train} train × {args.n_query} queries, "
          f"layers {LAYERS}")
    exact, *base = run(args.method, task, X, XQ, None)
    rows = [("exact", exact, *base)]
    for r in args.ranks:
        rows.append((f"rank {r}", *run(args.method, task, X, XQ, r)))
    print("| query side | wall s | CPU s | held queries at rest | held while scoring | kernels (block products) "
          "| Spearman (all pairs) | Spearman (mean per query) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, values, wall, cpu, (rest, scoring), kernels in rows:
        overall = spearman(values.ravel(), exact.ravel())
        per_query = np.mean([spearman(values[q], exact[q]) for q in range(values.shape[0])])
        ks = ", ".join(f"{k} {v}" for k, v in sorted(kernels.items()))
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {rest / 2**20:.1f} MiB | {scoring / 2**20:.1f} MiB | {ks} "
              f"| {overall:.4f} | {per_query:.4f} |")
    print(f"# load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
