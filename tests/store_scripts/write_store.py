"""Writes a projected gradient store (``python write_store.py PATH``), for the kill-and-resume
test in tests/test_store.py. Set ``GRADALG_STORE_TEST_DELAY`` to slow each chunk down.

``build()`` gives the same GradientSet in every process (seeded model and data), so a
store begun here can be finished, or compared, elsewhere.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import gradalg as ga  # noqa: E402
from models import classification_data, mlp  # noqa: E402

N, CHUNK_ROWS = 48, 4


def build():
    model = mlp(d_in=8, hidden=16, classes=3, dtype=torch.float32, seed=0)
    X, y = classification_data(n=N, d_in=8, classes=3, dtype=torch.float32, seed=1)
    task = ga.tasks.classification(model)
    G = ga.grads(task, (X, y), layers=["0", "2"], ids=[f"ex{i}" for i in range(N)])
    return ga.proj.kron(k=6, seed=3)(G)


if __name__ == "__main__":
    torch.set_num_threads(1)
    ga.store.write(build(), sys.argv[1], chunk_rows=CHUNK_ROWS)
    print("finished", flush=True)
