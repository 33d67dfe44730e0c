"""Planner benchmark: does the routing pick the faster kernel?

For Grad-Dot scores ``Q @ G.T`` on a GPT-2 built from a config (one transformer layer,
vocabulary 256, random token ids; nothing is downloaded) the planner decides, per layer
block, between

    ghost   ⟨G_i, G_j⟩ = Σ_{t,s} (a_it·a_js)(d_it·d_js) from the factors
    dense   materialize each G_j = D_jᵀA_j (the held queries once), then one GEMM

This script sweeps sequence length T (16 … 1024), number of queries and layer width,
captures the factors once per (width, T), then runs **every alternative** through the
executor's own score kernel (``gradalg.plan.jobs.ScoreAccumulator`` with
``ghost="always"`` / ``"never"``) over the same training chunks, per block, and
compares the measured times with the planner's predicted ranking and its pick
(``gradalg.plan.planner.plan(..., options=ga.options(ghost="auto"))``).

With ``--threads 1`` kernels are timed in process CPU time, which on a shared machine
does not count waiting for a core. Only the part of the pass that differs between the alternatives is timed (the scoring
kernels, including the held side's one-time materialization for "dense"); the capture
forward/backward is shared by both and would only dilute the differences. An
alternative whose predicted time exceeds ``--cap`` seconds is measured on a prefix of
the training rows and scaled linearly (marked ``*``): both kernels are linear in the
number of streamed rows.

A configuration counts as a hit when the planner's pick (its per-block choices) is
within 10 % of the per-block oracle (the fastest measured kernel of every block).

    .venv/bin/python benchmarks/planner.py --threads 1           # 84 configurations, ~8 min here
    .venv/bin/python benchmarks/planner.py --threads 1 --quick   # 6 configurations, ~1 min
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gradalg as ga  # noqa: E402
from gradalg.capture.factors import Factors  # noqa: E402
from gradalg.plan.jobs import ScoreAccumulator  # noqa: E402
from gradalg.capture.chunks import Chunk, flat_block  # noqa: E402
from gradalg.plan.cost import dense_cost, ghost_cost  # noqa: E402
from gradalg.devices import local_profile  # noqa: E402
from gradalg.plan import DecisionKind  # noqa: E402
from gradalg.plan.planner import plan  # noqa: E402

VOCAB = 256
N_TRAIN = 32       # training sequences scored per configuration
CHUNK = 16         # streamed chunk (the pass's batch size)
TOLERANCE = 1.10   # a pick within 10 % of the fastest counts as a hit
CLOCK = time.perf_counter   # time.process_time with one thread (see main)


def lm_loss(model, batch):
    ids = batch[0]
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def build(width: int, T: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=width, n_head=4, vocab_size=VOCAB, n_positions=max(T, 16),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    return ga.Task(model, lm_loss, name=f"gpt2-w{width}")


def rows(chunk: Chunk, start: int, stop: int) -> Chunk:
    return Chunk(chunk.ids[start:stop], {k: v[start:stop] for k, v in chunk.blocks.items()})


def block_chunk(chunk: Chunk, name: str) -> Chunk:
    return Chunk(chunk.ids, {name: chunk.blocks[name]})


def run_kernel(held: Chunk, train: Chunk, space, mode: str, n_rows: int) -> float:
    """Seconds for the scores of ``held`` against the first ``n_rows`` training rows,
    chunk by chunk, with the executor's ScoreAccumulator forced to ``mode``."""
    trace = Counter()
    start = CLOCK()
    kernel = "ghost" if mode == "always" else "dense"
    acc = ScoreAccumulator(held, space, {name: kernel for name in space.names}, trace)
    for a in range(0, n_rows, CHUNK):
        acc.update(rows(train, a, min(a + CHUNK, n_rows)))
    acc.finish()
    seconds = CLOCK() - start
    expect = "ghost" if mode == "always" else "dense"
    assert trace[expect] > 0 and sum(trace.values()) == trace[expect], trace
    return seconds


def _seconds(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def timed(held, train, space, mode, n_rows, min_seconds) -> float:
    """Seconds per run, averaged over as many runs as fill ``min_seconds`` (short kernels
    are repeated so that a scheduler time slice on a busy machine does not dominate)."""
    runs, total = 0, 0.0
    while total < min_seconds or runs == 0:
        total += run_kernel(held, train, space, mode, n_rows)
        runs += 1
    return total / runs


def measure_pair(held, train, space, predicted, cap, reps, min_seconds) -> tuple[dict, dict]:
    """Best of up to ``reps`` interleaved rounds of every alternative (ghost, dense, ghost,
    …), each timed on a prefix of the rows and scaled when its prediction is over ``cap``.
    A kernel that has already run for 2 s in all is not repeated (long runs are steady)."""
    modes = {"ghost": "always", "dense": "never"}
    if not isinstance(next(iter(train.blocks.values())), Factors):
        modes.pop("ghost")
    n_rows = {}
    for name in modes:
        n_rows[name] = N_TRAIN if predicted[name] <= cap else max(1, int(N_TRAIN * cap / predicted[name]))
    best = {name: float("inf") for name in modes}
    spent = {name: 0.0 for name in modes}
    fixed = {name: 0.0 for name in modes}
    for name, mode in modes.items():
        if predicted[name] < 0.5:   # warm-up (allocator, first-call kernel selection) for short kernels
            run_kernel(held, train, space, mode, min(n_rows[name], CHUNK))
        value = next(iter(held.blocks.values()))
        if mode == "never" and n_rows[name] < N_TRAIN and isinstance(value, Factors):
            # "dense" has a one-time part (materializing the held side): scale only the rest
            fixed[name] = min(_seconds(lambda v=value: flat_block(v)) for _ in range(reps))
    for r in range(reps):
        for name, mode in modes.items():
            if r > 0 and spent[name] > 2.0:
                continue
            t = timed(held, train, space, mode, n_rows[name], min_seconds)
            best[name], spent[name] = min(best[name], t), spent[name] + t
    scaled = {name: n_rows[name] < N_TRAIN for name in modes}
    out = {name: fixed[name] + (best[name] - fixed[name]) * N_TRAIN / n_rows[name] if scaled[name] else best[name]
           for name in modes}
    return out, scaled


def predicted_seconds(block, nq, T, prof):
    out_f, in_f = block.shape
    g = ghost_cost(nq, N_TRAIN, T, T, in_f, out_f)
    d = dense_cost(nq, N_TRAIN, T, T, in_f, out_f, left_ready=False)
    return {"ghost": g.seconds(prof), "dense": d.seconds(prof)}


def sweep(widths, lengths, queries, reps, cap, min_seconds, log):
    prof = local_profile()
    results = []
    for width in widths:
        for T in lengths:
            task = build(width, T)
            g = torch.Generator().manual_seed(T + width)
            Xq = torch.randint(1, VOCAB, (max(queries), T), generator=g)
            Xt = torch.randint(1, VOCAB, (N_TRAIN, T), generator=g)
            layers = ["transformer.h.0.*"]
            with ga.options(batch_size=CHUNK, check_reduction=False):
                ex = ga.LocalExecutor()
                Q_all = ga.grads(task, (Xq,), layers)
                G = ga.grads(task, (Xt,), layers)
                t0 = time.perf_counter()
                q_rows = ex.gradients(Q_all.expr)
                t_rows = ex.gradients(G.expr)
                capture_s = time.perf_counter() - t0
            for nq in queries:
                Xq_n = Xq[:nq]
                Q = ga.grads(task, (Xq_n,), layers)
                with ga.options(batch_size=CHUNK, ghost="auto"):
                    p = plan((Q @ G.T).expr)
                held = rows(q_rows, 0, nq)
                row = {"width": width, "T": T, "nq": nq, "capture_s": capture_s, "blocks": []}
                for block in G.space.blocks:
                    try:
                        d = p.decisions.one(DecisionKind.KERNEL, block=block.name)
                        pick, why = d.chosen, "costed"
                    except KeyError:   # no kernel decision (DecisionLookupError is a KeyError)
                        pick, why = "dense", "factors larger than the gradient: kept flat"
                    pred = predicted_seconds(block, nq, T, prof)
                    space = G.select([block.name]).space
                    hb, tb = block_chunk(held, block.name), block_chunk(t_rows, block.name)
                    measured, scaled = measure_pair(hb, tb, space, pred, cap, reps, min_seconds)
                    row["blocks"].append({"name": block.name, "shape": block.shape, "pick": pick, "why": why,
                                          "predicted": pred, "measured": measured, "scaled": scaled})
                results.append(row)
                log(format_row(row))
    return results


def summarize(row):
    ghost = sum(b["measured"]["ghost"] for b in row["blocks"])
    dense = sum(b["measured"]["dense"] for b in row["blocks"])
    pick = sum(b["measured"][b["pick"]] for b in row["blocks"])
    oracle = sum(min(b["measured"].values()) for b in row["blocks"])
    pg = sum(b["predicted"]["ghost"] for b in row["blocks"])
    pd = sum(b["predicted"]["dense"] for b in row["blocks"])
    picks = Counter(b["pick"] for b in row["blocks"])
    label = next(iter(picks)) if len(picks) == 1 else f"mixed {picks['ghost']}g/{picks['dense']}d"
    block_hits = sum(b["measured"][b["pick"]] <= TOLERANCE * min(b["measured"].values()) for b in row["blocks"])
    scaled = any(any(b["scaled"].values()) for b in row["blocks"])
    return dict(ghost=ghost, dense=dense, pick=pick, oracle=oracle, pred_ghost=pg, pred_dense=pd, label=label,
                hit=pick <= TOLERANCE * oracle, ratio=pick / oracle, block_hits=block_hits,
                n_blocks=len(row["blocks"]), scaled=scaled)


HEADER = (f"{'width':>5} {'T':>5} {'nq':>3} | {'ghost ms':>10} {'dense ms':>10} | {'pred ghost':>10} "
          f"{'pred dense':>10} {'predicted':>17} | {'pick':>11} {'pick/best':>9} {'hit':>4}")


def format_row(row) -> str:
    s = summarize(row)
    ranking = "ghost < dense" if s["pred_ghost"] < s["pred_dense"] else "dense < ghost"
    star = "*" if s["scaled"] else " "
    return (f"{row['width']:>5} {row['T']:>5} {row['nq']:>3} | {1e3 * s['ghost']:>9.1f}{star} "
            f"{1e3 * s['dense']:>10.1f} | {1e3 * s['pred_ghost']:>10.1f} {1e3 * s['pred_dense']:>10.1f} "
            f"{ranking:>17} | {s['label']:>11} {s['ratio']:>9.2f} {'yes' if s['hit'] else 'NO':>4}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 6-configuration smoke sweep")
    parser.add_argument("--widths", default=None, help="comma-separated widths (default 64,128,256)")
    parser.add_argument("--lengths", default=None, help="comma-separated T (default 16,32,64,128,256,512,1024)")
    parser.add_argument("--queries", default=None, help="comma-separated query counts (default 1,4,16,32)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per measurement (best is kept)")
    parser.add_argument("--cap", type=float, default=1.0,
                        help="predicted seconds above which a kernel is timed on a prefix and scaled")
    parser.add_argument("--min-seconds", type=float, default=0.05,
                        help="repeat a short kernel until one measurement lasts this long")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    if torch.get_num_threads() == 1:   # CPU time: the work done, not the wait for a busy core
        CLOCK = time.process_time
    widths = (64,) if args.quick else (64, 128, 256)
    lengths = (16, 128, 1024) if args.quick else (16, 32, 64, 128, 256, 512, 1024)
    queries = (1, 32) if args.quick else (1, 4, 16, 32)
    widths = tuple(int(x) for x in args.widths.split(",")) if args.widths else widths
    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else lengths
    queries = tuple(int(x) for x in args.queries.split(",")) if args.queries else queries
    reps = args.reps or (2 if args.quick else 3)

    prof = local_profile()
    print(f"# gradalg planner benchmark — {datetime.datetime.now():%Y-%m-%d %H:%M}")
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; device profile "
          f"{prof.name}: {prof.flops_fp32 / 1e9:.1f} GFLOP/s, {prof.bandwidth / 1e9:.1f} GB/s")
    print(f"# GPT-2 1 layer, vocab {VOCAB}, blocks transformer.h.0.* (c_attn, attn.c_proj, mlp.c_fc, "
          f"mlp.c_proj); {N_TRAIN} training rows in chunks of {CHUNK}; best of up to {reps}; "
          f"times ({'CPU' if CLOCK is time.process_time else 'wall'}) summed over the 4 blocks")
    print(HEADER)
    start = time.perf_counter()
    results = sweep(widths, lengths, queries, reps, args.cap, args.min_seconds, lambda line: print(line, flush=True))
    summaries = [summarize(r) for r in results]
    hits = sum(s["hit"] for s in summaries)
    block_hits = sum(s["block_hits"] for s in summaries)
    n_blocks = sum(s["n_blocks"] for s in summaries)
    rank_ok = sum((s["pred_ghost"] < s["pred_dense"]) == (s["ghost"] < s["dense"]) for s in summaries)
    print(f"\npick within {round((TOLERANCE - 1) * 100)} % of the fastest: {hits}/{len(summaries)} "
          f"configurations ({100 * hits / len(summaries):.0f} %), {block_hits}/{n_blocks} blocks "
          f"({100 * block_hits / n_blocks:.0f} %); predicted ranking of all-ghost vs all-dense right in "
          f"{rank_ok}/{len(summaries)}; worst pick/best {max(s['ratio'] for s in summaries):.2f}; "
          f"{time.perf_counter() - start:.0f} s")
    print("* = timed on a prefix of the training rows and scaled (prediction over --cap seconds)")
    return 0 if hits >= 0.9 * len(summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
