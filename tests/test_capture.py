"""Hook capture (``ga.grads``) against the torch.func oracle (``ga.per_example_grads``).

Every test compares per-example gradients number by number: relative error ≤ 1e-5 in
float64 and ≤ 1e-4 in float32, per example.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradalg as ga
from gradalg.capture import Factors, OneHot
from models import (classification_data, cnn, gpt2, image_data, lm_loss, lm_task, mlp,
                    padded_token_data)

TOL = {torch.float64: 1e-5, torch.float32: 1e-4}
GPT2_LAYERS = ["transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
               "transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj", "lm_head"]


def assert_rows_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = ""):
    """Per-example relative error ‖a_i − e_i‖ / ‖e_i‖ ≤ tol (rows that are ~0 compare absolutely
    against the largest row, so an all-zero row must be zero up to rounding)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().flatten(1).double(), expected.detach().flatten(1).double()
    norms = e.norm(dim=1)
    floor = 1e-6 * max(float(norms.max()), 1e-30)
    err = (a - e).norm(dim=1) / norms.clamp_min(floor)
    assert float(err.max()) <= tol, f"{what}: per-example relative error {err.max():.3g} > {tol} ({err})"


def assert_params_close(captured: dict, reference: dict, tol: float):
    assert sorted(captured) == sorted(reference)
    for name in reference:
        assert_rows_close(captured[name], reference[name], tol, name)


def flat_params(module: nn.Module, params: dict, prefix: str) -> torch.Tensor:
    """A module's per-example parameter gradients flattened in module order (weight, bias)."""
    return torch.cat([params[f"{prefix}.{n}"].flatten(1) for n, _ in module.named_parameters(recurse=False)], 1)


# ---------------------------------------------------------------------------- models
def mlp_mixed(dtype=torch.float64, seed=0):
    """Linear with bias, then Linear without bias."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3, bias=False)).to(dtype)


class SharedEmbedding(nn.Module):
    """An Embedding (with padding_idx) and a Linear, each called twice in one forward."""

    def __init__(self, vocab=11, d=6, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        e1 = self.emb(ids)                      # (B, T, d)
        e2 = self.emb(ids.flip(1))              # second call of the same embedding
        h = torch.tanh(self.lin(e1))
        h = torch.tanh(self.lin(h + e2))        # second call of the same Linear
        return self.head(h.mean(1))


def token_class_data(n=9, vocab=11, T=5, seed=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, T), generator=g)
    ids[:, -1] = 0                              # every example has padding tokens
    ids[0] = 0                                  # and one is padding only
    return ids, torch.randint(0, 3, (n,), generator=g)


class CountForwards:
    """Counts forward calls of a module with a forward pre-hook."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1


# ---------------------------------------------------------------------------- Linear / Conv2d
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch_size", [3, 4, 40])
def test_mlp_linear_with_and_without_bias(dtype, batch_size):
    model = mlp_mixed(dtype)
    x, y = classification_data(n=10, dtype=dtype)
    task = ga.tasks.classification(model)
    G = ga.grads(task, (x, y), layers=["0", "2"], batch_size=batch_size)
    captured = G.to_params()
    assert sorted(captured) == ["0.bias", "0.weight", "2.weight"]
    reference = ga.per_example_grads(task, (x, y), list(captured), method="vmap")
    assert_params_close(captured, reference, TOL[dtype])
    assert G.to_dense()["2"].shape == (10, 3, 16)
    assert G.to_dense()["0"].shape == (10, 16, 9)          # the bias is a ones column


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 13), batch_size=st.integers(1, 7))
def test_mlp_any_chunking(n, batch_size):
    model = mlp()
    x, y = classification_data(n=n)
    task = ga.tasks.classification(model)
    captured = ga.grads(task, (x, y), layers=["0", "2"], batch_size=batch_size).to_params()
    reference = ga.per_example_grads(task, (x, y), list(captured), method="vmap")
    assert_params_close(captured, reference, TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch_size", [5, 12])
def test_cnn_conv2d(dtype, batch_size):
    model = cnn(dtype)
    x, y = image_data(n=12, dtype=dtype)
    task = ga.tasks.classification(model)
    G = ga.grads(task, (x, y), layers=["conv1", "conv2", "fc"], batch_size=batch_size)
    captured = G.to_params()
    # conv1 has a bias; conv2 (stride 2, padding 1) has none
    assert sorted(captured) == ["conv1.bias", "conv1.weight", "conv2.weight", "fc.bias", "fc.weight"]
    reference = ga.per_example_grads(task, (x, y), list(captured), method="vmap")
    assert_params_close(captured, reference, TOL[dtype])
    assert G.to_dense()["conv2"].shape == (12, 5, 4 * 3 * 3)


class ConvVariants(nn.Module):
    """Non-square kernel, stride, padding and dilation; a Linear on a 4-D input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2))
        self.pix = nn.Linear(3, 4)                          # applied per pixel: T = H·W
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))                        # (B, 3, 3, 4)
        h = torch.tanh(self.pix(h.permute(0, 2, 3, 1)))     # (B, 3, 4, 4)
        return self.fc(h.mean((1, 2)))


def test_conv2d_variants_and_linear_on_4d_input():
    torch.manual_seed(0)
    model = ConvVariants().double()
    x, y = image_data(n=7)
    task = ga.tasks.classification(model)
    G = ga.grads(task, (x, y), layers=["conv", "pix", "fc"], batch_size=4)
    captured = G.to_params()
    reference = ga.per_example_grads(task, (x, y), list(captured), method="vmap")
    assert_params_close(captured, reference, TOL[torch.float64])
    chunk = ga.LocalExecutor().gradients(G.expr)
    assert chunk.blocks["conv"].T == 3 * 4 and chunk.blocks["pix"].T == 3 * 4


@pytest.mark.parametrize("conv", [nn.Conv2d(2, 4, 3, groups=2), nn.Conv2d(2, 4, 3, padding="same"),
                                  nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect")])
def test_conv2d_unsupported_variants_are_refused(conv):
    model = nn.Sequential(conv, nn.Flatten(), nn.LazyLinear(3))
    task = ga.tasks.classification(model)
    with pytest.raises(ga.UnsupportedLayerError, match="backend='func'"):
        ga.grads(task, image_data(n=2, dtype=torch.float32), layers=["0"])


def test_inplace_activation_after_recorded_layer():
    """ReLU(inplace=True) overwrites the recorded layer's output; D must be the gradient
    w.r.t. the layer's output before the overwrite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 3)).double()
    x, y = classification_data(n=10)
    task = ga.tasks.classification(model)
    captured = ga.grads(task, (x, y), layers=["0", "2"], batch_size=4).to_params()
    reference = ga.per_example_grads(task, (x, y), list(captured), method="vmap")
    assert_params_close(captured, reference, TOL[torch.float64])


# ---------------------------------------------------------------------------- GPT-2
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch_size", [4, 6])
def test_gpt2_padded_batches(dtype, batch_size):
    model = gpt2(dtype)
    ids, mask = padded_token_data(n=6)
    assert len(set(mask.sum(1).tolist())) > 2               # really variable lengths
    task = lm_task(model)
    captured = ga.grads(task, (ids, mask), layers=GPT2_LAYERS, batch_size=batch_size).to_params()
    assert len(captured) == 10                               # 4 Conv1D (w, b) + wte + lm_head
    reference = ga.per_example_grads(task, (ids, mask), list(captured), method="loop")
    assert_params_close(captured, reference, TOL[dtype])


def _pad_collate(examples):
    """Pads each batch to its own longest sequence, so chunks have different T."""
    lengths = [int(m.sum()) for _, m in examples]
    T = max(lengths)
    ids = torch.stack([i[:T] for i, _ in examples])
    mask = torch.stack([m[:T] for _, m in examples])
    return ids, mask


def test_gpt2_dataloader_with_per_batch_padding():
    model = gpt2()
    ids, mask = padded_token_data(n=7, min_len=2, max_len=9, seed=5)
    loader = DataLoader(TensorDataset(ids, mask), batch_size=3, shuffle=False, collate_fn=_pad_collate)
    Ts = [b[0].shape[1] for b in loader]
    assert len(set(Ts)) > 1, Ts
    task = lm_task(model)
    G = ga.grads(task, loader, layers=["transformer.wte", "transformer.h.1.attn.c_attn", "lm_head"])
    captured = G.to_params()
    reference = ga.per_example_grads(task, (ids, mask), list(captured), method="loop")
    assert_params_close(captured, reference, TOL[torch.float64])


def test_gpt2_tied_lm_head_sums_to_shared_weight():
    model = gpt2(tied=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids, mask = padded_token_data(n=5)
    task = lm_task(model)
    G = ga.grads(task, (ids, mask), layers=["transformer.wte", "lm_head"], batch_size=3)
    assert G.space.names == ("transformer.wte",)   # one block for the one parameter (tests/test_tied.py)
    captured = G.to_params()
    reference = ga.per_example_grads(task, (ids, mask), ["transformer.wte.weight"], method="loop")
    assert_rows_close(captured["transformer.wte.weight"], reference["transformer.wte.weight"],
                      TOL[torch.float64], "tied weight")


# ---------------------------------------------------------------------------- Embedding
def test_embedding_padding_idx_and_modules_called_twice():
    torch.manual_seed(0)
    model = SharedEmbedding().double()
    ids, y = token_class_data()
    task = ga.tasks.classification(model)
    G = ga.grads(task, (ids, y), layers=["emb", "lin", "head"], batch_size=4)
    captured = G.to_params()
    reference = ga.per_example_grads(task, (ids, y), list(captured), method="vmap")
    assert_params_close(captured, reference, TOL[torch.float64])
    # no gradient at the padding row
    assert torch.count_nonzero(captured["emb.weight"][:, 0]) == 0
    # two calls: factors concatenate along T (2 × 5 positions)
    chunk = ga.LocalExecutor().gradients(G.expr)
    assert chunk.blocks["emb"].T == 10 and chunk.blocks["lin"].T == 10
    assert isinstance(chunk.blocks["emb"].A, OneHot)
    both_calls = torch.cat([ids, ids.flip(1)], 1)
    assert not chunk.blocks["emb"].A.valid[both_calls == 0].any()
    assert chunk.blocks["emb"].A.valid[both_calls != 0].all()


def test_embedding_func_backend_matches_hooks():
    torch.manual_seed(0)
    model = SharedEmbedding().double()
    ids, y = token_class_data()
    task = ga.tasks.classification(model)
    hooks = ga.grads(task, (ids, y), layers=["emb", "lin"]).to_params()
    func = ga.grads(task, (ids, y), layers=["emb", "lin"], backend="func").to_dense()
    for name in ["emb", "lin"]:
        assert_rows_close(func[name], flat_params(getattr(model, name), hooks, name), TOL[torch.float64], name)


# ---------------------------------------------------------------------------- token mask
def test_token_mask_zeroes_padded_positions():
    model = gpt2()
    ids, mask = padded_token_data(n=6)
    layers = ["transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"]
    pad = mask == 0
    assert pad.any()

    masked = ga.grads(lm_task(model), (ids, mask), layers=layers, batch_size=4)
    chunk = ga.LocalExecutor().gradients(masked.expr)
    for name in layers:
        factors = chunk.blocks[name]
        assert isinstance(factors, Factors)
        if isinstance(factors.A, OneHot):
            assert not factors.A.valid[pad].any(), name
            assert factors.A.valid[~pad].all(), name
        else:
            assert torch.count_nonzero(factors.A[pad]) == 0, name
            assert torch.count_nonzero(factors.A[~pad].abs().sum(-1)) == int((~pad).sum()), name
        assert torch.count_nonzero(factors.D[pad]) == 0, name

    reference = ga.per_example_grads(lm_task(model), (ids, mask), method="loop",
                                     params=list(masked.to_params()))
    assert_params_close(masked.to_params(), reference, TOL[torch.float64])

    # without the mask the padded positions are recorded (the bias column at least) ...
    unmasked = ga.grads(ga.Task(model, lm_loss), (ids, mask), layers=layers, batch_size=4)
    raw = ga.LocalExecutor().gradients(unmasked.expr)
    assert torch.count_nonzero(raw.blocks["transformer.h.0.attn.c_attn"].A[pad]) > 0
    # ... but they carry no gradient, so the dense gradients agree
    dense_masked, dense_unmasked = masked.to_dense(), unmasked.to_dense()
    for name in layers:
        assert_rows_close(dense_unmasked[name], dense_masked[name], TOL[torch.float64], name)


# ---------------------------------------------------------------------------- func backend
@pytest.mark.parametrize("case", ["mlp", "cnn", "gpt2"])
def test_func_backend_equals_hooks(case):
    if case == "mlp":
        model, data, layers = mlp_mixed(), classification_data(n=7), ["0", "2"]
        task = ga.tasks.classification(model)
    elif case == "cnn":
        model, data, layers = cnn(), image_data(n=5), ["conv1", "conv2", "fc"]
        task = ga.tasks.classification(model)
    else:
        model, data = gpt2(), padded_token_data(n=4)
        layers = ["transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"]
        task = lm_task(model)
    hooks = ga.grads(task, data, layers=layers, batch_size=3).to_params()
    G = ga.grads(task, data, layers=layers, batch_size=3, backend="func")
    assert set(G.representation.values()) == {"dense"}
    func = G.to_dense()
    modules = dict(model.named_modules())
    for name in layers:
        expected = flat_params(modules[name], hooks, name)
        assert func[name].shape == expected.shape
        assert_rows_close(func[name], expected, TOL[torch.float64], name)


def test_func_backend_tied_lm_head_gives_shared_weight_gradient():
    """With tied weights, the func block of lm_head is the gradient of the shared parameter."""
    model = gpt2(tied=True)
    ids, mask = padded_token_data(n=4)
    task = lm_task(model)
    func = ga.grads(task, (ids, mask), layers=["lm_head"], backend="func").to_dense()["lm_head"]
    hooks = ga.grads(task, (ids, mask), layers=["transformer.wte", "lm_head"]).to_params()
    assert_rows_close(func, hooks["transformer.wte.weight"].flatten(1), TOL[torch.float64], "tied lm_head")


def test_func_backend_records_unsupported_layers():
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2)).double()
    x, y = classification_data(n=5, d_in=4, classes=2)
    task = ga.tasks.classification(model)
    func = ga.grads(task, (x, y), layers=["1"], backend="func").to_dense()["1"]
    ref = ga.per_example_grads(task, (x, y), ["1.weight", "1.bias"], method="vmap")
    assert_rows_close(func, torch.cat([ref["1.weight"], ref["1.bias"]], 1), TOL[torch.float64])


# ---------------------------------------------------------------------------- objectives
def test_objective_output_equals_oracle_of_output_function():
    model = mlp()
    x, y = classification_data(n=9)
    task = ga.tasks.classification(model)
    captured = ga.grads(task, (x, y), layers=["0", "2"], batch_size=4, objective="output").to_params()
    reference = ga.per_example_grads(task, (x, y), list(captured), loss_fn=task.output, method="vmap")
    assert_params_close(captured, reference, TOL[torch.float64])
    loss_grads = ga.per_example_grads(task, (x, y), list(captured), method="vmap")
    assert (captured["2.weight"] - loss_grads["2.weight"]).norm() > 1e-3


def test_objective_sampled_is_seeded_and_uses_one_label_per_example():
    model = mlp()
    x, y = classification_data(n=16)
    task = ga.tasks.classification(model)
    layers = ["0", "2"]

    def sampled(seed):
        return ga.grads(task, (x, y), layers=layers, batch_size=5, objective="sampled", seed=seed).to_params()

    a, b, c = sampled(0), sampled(0), sampled(1)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert any(not torch.allclose(a[n], c[n]) for n in a)

    # every example's sampled gradient is its cross-entropy gradient for one of the classes
    names = list(a)
    per_class = [ga.per_example_grads(task, (x, torch.full_like(y, k)), names, method="vmap") for k in range(3)]
    for grads in (a, c):
        flat = torch.cat([grads[n].flatten(1) for n in names], 1)
        options = torch.stack([torch.cat([pc[n].flatten(1) for n in names], 1) for pc in per_class], 1)
        err = (options - flat[:, None]).norm(dim=2) / options.norm(dim=2)
        assert bool((err.min(1).values <= TOL[torch.float64]).all())


def test_sampled_fisher_approaches_gauss_newton():
    """For logits z = W x and cross-entropy, GN_i = (diag p − p pᵀ) ⊗ x xᵀ (row-major (out, in))."""
    torch.manual_seed(0)
    model = nn.Linear(3, 3, bias=False).double()
    x, y = classification_data(n=4, d_in=3, classes=3)
    reps = 2000
    X, Y = x.repeat(reps, 1), y.repeat(reps)
    task = ga.tasks.classification(model)
    G = ga.grads(task, (X, Y), batch_size=4000, objective="sampled", seed=3)
    fisher = ga.fisher(G).to_dense()
    with torch.no_grad():
        p = torch.softmax(model(x), -1)
    gn = sum(torch.kron(torch.diag(p_i) - torch.outer(p_i, p_i), torch.outer(x_i, x_i))
             for p_i, x_i in zip(p, x)) / len(x)
    assert fisher.shape == gn.shape == (9, 9)
    assert float((fisher - gn).norm() / gn.norm()) < 0.05          # Monte-Carlo error ~0.02
    empirical = ga.fisher(ga.grads(task, (x, y))).to_dense()      # true labels: not the GN
    assert float((empirical - gn).norm() / gn.norm()) > 0.5


# ---------------------------------------------------------------------------- reductions
def test_task_reduction_mean_equals_sum():
    model = mlp()
    x, y = classification_data(n=10)

    def mean_loss(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1])

    sum_task = ga.tasks.classification(model)
    mean_task = ga.Task(model, mean_loss, reduction="mean")
    captured = ga.grads(mean_task, (x, y), layers=["0", "2"], batch_size=4).to_params()   # chunks 4, 4, 2
    reference = ga.per_example_grads(sum_task, (x, y), list(captured), method="vmap")
    assert_params_close(captured, reference, TOL[torch.float64])


def test_mean_loss_declared_sum_is_refused_at_compute_time():
    model = mlp()
    x, y = classification_data(n=10)
    task = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    G = ga.grads(task, (x, y), layers=["0"])                 # lazy: nothing checked yet
    with pytest.raises(ga.LossReductionError, match="reduction='sum'"):
        G.to_dense()


def test_loss_coupling_examples_is_refused():
    model = mlp()
    x, y = classification_data(n=10)

    def centered(m, batch):                                  # normalizes across the batch
        per_example = F.cross_entropy(m(batch[0]), batch[1], reduction="none")
        return ((per_example - per_example.mean()) ** 2).sum()

    with pytest.raises(ga.LossReductionError, match="couples examples"):
        ga.grads(ga.Task(model, centered), (x, y), layers=["0"]).to_dense()


def test_gpt2_batch_token_mean_is_refused():
    """A token mean over the whole batch weights sequences by their length: not separable.

    (The check compares forward losses to 1e-3, so it needs token losses that differ: an
    untrained model predicts every token alike; sharper logits make them differ.)"""
    model = gpt2()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    ids, mask = padded_token_data(n=6)

    def batch_token_mean(m, batch):
        ids, mask = batch
        logits = m(input_ids=ids, attention_mask=mask).logits[:, :-1]
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100)

    for reduction in ("sum", "mean"):
        task = ga.Task(model, batch_token_mean, reduction=reduction)
        with pytest.raises(ga.LossReductionError):
            ga.grads(task, (ids, mask), layers=["lm_head"]).to_dense()


def test_batchnorm_in_train_mode_is_captured_in_eval_mode():
    """Batch statistics would couple examples: capture runs the model in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    x, y = classification_data(n=8)
    task = ga.tasks.classification(model)
    model.train()
    captured = ga.grads(task, (x, y), layers=["0", "3"], batch_size=4).to_params()
    assert model.training                                    # the mode is restored
    model.eval()
    reference = ga.per_example_grads(task, (x, y), list(captured), method="vmap")
    assert_params_close(captured, reference, TOL[torch.float64])


# ---------------------------------------------------------------------------- errors
def test_unsupported_layer_names_func_backend():
    model = nn.Sequential(nn.EmbeddingBag(10, 4, mode="max"), nn.Linear(4, 3))
    task = ga.tasks.classification(model)
    with pytest.raises(ga.UnsupportedLayerError, match="backend='func'"):
        ga.grads(task, (torch.randint(0, 10, (4, 3)), torch.randint(0, 3, (4,))), layers=["0"])


def test_nonfinite_gradients_name_the_examples():
    model = mlp()
    x, y = classification_data(n=10)
    x = x.clone()
    x[[2, 7]] = float("nan")
    ids = [f"ex{i}" for i in range(10)]
    task = ga.tasks.classification(model)
    G = ga.grads(task, (x, y), layers=["0", "2"], ids=ids, batch_size=4)
    with pytest.raises(ga.NonFiniteGradientError) as info:
        G.to_dense()
    assert info.value.example_ids == ["ex2"]                 # the first bad chunk stops the pass
    with pytest.raises(ga.NonFiniteGradientError) as info:
        ga.grads(task, (x, y), layers=["0", "2"], ids=ids, batch_size=10).to_dense()
    assert info.value.example_ids == ["ex2", "ex7"]
    assert sorted(info.value.layers) == ["0", "2"]


def test_wrong_layer_name_suggests_close_names():
    model = gpt2()
    task = lm_task(model)
    data = padded_token_data(n=2)
    with pytest.raises(KeyError, match="did you mean.*transformer.h.0.attn.c_attn"):
        ga.grads(task, data, layers=["transformer.h.0.attn.c_atn"])
    with pytest.raises(KeyError, match="did you mean.*lm_head"):
        ga.grads(task, data, layers=["lm_haed"])
    mlp_task = ga.tasks.classification(mlp())
    with pytest.raises(KeyError, match="no module named 'fc1'"):
        ga.grads(mlp_task, classification_data(n=4), layers=["fc1"])


def test_shuffled_dataloader_is_refused():
    x, y = classification_data(n=10)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    with pytest.raises(ValueError, match="shuffle=False"):
        ga.grads(ga.tasks.classification(mlp()), loader, layers=["0"])


def test_ordered_dataloader_is_accepted():
    model = mlp()
    x, y = classification_data(n=10)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
    task = ga.tasks.classification(model)
    captured = ga.grads(task, loader, layers=["0", "2"]).to_params()
    assert_params_close(captured, ga.per_example_grads(task, (x, y), list(captured)), TOL[torch.float64])


# ---------------------------------------------------------------------------- laziness
def test_building_and_displaying_runs_no_forward_pass():
    model = gpt2()
    counter = CountForwards(model)
    task = lm_task(model)
    G = ga.grads(task, padded_token_data(n=6), layers=GPT2_LAYERS, batch_size=4)
    Q = ga.grads(task, padded_token_data(n=2, seed=9), layers=GPT2_LAYERS)
    P = ga.proj.kron(k=8, seed=0)
    H = ga.fisher(P(G)).damp(1e-3).inv()
    S = P(Q) @ H @ P(G).T
    for obj in (G, Q, H, S, P(G)):
        repr(obj)
        obj._repr_html_()
    S.cost()
    assert (G.n, G.layers, G.space.names) == (6, tuple(GPT2_LAYERS), tuple(GPT2_LAYERS))
    assert counter.calls == 0
    G.to_dense()
    assert counter.calls > 0
    counter.handle.remove()
