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
from zoo import STOCK_TASKS, VOCAB, ZOO, stock, stock_items, stock_oracle, worst_relative_error

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
    with pytest.raises(ga.errors.UnsupportedLayerError, match=r"belongs to 'attn' \(MultiheadAttention\).*Name 'attn' itself"):
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


# ------------------------------------------------------- sequence-classification heads
def _classifier(num_labels, problem_type=None):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    config = BertConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                        vocab_size=VOCAB, max_position_embeddings=32, num_labels=num_labels,
                        problem_type=problem_type, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).double().eval()


def _labels(kind, num_labels, g):
    if kind == "int":
        return torch.randint(0, max(num_labels, 3), (), generator=g)
    if kind == "float":
        return torch.randn((num_labels,) if num_labels > 1 else (), generator=g, dtype=torch.float64)
    return (torch.rand(num_labels, generator=g) < 0.5).double()          # multi-hot


def _hf_loss_oracle(model, items, params, cast=None):
    """Each item alone through the HF model with its labels: ``model(**item).loss`` (HF's
    own choice of loss), differentiated with ``torch.autograd.grad``."""
    tensors = [model.get_parameter(n) for n in params]
    rows = []
    for item in items:
        labels = item["labels"] if cast is None else item["labels"].to(cast)
        loss = model(input_ids=item["input_ids"][None], labels=labels[None]).loss
        rows.append([torch.zeros_like(p) if g is None else g
                     for g, p in zip(torch.autograd.grad(loss, tensors, allow_unused=True), tensors)])
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(params)}


HEADS = [  # (num_labels, problem_type, labels, what HF computes)
    (1, None, "float", "regression"), (1, None, "int", "regression"), (2, "regression", "float", "regression"),
    (3, "multi_label_classification", "multi", "BCE"), (3, None, "multi", "BCE (float labels)"),
    (3, None, "int", "cross-entropy"), (3, "single_label_classification", "int", "cross-entropy")]


@pytest.mark.parametrize("layers", [None, "all"])
@pytest.mark.parametrize("num_labels,problem_type,labels,what", HEADS)
def test_sequence_classification_heads_match_hf_loss(num_labels, problem_type, labels, what, layers):
    model = _classifier(num_labels, problem_type)
    g = torch.Generator().manual_seed(1)
    items = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g), "labels": _labels(labels, num_labels, g)}
             for n in (5, 3, 4)]
    task = ga.tasks.sequence_classification(model)
    captured = ga.grads(task, items, layers=layers).to_params()
    # HF's MSE needs float targets: the reference casts integer regression targets itself
    cast = torch.float64 if what == "regression" else None
    reference = _hf_loss_oracle(model, items, list(captured), cast)
    err, where = worst_relative_error(captured, reference)
    assert err <= TOL, f"{what}: {err:.2e} at {where}"
    assert max(v.abs().max() for v in captured.values()) > 0


def test_one_logit_cross_entropy_is_refused_up_front_and_regression_works():
    model = _classifier(1)
    with pytest.raises(ga.HeadMismatchError, match="problem_type='regression'"):
        ga.tasks.sequence_classification(model, problem_type="single_label_classification")
    items = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor(2)}]
    captured = ga.grads(ga.tasks.sequence_classification(model, problem_type="regression"), items).to_params()
    reference = _hf_loss_oracle(model, items, list(captured), torch.float64)
    assert worst_relative_error(captured, reference)[0] <= TOL


def test_one_logit_plain_classifier_is_refused_with_a_fix_that_works():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    with pytest.raises(ga.HeadMismatchError, match="1 logit"):
        ga.grads(ga.tasks.classification(model), (X, y)).to_dense()
    task = ga.Task(model, lambda m, b: torch.nn.functional.binary_cross_entropy_with_logits(
        m(b[0]).squeeze(1), b[1].double(), reduction="sum"))
    G = ga.grads(task, (X, y)).to_params()
    reference = ga.per_example_grads(task, (X, y), list(G), method="loop")
    assert worst_relative_error(G, reference)[0] <= TOL


def test_regression_labels_of_another_shape_are_refused():
    model = _classifier(2, "regression")
    items = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([1.0, 2.0, 3.0])}]
    with pytest.raises(ga.HeadMismatchError, match=r"labels \(1, 2\)"):
        ga.grads(ga.tasks.sequence_classification(model), items).to_dense()


@pytest.mark.parametrize("problem_type", ["regression", "multi_label_classification"])
def test_expected_terms_give_the_exact_gauss_newton_matrix(problem_type):
    """Σ_c g_c g_cᵀ of the expected terms = Jᵀ H J with H the loss's Hessian in the outputs."""
    model = _classifier(3, problem_type)
    task = ga.tasks.sequence_classification(model)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[1.0, 0.0, 1.0]])}
    theta = model.classifier.weight
    terms = task.expected_terms(model, batch)
    G = sum(torch.outer(g, g) for g in (torch.autograd.grad(t, theta, retain_graph=True)[0].flatten() for t in terms))
    f = model(input_ids=batch["input_ids"]).logits[0]
    J = torch.stack([torch.autograd.grad(f[c], theta, retain_graph=True)[0].flatten() for c in range(3)])
    if problem_type == "regression":
        H = torch.eye(3, dtype=torch.float64) * 2 / 3
    else:
        p = torch.sigmoid(f.detach())
        H = torch.diag(p * (1 - p)) / 3
    torch.testing.assert_close(G, J.T @ H @ J)


# ------------------------------------------------------------ hand-written tied heads
class HandTied(nn.Module):
    """Embedding → Linear → tanh → logits from the embedding weight itself (``how``), or
    from an nn.Linear head holding that weight (``"module"``, what gradalg records)."""

    def __init__(self, how, vocab=13, d=6):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        if how == "module":
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, x):
        h = torch.tanh(self.mid(self.emb(x)))
        if self.how == "matmul":
            return h @ self.emb.weight.T
        if self.how == "linear":
            return torch.nn.functional.linear(h, self.emb.weight)
        if self.how == "einsum":
            return torch.einsum("btd,vd->btv", h, self.emb.weight)
        return self.head(h)


def _hand_tied(how):
    torch.manual_seed(0)
    model = HandTied(how).double()
    x, y = torch.randint(0, 13, (4, 5)), torch.randint(0, 13, (4, 5))

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]).reshape(-1, 13), b[1].reshape(-1), reduction="sum")
    return ga.Task(model, loss), (x, y)


@pytest.mark.parametrize("layers", [None, "all", ["emb"]])
@pytest.mark.parametrize("how", ["matmul", "linear", "einsum"])
def test_embedding_weight_reused_outside_its_module_is_refused(how, layers):
    task, data = _hand_tied(how)
    with pytest.raises(ga.PartialGradientError, match=r"'emb.weight'.*head.weight = emb.weight"):
        ga.grads(task, data, layers=layers).to_dense()


@pytest.mark.parametrize("fix", ["module", "leave_out", "func"])
def test_the_fixes_named_for_a_reused_weight_work(fix):
    task, data = _hand_tied("module" if fix == "module" else "matmul")
    layers = ["mid"] if fix == "leave_out" else None
    G = ga.grads(task, data, layers=layers, backend="func" if fix == "func" else "hooks")
    if fix == "func":
        got = ga.LocalExecutor().gradients(G.expr).blocks["emb"]
        want = ga.per_example_grads(task, data, ["emb.weight"], method="loop")["emb.weight"].flatten(1)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        return
    captured = G.to_params()
    reference = ga.per_example_grads(task, data, list(captured), method="loop")
    assert worst_relative_error(captured, reference)[0] <= TOL


# ------------------------------------------------------- two forwards before one backward
def _mlp_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    return model, torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))


@pytest.mark.parametrize("sizes", [(8, 8), (8, 5, 3), (16,)])
def test_capture_of_several_forwards_before_one_backward_gives_one_row_per_example(sizes):
    model, X, y = _mlp_data()
    bounds = torch.tensor((0,) + sizes).cumsum(0).tolist()
    with ga.capture(model, reduction="sum") as cap:
        for _ in range(2):
            losses = [torch.nn.functional.cross_entropy(model(X[a:b]), y[a:b], reduction="sum")
                      for a, b in zip(bounds, bounds[1:])]
            sum(losses).backward()
    assert cap.grads.n == 32 and cap.steps == 2
    captured = cap.grads.to_dense()
    reference = ga.grads(ga.tasks.classification(model), (X, y)).to_dense()
    for name, want in reference.items():
        torch.testing.assert_close(captured[name], torch.cat([want, want]), rtol=1e-12, atol=1e-12)


def test_capture_of_two_lm_forwards_of_unequal_lengths():
    import zoo
    model, task, _, _ = zoo.gpt2()
    g = torch.Generator().manual_seed(2)
    first, second = torch.randint(1, VOCAB, (3, 6), generator=g), torch.randint(1, VOCAB, (2, 4), generator=g)
    layers = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj"]
    with ga.capture(model, layers=layers, reduction="sum") as cap:
        loss = sum(zoo.causal_lm_loss(model, (ids, torch.ones_like(ids))) for ids in (first, second))
        loss.backward()
    captured = cap.grads.to_dense()      # (n, out, in): Conv1D blocks are [Wᵀ | b]
    rows = [ids[i:i + 1] for ids in (first, second) for i in range(ids.shape[0])]
    assert cap.grads.n == 5
    for layer in layers:
        weight, bias = (model.get_parameter(f"{layer}.{p}") for p in ("weight", "bias"))
        per_row = [torch.autograd.grad(zoo.causal_lm_loss(model, (r, torch.ones_like(r))), (weight, bias))
                   for r in rows]
        want = torch.stack([torch.cat([w.T, b[:, None]], 1) for w, b in per_row])
        torch.testing.assert_close(captured[layer], want, rtol=1e-9, atol=1e-12)


def test_capture_of_two_forwards_with_a_mean_loss_is_refused():
    model, X, y = _mlp_data()
    with pytest.raises(ga.LossReductionError, match="reduction='sum'"):
        with ga.capture(model, reduction="mean"):
            loss = sum(torch.nn.functional.cross_entropy(model(X[a:a + 8]), y[a:a + 8]) for a in (0, 8))
            loss.backward()


@pytest.mark.parametrize("how", ["matmul", "linear"])
def test_capture_in_a_loop_refuses_a_reused_weight_at_the_first_forward(how):
    task, data = _hand_tied(how)
    with pytest.raises(ga.PartialGradientError, match="'emb.weight'") as err:
        with ga.capture(task.model, reduction="sum"):
            task.loss(task.model, data).backward()
    assert "backend='func'" not in str(err.value)
    # the fix it names: the weight held by an nn.Linear head, recorded as one tied block
    task, data = _hand_tied("module")
    with ga.capture(task.model, reduction="sum") as cap:
        task.loss(task.model, data).backward()
    captured = cap.grads.to_dense()
    reference = ga.grads(task, data).to_dense()
    for name, want in reference.items():
        torch.testing.assert_close(captured[name], want, rtol=1e-9, atol=1e-12)


class ContainerHead(nn.Module):
    """HF's BertLMPredictionHead pattern: ``bias`` registered on the container and tied to
    ``decoder.bias``; ``direct`` also adds it in the container's own forward."""

    def __init__(self, direct):
        super().__init__()
        self.direct = direct
        self.decoder = nn.Linear(4, 3)
        self.bias = nn.Parameter(torch.zeros(3))
        self.decoder.bias = self.bias

    def forward(self, h):
        out = self.decoder(h)
        return out + self.bias if self.direct else out


@pytest.mark.parametrize("direct", [False, True])
def test_a_parameter_held_by_a_container_and_its_child_is_recorded_once_or_refused(direct):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), ContainerHead(direct)).double()
    task = ga.tasks.classification(model)
    data = (torch.randn(5, 2, dtype=torch.float64), torch.randint(0, 3, (5,)))
    if direct:   # the container's own use is outside the recorded module: refused
        with pytest.raises(ga.PartialGradientError, match=r"'2\.decoder\.bias'"):
            ga.grads(task, data, layers="all").to_dense()
        return
    captured = ga.grads(task, data, layers="all").to_params()
    assert set(captured) == {n for n, _ in model.named_parameters()}
    reference = ga.per_example_grads(task, data, list(captured), method="loop")
    assert worst_relative_error(captured, reference)[0] <= TOL


def test_an_unknown_problem_type_is_refused():
    with pytest.raises(ga.OptionError, match="problem_type"):
        ga.tasks.sequence_classification(_classifier(3), problem_type="ordinal")
