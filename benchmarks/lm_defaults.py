"""LM defaults benchmark: every method with its default settings on tutorial 03's setting.

Protocol ("language recovery", tutorials/03_language_models.ipynb): four synthetic
languages over 30 number tokens, x_{t+1} = x_t + s_k (mod 30), s_k ∈ {+1, −1, +7, −7},
random start, 5 % token noise, lengths 8–16 right-padded to 16. A 2-layer GPT-2
(n_embd 64, 4 heads, vocabulary 31, random init) is trained 300 Adam steps (lr 3e-3,
batch 32) on ``--n-train`` sequences (equal per language). For ``--n-query`` fresh
queries, each method scores every training sequence with ``ga.tasks.causal_lm(model)``
on dict items (no glue) and ``layers="transformer.h.*"``; the metric is the share of
the top-10 training sequences in the query's language (chance 0.25), with a 95 %
bootstrap interval over queries. Methods run with their defaults unless a variant says
otherwise (the variants show why a default was chosen).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lm_defaults.py
    ... benchmarks/lm_defaults.py --only trak
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import gradalg as ga

N_NUM, PAD, T_MAX, TOP = 30, 0, 16, 10
STEPS = (+1, -1, +7, -7)
LAYERS = ["transformer.h.*"]


def make_corpus(n_per_lang, seed, noise=0.05):
    """Dict items (input_ids, attention_mask) of unequal length, and each one's language."""
    g = torch.Generator().manual_seed(seed)
    rows, langs = [], []
    for k, step in enumerate(STEPS):
        for _ in range(n_per_lang):
            length = int(torch.randint(8, T_MAX + 1, (1,), generator=g))
            start = int(torch.randint(0, N_NUM, (1,), generator=g))
            seq = (start + step * torch.arange(length)) % N_NUM
            noisy = torch.rand(length, generator=g) < noise
            seq = torch.where(noisy, torch.randint(0, N_NUM, (length,), generator=g), seq)
            rows.append({"input_ids": seq + 1, "attention_mask": torch.ones(length, dtype=torch.long)})
            langs.append(k)
    order = torch.randperm(len(rows), generator=g).tolist()
    return [rows[i] for i in order], np.array(langs)[order]


def train_model(items, steps=300, seed=0):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=N_NUM + 1, n_positions=T_MAX, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=PAD, eos_token_id=PAD)
    model = GPT2LMHeadModel(cfg)
    batch = ga.collate.pad_collate(items)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        b = torch.randint(0, len(items), (32,), generator=g)
        logits = model(input_ids=ids[b], attention_mask=mask[b]).logits[:, :-1]
        targets = ids[b, 1:].masked_fill(mask[b, 1:] == 0, -100)
        tok = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        loss = (tok.sum(1) / mask[b, 1:].sum(1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def recovery(scores, lang, lang_q, rng):
    top = np.argsort(-scores, axis=1)[:, :TOP]
    per_query = (lang[top] == lang_q[:, None]).mean(1)
    boots = [per_query[rng.integers(0, len(per_query), len(per_query))].mean() for _ in range(1000)]
    return per_query.mean(), np.percentile(boots, [2.5, 97.5])


def methods(task, train, queries):
    """(name, lazy scores): defaults first, then the variants behind the choices."""
    m = ga.methods
    yield "grad_dot", m.grad_dot(task, train, queries, layers=LAYERS)
    yield "grad_cos", m.grad_cos(task, train, queries, layers=LAYERS)
    yield "influence (ekfac)", m.influence(task, train, queries, layers=LAYERS, curvature="ekfac")
    yield "influence (kfac)", m.influence(task, train, queries, layers=LAYERS, curvature="kfac")
    yield "influence (datainf)", m.influence(task, train, queries, layers=LAYERS, curvature="datainf")
    yield "logra", m.logra(task, train, queries, layers=LAYERS)
    yield "grass", m.grass(task, train, queries, layers=LAYERS)
    yield "relatif (ekfac)", m.relatif(task, train, queries, layers=LAYERS, curvature="ekfac")
    yield "trak", m.trak(task, train, queries, layers=LAYERS)
    # the variants behind the defaults
    token = ga.tasks.causal_lm(task.model, trak_output="token")
    yield "trak, trak_output='token'", m.trak(token, train, queries, layers=LAYERS)
    yield "trak, damping=1e-6 (old default)", m.trak(task, train, queries, layers=LAYERS, damping=1e-6)
    yield "trak, 'token', damping=1e-6 (old default)", m.trak(token, train, queries, layers=LAYERS, damping=1e-6)
    for r in (0.01, 0.1, 10.0):
        yield f"trak, relative_damping={r:g}", m.trak(task, train, queries, layers=LAYERS, relative_damping=r)
    yield "trak, k=64", m.trak(task, train, queries, layers=LAYERS, k=64)
    yield "trak, k=2048", m.trak(task, train, queries, layers=LAYERS, k=2048)
    yield "logra, k=256", m.logra(task, train, queries, layers=LAYERS, k=256)
    yield "logra, damping=0.1", m.logra(task, train, queries, layers=LAYERS, damping=0.1)
    yield "grass, k=1024", m.grass(task, train, queries, layers=LAYERS, k=1024)
    yield "grass, damping=1e-3 (old default)", m.grass(task, train, queries, layers=LAYERS, damping=1e-3)
    yield "grass, relative_damping=1", m.grass(task, train, queries, layers=LAYERS, relative_damping=1.0)
    yield "influence (ekfac), damping=0.1", m.influence(task, train, queries, layers=LAYERS, curvature="ekfac",
                                                        damping=0.1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-train", type=int, default=256)
    ap.add_argument("--n-query", type=int, default=40)
    ap.add_argument("--only", default=None, help="run the methods whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ga.options(progress=False)
    train, lang = make_corpus(args.n_train // 4, seed=0)
    queries, lang_q = make_corpus(args.n_query // 4, seed=1)
    t0 = time.perf_counter()
    model = train_model(train)
    task = ga.tasks.causal_lm(model, name="tiny-gpt2")
    print(f"n_train={len(train)} n_query={len(queries)}; trained in {time.perf_counter() - t0:.0f} s; "
          f"metric: top-{TOP} in the query's language (chance 0.25)")
    print(f"| method | top-{TOP} same language | 95% CI | seconds |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, S in methods(task, train, queries):
        if args.only and args.only not in name:
            continue
        t = time.perf_counter()
        try:
            values = S.compute().values
        except Exception as err:  # noqa: BLE001 - the table says why
            print(f"| {name} | failed: {type(err).__name__}: {str(err)[:80]} | | |")
            continue
        mean, (lo, hi) = recovery(values, lang, lang_q, rng)
        print(f"| {name} | {mean:.3f} | [{lo:.2f}, {hi:.2f}] | {time.perf_counter() - t:.1f} |", flush=True)


if __name__ == "__main__":
    main()
