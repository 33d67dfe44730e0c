"""Peak resident memory of ``S.topk(10)`` over N_TRAIN training rows, in this fresh process.

    python topk_memory.py N_TRAIN [N_QUERY]

Grad-Dot of projected gradients (k=32) of a small MLP, N_QUERY queries (default
1,000), float32, batches of 128. The model, the data (wrapped by ga.grads) and a
warm-up top-k over 256 rows come first; the kernel's peak mark (VmHWM) is reset there,
and ``peak_growth`` is the peak above the resident memory at that point. The full
(N_QUERY × N_TRAIN) float32 matrix would be 4·N_QUERY·N_TRAIN bytes.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from peak_memory import current_rss, peak_rss, reset_peak  # noqa: E402

import gradalg as ga  # noqa: E402

def main(n: int, n_query: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    task = ga.tasks.classification(model)
    X, y = torch.randn(n, 32), torch.randint(0, 10, (n,))
    Xq, yq = torch.randn(n_query, 32), torch.randint(0, 10, (n_query,))
    P = ga.proj.gaussian(32, seed=1)
    Q = P(ga.grads(task, (Xq, yq)))

    def scores(m):
        return Q @ P(ga.grads(task, (X[:m], y[:m]))).T

    with ga.options(progress=False, batch_size=128, check_reduction=False):
        scores(256).topk(10)
        S = scores(n)             # the data wrapped, ids listed: the data's cost, not the top-k's
        base = current_rss()
        reset_peak()
        top = S.topk(10)
        peak = peak_rss()
    assert top.shape == (n_query, 10)
    print(json.dumps({"n_train": n, "n_query": n_query, "peak_growth": peak - base}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
