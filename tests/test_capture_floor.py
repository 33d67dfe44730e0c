"""The capture pass does only the work attribution needs (issue 28, item 7).

While a batch is recorded, parameters outside the recorded blocks stop requiring grad
(``ForwardRecorder(model=...)``, ``released_params``): the numbers stay those of the
torch.func oracle, the flags are restored, and wrapped or compiled models are left alone.
The sum/mean check reuses the capture's own forward of a batch of 2 to 4 examples.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga
from gradalg.capture.hooks import ForwardRecorder, released_params, resolve_layers
from models import classification_data, gpt2, lm_task, mlp, padded_token_data
from test_capture import assert_params_close

BLOCKS = ["transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_proj", "transformer.h.1.attn.c_proj"]


def _flags_seen_by(module: nn.Module, seen: list):
    return module.register_forward_pre_hook(lambda m, args: seen.append(m.weight.requires_grad))


@pytest.mark.parametrize("tied", [False, True])
def test_parameters_outside_the_blocks_are_released_during_capture(tied):
    model = gpt2(tied=tied)
    ids, mask = padded_token_data(n=6)
    task = lm_task(model)
    layers = BLOCKS + (["lm_head"] if tied else [])
    seen: list = []
    handle = _flags_seen_by(model.transformer.wte, seen)
    try:
        with ga.options(check_reduction=False):      # its forwards run outside the recorder
            captured = ga.grads(task, (ids, mask), layers=layers, batch_size=3).to_params()
    finally:
        handle.remove()
    # an untied embedding below the first block is released; the one a recorded head is tied to is kept
    assert len(seen) == 2 and all(flag == tied for flag in seen)
    assert all(p.requires_grad for p in model.parameters())           # restored
    reference = ga.per_example_grads(task, (ids, mask), list(captured), method="loop")
    assert_params_close(captured, reference, 1e-5)


def test_user_frozen_parameters_stay_frozen():
    model = gpt2()
    model.transformer.wte.weight.requires_grad_(False)
    model.transformer.ln_f.weight.requires_grad_(False)
    ids, mask = padded_token_data(n=4)
    ga.grads(lm_task(model), (ids, mask), layers=BLOCKS, batch_size=2).to_dense()
    assert not model.transformer.wte.weight.requires_grad and not model.transformer.ln_f.weight.requires_grad
    assert model.transformer.ln_f.bias.requires_grad and model.lm_head.weight.requires_grad


def test_released_params_keep_the_blocks_and_skip_wrapped_models():
    model = gpt2(tied=True)
    refs = resolve_layers(model, ["lm_head", "transformer.ln_f"])
    released = {id(p) for p in released_params(model, refs)}
    kept = [model.lm_head.weight, model.transformer.wte.weight, model.transformer.ln_f.weight,
            model.transformer.ln_f.bias]
    assert not any(id(p) in released for p in kept)
    assert id(model.transformer.h[0].attn.c_attn.weight) in released
    assert released_params(nn.DataParallel(model), refs) == []
    assert released_params(torch.compile(model), refs) == []
    with ForwardRecorder(refs, model=nn.DataParallel(model)):
        assert all(p.requires_grad for p in model.parameters())


def test_recorder_restores_the_flags_after_an_error():
    model = mlp()
    refs = resolve_layers(model, ["2"])
    with pytest.raises(RuntimeError, match="boom"):
        with ForwardRecorder(refs, model=model):
            assert not model[0].weight.requires_grad and model[2].weight.requires_grad
            raise RuntimeError("boom")
    assert all(p.requires_grad for p in model.parameters())


class Forwards(nn.Module):
    """Counts the calls of the model it wraps."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, x):
        self.calls += 1
        return self.model(x)


def test_reduction_check_reuses_the_capture_forward():
    counted = Forwards(mlp())
    x, y = classification_data(n=8)
    task = ga.tasks.classification(counted)
    ga.grads(task, (x, y), layers=["model.0"], batch_size=4).to_dense()
    assert counted.calls == 2 + 2             # two batches, then L(first) and L(rest): L(batch) is reused
    counted.calls = 0
    with ga.options(check_reduction=False):
        ga.grads(ga.tasks.classification(counted), (x, y), layers=["model.2"], batch_size=4).to_dense()
    assert counted.calls == 2


@pytest.mark.parametrize("batch_size", [2, 4])
def test_mean_loss_is_refused_with_the_reused_forward_and_the_fix_works(batch_size):
    model = mlp()
    x, y = classification_data(n=8)
    mean = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    with pytest.raises(ga.LossReductionError, match="reduction='sum'"):
        ga.grads(mean, (x, y), layers=["0"], batch_size=batch_size).to_dense()
    fixed = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), reduction="mean")
    summed = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum"))
    torch.testing.assert_close(ga.grads(fixed, (x, y), layers=["0"], batch_size=batch_size).to_dense(),
                               ga.grads(summed, (x, y), layers=["0"], batch_size=batch_size).to_dense())


def test_reduction_check_of_one_example_reuses_its_capture_forward():
    """A first batch of one example (a single query) is both parts of the check: it adds
    the forward of the doubled batch only (before: the doubled batch, then the example twice)."""
    counted = Forwards(mlp())
    x, y = classification_data(n=3)
    ga.grads(ga.tasks.classification(counted), (x[:1], y[:1]), layers=["model.0"]).to_dense()
    assert counted.calls == 1 + 1             # the capture's forward, then L([x, x])
    counted.calls = 0
    ga.grads(ga.tasks.classification(counted), (x, y), layers=["model.0"], batch_size=1).to_dense()
    assert counted.calls == 3 + 1


@pytest.mark.parametrize("known", [False, True])
def test_one_example_check_forwards_and_verdicts(known):
    """``Task.check_reduction`` on one example: the doubled batch and (without the capture's
    loss) the example once; a mean declared a sum is still refused, the sum and the declared
    mean pass."""
    counted = Forwards(mlp())
    x, y = classification_data(n=1)

    def loss(reduction):
        return lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction=reduction)

    for fn, declared, refused in ((loss("sum"), "sum", False), (loss("mean"), "sum", True),
                                  (loss("mean"), "mean", False)):
        task = ga.Task(counted, fn, reduction=declared)
        with torch.no_grad():
            full = float(task.summed_loss(counted, (x, y))) if known else None
        counted.calls = 0
        if refused:
            with pytest.raises(ga.LossReductionError, match="reduction='sum'"):
                task.check_reduction((x, y), full_loss=full)
        else:
            task.check_reduction((x, y), full_loss=full)
        assert counted.calls == (1 if known else 2)
