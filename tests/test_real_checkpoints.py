"""Real checkpoints at their defaults: every zoo architecture as its config class builds
it (tied embeddings and head kept: BERT's decoder, T5's and BART's shared embedding,
GPT-2's and Gemma's LM head), with the ``ga.tasks`` task of its head, at default layers and
``layers="all"``, against a loop of ``torch.autograd.grad`` over each item alone; and
``layers="all"`` checked against ``model.named_parameters()`` (no parameter missing or
doubled)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradalg as ga
from gradalg.capture.coverage import layer_coverage
from gradalg.capture.hooks import POSITION_EMBEDDINGS, resolve_layers
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


# ------------------------------------------------------------ nn.MultiheadAttention
class AttentionClassifier(nn.Module):
    """Embedding → nn.MultiheadAttention (either layout, padding as key_padding_mask) →
    nn.TransformerEncoderLayer → mean → Linear."""

    def __init__(self, batch_first=True, vocab=11, d=8):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(vocab, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=batch_first)
        self.block = nn.TransformerEncoderLayer(d, 2, dim_feedforward=12, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.emb(x)
        pad = x == 0
        if not self.batch_first:
            h = h.transpose(0, 1)
        a, _ = self.attn(h, h, h, key_padding_mask=pad)
        if not self.batch_first:
            a = a.transpose(0, 1)
        return self.head(self.block(a).mean(1))


def _attention_task(batch_first):
    torch.manual_seed(0)
    model = AttentionClassifier(batch_first).double()
    x = torch.randint(1, 11, (5, 4))
    x[1, 3] = 0
    return ga.tasks.classification(model), (x, torch.randint(0, 3, (5,)))


@pytest.mark.parametrize("batch_first", [True, False])
def test_layers_all_includes_multihead_attention_out_proj(batch_first):
    task, data = _attention_task(batch_first)
    model = task.model
    captured = ga.grads(task, data, layers="all").to_params()
    assert set(captured) == {n for n, _ in model.named_parameters()}
    assert "attn.out_proj.weight" in captured and "block.self_attn.out_proj.bias" in captured
    reference = ga.per_example_grads(task, data, list(captured), method="loop")
    for name in captured:
        torch.testing.assert_close(captured[name], reference[name], rtol=1e-9, atol=1e-12)
    coverage = layer_coverage(model, [r.name for r in resolve_layers(model, "all")])
    assert coverage.attributed == coverage.total == sum(p.numel() for p in model.parameters())


def test_out_proj_named_alone_is_refused_and_the_named_fix_works():
    task, data = _attention_task(True)
    with pytest.raises(ga.errors.UnsupportedLayerError, match="Name the nn.MultiheadAttention itself"):
        ga.grads(task, data, layers=["attn.out_proj"])
    captured = ga.grads(task, data, layers=["attn"]).to_params()
    assert set(captured) == {"attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias"}
    reference = ga.per_example_grads(task, data, list(captured), method="loop")
    for name in captured:
        torch.testing.assert_close(captured[name], reference[name], rtol=1e-9, atol=1e-12)


def test_multihead_attention_with_a_per_example_mask_is_refused():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

        def forward(self, x):
            mask = torch.zeros(x.shape[0] * 2, x.shape[1], x.shape[1], dtype=torch.bool)
            return self.attn(x, x, x, attn_mask=mask)[0].sum((1, 2))

    model = Masked().double()
    task = ga.Task(model, lambda m, b: m(b[0]).sum())
    with pytest.raises(ga.errors.UnsupportedLayerError, match="key_padding_mask"):
        ga.grads(task, (torch.randn(3, 5, 4, dtype=torch.float64),), layers="all").to_dense()
