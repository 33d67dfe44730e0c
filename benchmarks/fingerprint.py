"""Cost of stable identities (gradalg.fingerprint): what hashing models, tensors and
datasets adds, cold (first time) and warm (cached per tensor version).

Model (built from a config, random weights, nothing downloaded)::

    GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=128)   # ~3.4 M params

Measured side by side in one process (median over ``--rounds``):

    cold model digest     model_digest(model) after forget(): every weight hashed once
    warm task token       task.token: a version check per tensor, functions re-fingerprinted
    TensorDataset wrap    ga.grads(task, (X, y)) building its DataRef (tensors cached)
    list dataset wrap     ga.grads(task, list_dataset): the dataset's pickle hashed (no cache)
    forward+backward      one plain training step on a batch of 32 (the unit of comparison)

    .venv/bin/python benchmarks/fingerprint.py --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import gradalg as ga
from gradalg import fingerprint


class ListDataset(Dataset):
    def __init__(self, X):
        self.items = [X[i] for i in range(len(X))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _time(fn, rounds):
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=4096, help="sequences in the datasets")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=128))
    n_params = sum(p.numel() for p in model.parameters())

    def loss(m, batch):
        (ids,) = batch if isinstance(batch, (tuple, list)) else (batch,)
        logits = m(ids).logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")

    task = ga.Task(model, loss)
    X = torch.randint(0, 1024, (args.n, 128))
    listed = ListDataset(X)
    batch = X[:32]

    def cold():
        fingerprint.forget()
        fingerprint.model_digest(model)

    def step():
        model.zero_grad()
        loss(model, (batch,)).backward()

    rows = [("cold model digest", _time(cold, args.rounds)),
            ("warm task token", _time(lambda: task.token, args.rounds)),
            ("TensorDataset wrap", _time(lambda: ga.grads(task, (X,)), args.rounds)),
            ("list dataset wrap", _time(lambda: ga.grads(task, listed), args.rounds)),
            ("forward+backward", _time(step, args.rounds))]
    unit = rows[-1][1]
    print(f"model: {n_params / 1e6:.1f} M parameters ({n_params * 4 / 2**20:.0f} MiB); data: {args.n} × 128 tokens")
    print(f"{'operation':<22}{'seconds':>12}{'× one step':>12}")
    for name, t in rows:
        print(f"{name:<22}{t:>12.5f}{t / unit:>12.3f}")


if __name__ == "__main__":
    main()
