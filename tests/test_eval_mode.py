"""``gradalg.eval_mode``: every place gradalg runs a user's model in eval mode puts each
module's own ``training`` flag back after, so a batch norm the user froze in a model
trained in train mode (``model.train(); model.bn.eval()``) stays frozen. ``model.train(was)``
set it back to train mode: the user's next step moved the statistics they had frozen.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradalg as ga
from gradalg.eval_mode import eval_mode


def _frozen_norm_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Dropout(0.3), nn.Linear(5, 2)).double()
    model.train()
    model[1].eval()            # fine-tuning with a frozen batch norm
    return model


def _modes(model):
    return [m.training for m in model.modules()]


def test_eval_mode_puts_each_modules_flag_back_after_an_error():
    model = _frozen_norm_model()
    before = _modes(model)
    with pytest.raises(KeyError):
        with eval_mode(model) as inside:
            assert inside is model and not any(_modes(model))
            raise KeyError("inside")
    assert _modes(model) == before == [True, True, False, True, True]


def test_grads_leave_a_frozen_batch_norm_frozen_and_its_statistics_unchanged():
    """``ga.grads`` (its capture pass, the loss-reduction check) and a training step after
    it: the frozen norm's running statistics do not move, and the gradients are those of
    the model in eval mode (the loop of backward)."""
    model = _frozen_norm_model()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 2, (6,))
    G = ga.grads(ga.tasks.classification(model), (X, y), layers=["0", "3"]).to_dense()   # {block: (n, out, in + 1)}
    assert _modes(model) == [True, True, False, True, True]
    stats = model[1].running_mean.clone()
    model(X).sum().backward()                 # the user's next training step's forward
    assert torch.equal(model[1].running_mean, stats)
    with eval_mode(model):
        rows = {"0": [], "3": []}
        for i in range(6):
            model.zero_grad()
            nn.functional.cross_entropy(model(X[i:i + 1]), y[i:i + 1], reduction="sum").backward()
            for name in rows:   # the bias as the last input column
                layer = model[int(name)]
                rows[name].append(torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1))
    for name, expected in rows.items():
        torch.testing.assert_close(G[name], torch.stack(expected), rtol=1e-9, atol=1e-12)
