"""The layer registry (``gradalg.capture.layers``): one entry per module type answers both
capture (block shape, factors) and the planner's model facts (forward GEMMs, activations,
output width, measured positions).

A toy layer type defined here, outside the package, is registered with one decorator; hook
capture must then record it as a factored block (checked number by number against the
torch.func oracle) and the planner must count its GEMM, activations and positions.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import ClassVar

sys.path.insert(0, os.path.dirname(__file__))

import pytest
import torch
from torch import nn

import gradalg as ga
from gradalg.capture import layers as L
from gradalg.plan import estimates as E
from gradalg.plan import shapes as S
from models import classification_data


class Toy(nn.Module):
    """``y = x Wᵀ``, W (out, in), no bias: a Linear that torch does not know as one."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in, dtype=torch.float64) / n_in ** 0.5)

    def forward(self, x):
        return x @ self.weight.T


@dataclass(frozen=True)
class ToyRule(L.LayerRule):
    """The toy's factors: A = its inputs (B, T, in), D = its output gradients (B, T, out)."""

    kind: str = "toy"
    measured_kinds: ClassVar[tuple[str, ...]] = ("toy",)

    def block_shape(self, module):
        return tuple(module.weight.shape)

    def activations(self, module, x):
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def output_grads(self, module, g):
        return g.reshape(g.shape[0], -1, g.shape[-1])

    def to_params(self, module, block):
        return {"weight": block}

    def from_params(self, module, params):
        return params["weight"]

    def weight_gemm(self, module):
        return module.weight.shape[1], module.weight.shape[0]


@pytest.fixture
def toy_registered():
    L.register_layer(Toy)(ToyRule)
    try:
        yield
    finally:
        L.LAYER_RULES.pop(Toy)


def toy_model():
    torch.manual_seed(0)
    return nn.Sequential(Toy(8, 6), nn.Tanh(), nn.Linear(6, 3).double())


def test_unregistered_toy_is_replayed_not_default():
    model = toy_model()
    assert isinstance(L.rule_for("0", model[0]), L.ReplayRule)        # nn.Module's entry
    assert S.weight_layers(model) == [(6, 3)]                          # no GEMM known for it
    G = ga.grads(ga.tasks.classification(model), classification_data(n=6))
    assert [b.name for b in G.space.blocks] == ["2"]                   # replay: layers="all" only


def test_registered_toy_is_captured(toy_registered):
    model = toy_model()
    x, y = classification_data(n=10, d_in=8)
    task = ga.tasks.classification(model)
    G = ga.grads(task, (x, y), batch_size=4)
    assert [(b.name, b.kind, tuple(b.shape)) for b in G.space.blocks] == [("0", "toy", (6, 8)), ("2", "linear", (3, 7))]
    captured = G.to_params()
    reference = ga.per_example_grads(task, (x, y), list(captured), method="vmap")
    for name, ref in reference.items():
        torch.testing.assert_close(captured[name], ref, rtol=1e-9, atol=1e-12)


def test_registered_toy_is_planned(toy_registered):
    model = toy_model()
    x, y = classification_data(n=10, d_in=8)
    G = ga.grads(ga.tasks.classification(model), (x, y))
    # the planner's model facts: its GEMM, its activations (in + out per position), its width
    assert S.weight_layers(model) == [(8, 6), (6, 3)]
    assert S.activation_bytes(model, 1, 8) == 8.0 * ((6 + 8) + (3 + 6))
    assert S.output_width(model) == 3
    with ga.options(batch_size=10, check_reduction=False) as opts:
        cost = E.capture_cost(G.expr, opts, torch.float64)
    assert (10, 6, 8, 1, 8) in cost.gemms and (10, 8, 6, 1, 8) in cost.gemms   # forward, input gradient
    # its positions are its own (as a convolution's): measured before a run
    assert L.measured_kind("toy") and not L.measured_kind("linear")
    assert "0" in str(G.explain())


def test_registry_answers_which_submodules_cannot_be_recorded_alone():
    """``uses_without_calling`` (nn.MultiheadAttention's out_proj, applied with F.linear):
    left out of the defaults, refused by name with the fix; ``batch_shared``: position
    embeddings left out of the defaults."""
    from gradalg.capture.hooks import resolve_layers
    from gradalg.errors import UnsupportedLayerError

    model = nn.Sequential(nn.Linear(3, 8), nn.MultiheadAttention(8, 2))
    assert [r.name for r in resolve_layers(model, "all")] == ["0", "1"]
    with pytest.raises(UnsupportedLayerError, match="'1.out_proj' belongs to '1' .*without calling it"):
        resolve_layers(model, ["1.out_proj"])
    lm = nn.ModuleDict({"wte": nn.Embedding(5, 4), "wpe": nn.Embedding(7, 4)})
    assert [r.name for r in resolve_layers(lm)] == ["wte"]


def test_measured_positions_are_the_rules():
    """A meta-device forward measures each block's T by its rule: a convolution's output
    positions, one position for a block recorded by replay (a GroupNorm's (P, 1) column;
    it was output.numel() / (batch · P), half the pixels, before the registry asked it)."""
    from gradalg.plan.shapes import measure_forward_shapes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)).double()
    x, y = torch.randn(6, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    G = ga.grads(ga.tasks.classification(model), (x, y), layers="all")
    assert measure_forward_shapes(G.expr).positions == {"0": 16, "1": 1, "4": 1}
    chunk = ga.LocalExecutor().gradients(G.expr)         # the factors capture records
    assert {name: F.T for name, F in chunk.blocks.items()} == {"0": 16, "1": 1, "4": 1}
