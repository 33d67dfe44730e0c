"""Model factories that the Dask workers of tests/test_dask_models.py import by name
("dask_model_factories:mlp"); each counts its calls in the process that runs it."""
from __future__ import annotations

from collections import Counter

import models

CALLS: Counter = Counter()


def mlp(seed=0, hidden=16):
    CALLS["mlp"] += 1
    return models.mlp(hidden=hidden, seed=seed)


def gpt2(seed=0):
    CALLS["gpt2"] += 1
    return models.gpt2(n_layer=2, n_embd=32, seed=seed)


SEED = {"fresh_mlp": 0}


def fresh_mlp():
    """An MLP seeded by this process's ``SEED`` (``set_seed``): a factory whose weights
    change between builds, as an unseeded one's or a rewritten checkpoint's do."""
    CALLS["fresh_mlp"] += 1
    return models.mlp(seed=SEED["fresh_mlp"])


def set_seed(seed: int) -> None:
    SEED["fresh_mlp"] = seed


def calls() -> dict:
    return dict(CALLS)
