"""Tied parameters: one block per parameter, its gradient the sum over every use.

The oracle is a loop of ``torch.autograd.grad`` over single examples, w.r.t. the shared
parameter itself (float64), written without gradalg.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga
from gradalg.errors import GradalgError
from references import one_thread  # noqa: F401 - one intra-op thread per test module
from models import lm_loss, padded_token_data

F64 = torch.float64
REL = 1e-8


def tied_gpt2(seed=0, vocab=37, n_embd=16):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=1, n_embd=n_embd, n_head=2, vocab_size=vocab, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(F64).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def task_of(model):
    return ga.Task(model, lm_loss, token_mask=lambda b: b[1].bool(), name="tied")


def oracle(model, loss_fn, batch, params) -> torch.Tensor:
    """(n, dim): per-example gradients of ``params`` by one backward per example."""
    n = batch[0].shape[0]
    rows = []
    for i in range(n):
        one = tuple(t[i:i + 1] for t in batch)
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss_fn(model, one), params)]))
    return torch.stack(rows)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def setup():
    model = tied_gpt2()
    data = padded_token_data(n=5, vocab=37, min_len=3, max_len=7, seed=1)
    queries = padded_token_data(n=3, vocab=37, min_len=2, max_len=7, seed=2)
    W = model.transformer.wte.weight
    return model, data, queries, oracle(model, lm_loss, data, [W]), oracle(model, lm_loss, queries, [W])


@pytest.mark.parametrize("layers", [["transformer.wte"], ["lm_head"], ["lm_head", "transformer.wte"]])
def test_tied_gradient_by_either_name_is_the_true_gradient(setup, layers):
    model, data, _, ref, _ = setup
    G = ga.grads(task_of(model), data, layers=layers, batch_size=2)
    assert G.space.names == ("transformer.wte",)
    assert G.space["lm_head"] is G.space["transformer.wte"]          # the alias selects the same block
    params = G.to_params()
    assert list(params) == ["transformer.wte.weight"]
    assert torch.equal(params["lm_head.weight"], params["transformer.wte.weight"])
    assert rel(params["transformer.wte.weight"].flatten(1), ref) < REL
    dense = G.to_dense()
    assert rel(dense["lm_head"].flatten(1), ref) < REL             # weight layout (vocab, hidden)
    assert rel(G["lm_head"].to_dense()["transformer.wte"].flatten(1), ref) < REL


def test_default_layers_count_the_tied_block_once(setup):
    model, data, _, _, _ = setup
    names = ga.grads(task_of(model), data).space.names
    assert names.count("transformer.wte") == 1 and "lm_head" not in names
    func_names = ga.grads(task_of(model), data, backend="func").space.names
    assert func_names.count("transformer.wte") == 1 and "lm_head" not in func_names
    # and the whole model's per-example gradients match the oracle in both backends
    for backend in ("hooks", "func"):
        G = ga.grads(task_of(model), data, backend=backend)
        if backend == "hooks":   # the layers hooks record (norms may be left out)
            params = [model.get_parameter(k) for k in G.to_params()]
        else:                    # every parameter but the (batch-shared) position embedding
            params = [p for _, p in model.named_parameters() if p is not model.transformer.wpe.weight]
        ref = oracle(model, lm_loss, data, params)
        got = (G @ G.T).compute().values
        assert rel(torch.as_tensor(got), ref @ ref.T) < REL, backend


def test_torch_func_reference_answers_to_either_name(setup):
    model, data, _, ref, _ = setup
    grads = ga.per_example_grads(task_of(model), data, ["lm_head.weight", "transformer.wte.weight"], method="loop")
    assert torch.equal(grads["lm_head.weight"], grads["transformer.wte.weight"])
    assert rel(grads["lm_head.weight"].flatten(1), ref) < REL


def test_func_backend_gives_the_same_block(setup):
    model, data, _, ref, _ = setup
    for layers in (["lm_head"], ["transformer.wte"]):
        G = ga.grads(task_of(model), data, layers=layers, backend="func")
        assert G.space.names == ("transformer.wte",)
        assert rel(G.to_dense()["transformer.wte"], ref) < REL   # was exactly 2x in the inner products


@pytest.mark.parametrize("ghost", ["always", "never"])
def test_grad_dot_ghost_and_dense_include_cross_terms(setup, ghost):
    model, data, queries, ref, qref = setup
    task = task_of(model)
    with ga.options(ghost=ghost):
        S = (ga.grads(task, queries, layers=["lm_head"]) @ ga.grads(task, data, layers=["transformer.wte"]).T)
        got = torch.as_tensor(S.compute().values)
    assert rel(got, qref @ ref.T) < REL
    # the per-use blocks alone (no cross terms) would be visibly off
    assert rel(got, 2 * qref @ ref.T) > 0.1


def test_influence_on_tied_block_matches_oracle(setup):
    model, data, queries, ref, qref = setup
    task = task_of(model)
    G = ga.grads(task, data, layers=["lm_head"])
    Q = ga.grads(task, queries, layers=["lm_head"])
    lam = 1e-2
    S = torch.as_tensor((Q @ ga.fisher(G).damp(lam).inv() @ G.T).compute().values)
    H = ref.T @ ref / ref.shape[0] + lam * torch.eye(ref.shape[1], dtype=F64)
    assert rel(S, qref @ torch.linalg.solve(H, ref.T)) < 1e-7


@pytest.mark.parametrize("kind", ["kron", "gaussian", "sparse"])
def test_projections_of_tied_block_match_projected_oracle(setup, kind):
    model, data, queries, ref, qref = setup
    task = task_of(model)
    P = {"kron": ga.proj.kron(k=16, seed=3), "gaussian": ga.proj.gaussian(k=12, seed=3),
         "sparse": ga.proj.sparse(k=12, seed=3)}[kind]
    hooks = P(ga.grads(task, data, layers=["lm_head"]))
    S = torch.as_tensor((P(ga.grads(task, queries, layers=["transformer.wte"])) @ hooks.T).compute().values)
    if kind == "kron":
        from gradalg.proj.matrices import kron_matrices
        Po, Pi = kron_matrices(P.expr if hasattr(P, "expr") else P, "transformer.wte", 37, 16, dtype=F64,
                               device=torch.device("cpu"))
        proj = lambda R: (Po @ R.view(-1, 37, 16) @ Pi.T).flatten(1)  # noqa: E731
        assert rel(S, proj(qref) @ proj(ref).T) < REL
    else:   # same block name and flattening as the func backend: the same projection
        func = P(ga.grads(task, data, layers=["lm_head"], backend="func"))
        assert rel(torch.as_tensor(hooks.to_dense()["projected"] if "projected" in hooks.space.names
                                   else hooks.to_dense()["transformer.wte"]),
                   torch.as_tensor(func.to_dense()["projected"] if "projected" in func.space.names
                                   else func.to_dense()["transformer.wte"])) < REL
    fisher = ga.fisher(hooks).damp(1e-3).inv()
    assert torch.isfinite(torch.as_tensor((P(ga.grads(task, queries, layers=["lm_head"])) @ fisher @ hooks.T)
                                          .compute().values)).all()


def test_kfac_on_embedding_tied_to_head_is_one_block_ekfac_is_exact_in_its_basis(setup):
    """K-FAC of the tied block is the Kronecker product of its pooled uses' covariances
    (test_vocab_kron checks the numbers); EK-FAC re-fits the eigenvalues to the true sums."""
    model, data, _, ref, _ = setup
    G = ga.grads(task_of(model), data, layers=["lm_head"])
    assert ga.kfac(G).to_dense().shape == (37 * 16, 37 * 16)
    # EK-FAC's eigenvalues are fit to the true (summed) gradients: in its eigenbasis the
    # diagonal of the operator equals the diagonal of the oracle's Fisher
    from gradalg.exec.local import LocalExecutor
    op = LocalExecutor().resolve(ga.ekfac(G).expr)
    Q_S, Q_A = op.bases["transformer.wte"]
    rotated = torch.einsum("os,nsi,ia->noa", Q_S.T, ref.view(-1, 37, 16), Q_A)
    assert rel(op.eigenvalues["transformer.wte"], (rotated ** 2).mean(0)) < REL


def test_capture_in_the_loop_matches_grads_on_tied_model(setup):
    model, data, _, ref, _ = setup
    task = task_of(model)
    with ga.capture(model, layers=["lm_head"]) as cap:
        for i in range(0, 5, 2):
            batch = tuple(t[i:i + 2] for t in data)
            model.zero_grad()
            lm_loss(model, batch).backward()
    assert cap.grads.space.names == ("transformer.wte",)
    S = torch.as_tensor((cap.grads @ ga.grads(task, data, layers=["transformer.wte"]).T).compute().values)
    assert rel(S, ref @ ref.T) < REL
    # the user's own backward saw the same sum over uses
    assert rel(cap.grads.to_dense()["transformer.wte"].flatten(1), ref) < REL


def test_store_round_trip_of_tied_block(setup, tmp_path):
    pytest.importorskip("zarr")
    model, data, queries, ref, qref = setup
    task = task_of(model)
    P = ga.proj.kron(k=16, seed=1)
    G = P(ga.grads(task, data, layers=["lm_head"]))
    ga.store.write(G, tmp_path / "g.zarr")
    stored = ga.store.open(tmp_path / "g.zarr", like=G)
    Q = P(ga.grads(task, queries, layers=["transformer.wte"]))
    assert torch.allclose(torch.as_tensor((Q @ stored.T).compute().values),
                          torch.as_tensor((Q @ G.T).compute().values), rtol=1e-10, atol=0)


# ------------------------------------------------------------------ other kinds of sharing
class Reused(nn.Module):
    """A Linear called twice, and two Linears holding one weight (biases their own)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.step = nn.Linear(6, 6)             # called twice
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 4)
        self.b.weight = self.a.weight           # same Parameter object, biases separate

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.step(torch.tanh(self.step(h))))
        return self.a(h) + self.b(torch.sin(h))


def test_reused_linear_and_shared_weight_with_own_biases():
    torch.manual_seed(0)
    model = Reused().double()
    x, y = torch.randn(6, 5, dtype=F64), torch.randint(0, 4, (6,))

    def loss(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1], reduction="sum")

    task = ga.Task(model, loss)
    G = ga.grads(task, (x, y), batch_size=4)
    # a: the shared weight (alias b); each Linear's own bias is a block of its own
    assert G.space.names == ("inp", "step", "a", "a.bias", "b.bias")
    assert G.space["b"].shape == (4, 6) and G.space["b.bias"].shape == (4, 1)
    assert ga.grads(task, (x, y), layers=["b"]).space.names == ("a", "a.bias", "b.bias")
    # named in any order or by any alias: the same space, in model order
    assert ga.grads(task, (x, y), layers=["b", "inp"]).space == ga.grads(task, (x, y), layers=["inp", "a"]).space
    assert ga.grads(task, (x, y), layers=["b", "inp"]).space.names == ("inp", "a", "a.bias", "b.bias")
    params = [model.inp.weight, model.inp.bias, model.step.weight, model.step.bias, model.a.weight,
              model.a.bias, model.b.bias]
    ref = oracle(model, loss, (x, y), params)
    got = G.to_params()
    hooks_rows = torch.cat([got["inp.weight"].flatten(1), got["inp.bias"], got["step.weight"].flatten(1),
                            got["step.bias"], got["a.weight"].flatten(1), got["a.bias"], got["b.bias"]], 1)
    assert rel(hooks_rows, ref) < REL
    S = torch.as_tensor((G @ G.T).compute().values)
    assert rel(S, ref @ ref.T) < REL


class LinearAndConv1D(nn.Module):
    """A Linear and an HF Conv1D (weight stored transposed) sharing one (6, 6) weight."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D
        self.lin = nn.Linear(6, 6, bias=False)
        self.conv = Conv1D(6, 6)
        self.conv.weight = self.lin.weight

    def forward(self, x):
        return self.conv(torch.tanh(self.lin(x)))


def test_tie_hooks_cannot_record_is_refused_and_func_is_the_fix():
    torch.manual_seed(0)
    model = LinearAndConv1D().double()
    x = torch.randn(4, 6, dtype=F64)

    def loss(m, batch):
        return (m(batch[0]) ** 2).sum()

    task = ga.Task(model, loss)
    with pytest.raises(ga.UnsupportedLayerError, match="backend='func'"):
        ga.grads(task, (x,), layers=["conv"])
    G = ga.grads(task, (x,), layers=["conv"], backend="func")
    assert G.space.names == ("lin", "conv.bias")
    ref = oracle(model, loss, (x,), [model.lin.weight, model.conv.bias])
    assert rel(torch.cat([G.to_dense()["lin"], G.to_dense()["conv.bias"]], 1), ref) < REL


def test_module_registered_under_two_names_is_one_block():
    torch.manual_seed(0)
    body = nn.Linear(3, 3).double()
    model = nn.Sequential(body, nn.Tanh(), body).double()      # the same module at "0" and "2"
    x = torch.randn(4, 3, dtype=F64)

    def loss(m, batch):
        return (m(batch[0]) ** 2).sum()

    task = ga.Task(model, loss)
    for layers in (None, ["0"], ["2"], ["0", "2"]):
        G = ga.grads(task, (x,), layers=layers)
        assert G.space.names == ("0",), layers
    ref = oracle(model, loss, (x,), [body.weight, body.bias])
    got = ga.grads(task, (x,), layers=["2"]).to_params()
    assert rel(torch.cat([got["0.weight"].flatten(1), got["2.bias"]], 1), ref) < REL
