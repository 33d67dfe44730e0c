"""Real checkpoints at their defaults: every zoo architecture as its config class builds
it (tied embeddings and head kept: BERT's decoder, T5's and BART's shared embedding,
GPT-2's and Gemma's LM head), with the ``ga.tasks`` task of its head, at default layers and
``layers="all"``, against a loop of ``torch.autograd.grad`` over each item alone; and
``layers="all"`` checked against ``model.named_parameters()`` (no parameter missing or
doubled)."""
from __future__ import annotations

import pytest
import torch

import gradalg as ga
from gradalg.capture.hooks import POSITION_EMBEDDINGS
from references import one_thread  # noqa: F401 - fixture
from zoo import STOCK_TASKS, ZOO, stock, stock_items, stock_oracle, worst_relative_error

ARCHS = list(ZOO) + ["bart"]
TOL = 1e-9


def _position_parameter(name: str) -> bool:
    return any(f".{p}." in f".{name}" for p in POSITION_EMBEDDINGS)


@pytest.mark.parametrize("layers", [None, "all"])
@pytest.mark.parametrize("arch", ARCHS)
def test_stock_checkpoint_matches_loop_reference(arch, layers):
    model, task = stock(arch)
    items = stock_items(arch)
    captured = ga.grads(task, items, layers=layers, batch_size=3).to_params()
    reference = stock_oracle(model, items, STOCK_TASKS.get(arch, "causal_lm"), list(captured))
    err, where = worst_relative_error(captured, reference)
    assert err <= TOL, f"{arch} layers={layers}: worst relative error {err:.2e} at {where}"
    if layers == "all":
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        ids = [id(model.get_parameter(n)) for n in captured]
        assert len(ids) == len(set(ids)), f"{arch}: a parameter is captured twice"
        missing = trainable - set(captured)
        assert all(_position_parameter(n) for n in missing), f"{arch}: layers='all' misses {sorted(missing)}"
