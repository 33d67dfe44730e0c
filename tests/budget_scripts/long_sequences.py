"""Run one long-sequence budget case in this (fresh) process; print its peak memory as JSON.

    python long_sequences.py CASE[,CASE...] BUDGET_BYTES T

As ``peak_memory.py`` (whose baseline and peak helpers it uses): the model, the data
and a warm-up on one short sequence come first; ``peak_growth`` is the peak resident
memory above them while the case runs (each case
measured from its own baseline) under ``ga.options(memory_budget=BUDGET_BYTES)``.
Cases: a tiny GPT-2 (SDPA attention, float32) on sequences of T tokens, with

``ghost``  Grad-Dot with the ghost kernel forced: Σ_{t,s} over T² pairs of positions
           per pair of examples, in pairs of token blocks (``token_block``);
``kfac``   K-FAC influence: statistics and rotations one token block at a time.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from peak_memory import current_rss, peak_rss, reset_peak  # noqa: E402
from models import lm_loss  # noqa: E402

import gradalg as ga  # noqa: E402

VOCAB = 53
LAYERS = ["transformer.h.*.attn.c_attn", "transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"]


def build(T: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=T, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     tie_word_embeddings=False, activation_function="relu")
    cfg._attn_implementation = "sdpa"           # memory linear in T (no (T, T) attention matrix kept)
    model = GPT2LMHeadModel(cfg).eval()
    return ga.Task(model, lm_loss, token_mask=lambda b: b[1].bool())


def data(n: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, T), generator=g)
    return ids, torch.ones_like(ids)


def expression(case, task, train, queries):
    Q, G = ga.grads(task, queries, layers=LAYERS), ga.grads(task, train, layers=LAYERS)
    if case == "ghost":
        return Q @ G.T
    return Q @ ga.kfac(G).damp(1e-3).inv() @ G.T


BLOCK = int(os.environ.get("TOKEN_BLOCK", 256))
OPTIONS = {"ghost": dict(ghost="always", ghost_slice_elements=2**18, token_block=BLOCK),
           "kfac": dict(token_block=BLOCK)}


def main():
    cases, budget, T = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    task = build(T)
    train, queries = data(6, T, 1), data(2, T, 2)
    short = data(2, 16, 3)
    ga.devices.local_profile()
    for case in cases:       # one process for all cases (imports and the profile once), each measured alone
        with ga.options(progress=False, **OPTIONS[case]):
            expression(case, task, short, short).compute()          # warm-up: imports, kernels
        gc.collect()
        reset_peak()
        base = current_rss()
        with ga.options(progress=False, memory_budget=budget, **OPTIONS[case]):
            S = expression(case, task, train, queries)
            ex = ga.exec.LocalExecutor()
            plan = ex.plan(S.expr)
            values = torch.as_tensor(S.compute(executor=ex).values)
        print(json.dumps({"case": case, "T": T, "budget": budget, "peak_growth": peak_rss() - base,
                          "estimated": plan.peak_bytes, "finite": bool(torch.isfinite(values).all()),
                          "batch_sizes": [p.batch_size for p in ex.last_plan.passes]}))
        del S, ex, plan, values
        gc.collect()


if __name__ == "__main__":
    main()
