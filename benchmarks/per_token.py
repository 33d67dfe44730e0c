"""Cost of per-token scores against ordinary scores on a GPT-2 config.

    python benchmarks/per_token.py                         # 2 x 64 GPT-2, seq 64, 8 queries x 128 train
    python benchmarks/per_token.py --seq 128 --train 256 --threads 2

Times, interleaved round-robin (a busy machine slows all alike), medians over ``--rounds``:

- ``ordinary``     ``P(Q) @ ga.fisher(P(G)).damp(λ).inv() @ P(G).T``          (query, train)
- ``train_token``  the same with ``P(G.per_token())`` on the right        (query, train, train_token)
- ``query_token``  the same with ``P(Q.per_token())`` on the left         (query, query_token, train)

with a Kronecker projection (k per layer) on the attention and MLP Conv1D layers.
Prints each median and its ratio to ``ordinary`` and checks that the token axes sum
to the ordinary scores (max |difference| relative to max |score|).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import gradalg as ga

LAYERS = ["transformer.h.*.attn.c_*", "transformer.h.*.mlp.c_*"]


def lm_loss(model, batch):
    ids, mask = batch
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum", ignore_index=-100)


def data(n, seq, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    return torch.randint(1, vocab, (n, seq), generator=g) * mask, mask


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--train", type=int, default=128)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--damping", type=float, default=1e-3)
    ap.add_argument("--float64", action="store_true", help="run the model in float64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=args.width, n_head=4, vocab_size=512,
                                       n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=0, eos_token_id=0))
    if args.float64:
        model = model.double()
    task = ga.Task(model, lm_loss, token_mask=lambda b: b[1].bool())
    G = ga.grads(task, data(args.train, args.seq, 512, 1), LAYERS)
    Q = ga.grads(task, data(args.queries, args.seq, 512, 2), LAYERS)
    P = ga.proj.kron(k=args.k)
    H = ga.fisher(P(G)).damp(args.damping).inv()
    exprs = {"ordinary": P(Q) @ H @ P(G).T, "train_token": P(Q) @ H @ P(G.per_token()).T,
             "query_token": P(Q.per_token()) @ H @ P(G).T}
    times = {name: [] for name in exprs}
    results = {}
    for _ in range(args.rounds):
        for name, S in exprs.items():
            start = time.perf_counter()
            results[name] = S.compute()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["ordinary"])
    scale = float(np.abs(results["ordinary"].values).max())
    for name, ts in times.items():
        med = statistics.median(ts)
        extra = ""
        if name != "ordinary":
            axis = name
            err = float(np.abs(results[name].sum(axis).values - results["ordinary"].values).max()) / scale
            extra = f"   sum over {axis}: max rel. difference {err:.1e}"
        print(f"{name:12s} {med:8.3f} s   {med / base:5.2f}x{extra}")


if __name__ == "__main__":
    main()
