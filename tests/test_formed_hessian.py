"""The formed Hessian (``influence(curvature="dense_hessian")``, issue 31): H formed
from dim Hessian-vector products, its default damping (shifted to PSD + 0.3 × its mean
eigenvalue, one λ), against the dense torch.func Hessian of the same loss and a direct solve."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, hessian, jacrev

import gradalg as ga
from gradalg.curvature.hvp import ParamCoords
from gradalg.linalg.autodamp import DampingRule
from gradalg.methods.influence import DENSE_HESSIAN_DAMPING

from models import classification_data, mlp
from references import one_thread  # noqa: F401 - autouse fixture

WD = 0.05


@pytest.fixture(scope="module")
def setting():
    """A tanh MLP a few Adam steps from its start: its Hessian is indefinite (checked)."""
    X, y = classification_data(n=36, d_in=4, classes=3)
    model = mlp(d_in=4, hidden=3, classes=3, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(20):
        opt.zero_grad()
        F.cross_entropy(model(X[:30]), y[:30]).backward()
        opt.step()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach()

    def losses(t, X_, y_):
        params = {n: v.reshape(s) for n, v, s in zip(names, t.split(sizes), shapes)}
        return F.cross_entropy(functional_call(model, params, (X_,)), y_, reduction="none")

    train, query = (X[:30], y[:30]), (X[30:], y[30:])
    task = ga.tasks.classification(model)
    # P (d, d): row i = the library's canonical coordinates (per layer (out, in + 1), the bias
    # folded in) of the i-th coordinate of torch's flat order
    coords = ParamCoords(model, ga.grads(task, train).space.names)
    eye = torch.eye(len(theta), dtype=torch.float64)
    P = coords.from_params({n: r.reshape(len(theta), *s) for n, r, s in zip(names, eye.split(sizes, 1), shapes)})
    H = hessian(lambda t: losses(t, *train).mean())(theta)                # (d, d) of the mean loss
    G = jacrev(losses)(theta, *train) @ P                                 # (n_train, d)
    Q = jacrev(losses)(theta, *query) @ P                                 # (n_query, d)
    H = P.T @ H @ P
    return dict(task=task, train=train, query=query, H=(H + H.T) / 2, G=G, Q=Q)


def values(S) -> np.ndarray:
    return np.asarray(S.compute().values)


def reference(s, lam: float, wd: float = 0.0) -> np.ndarray:
    """Q (H + (λ + wd) I)⁻¹ Gᵀ (n_query, n_train) by a dense solve."""
    A = s["H"] + (lam + wd) * torch.eye(s["H"].shape[0], dtype=torch.float64)
    return (s["Q"] @ torch.linalg.solve(A, s["G"].T)).numpy()


def test_the_setting_is_indefinite(setting):
    assert float(torch.linalg.eigvalsh(setting["H"])[0]) < -1e-3


def test_formed_hessian_is_the_dense_hessian(setting):
    """The formed matrix equals torch.func's Hessian of the mean loss (the block order of the
    space is the model's: every parameter of the MLP is attributed)."""
    H = ga.hessian(setting["task"], setting["train"])
    from gradalg.expr.curvature import Formed
    formed = ga.Operator(Formed(H.expr, chunk=7)).to_dense()       # chunks that do not divide dim
    np.testing.assert_allclose(formed.numpy(), setting["H"].numpy(), rtol=1e-10, atol=1e-12)
    assert ga.Operator(Formed(H.expr)).structure == "dense"


def test_a_given_damping_is_added_to_the_hessian_shifted_to_psd(setting):
    """damping=λ: H + wd·I shifted to PSD (its smallest eigenvalue is −0.4 here), then + λ; a
    relative_damping r: + r × the mean of its eigenvalues (negatives as 0)."""
    mu = torch.linalg.eigvalsh(setting["H"]) + WD
    shift = max(0.0, -float(mu[0]))
    assert shift > 0.1
    S = ga.methods.influence(setting["task"], setting["train"], setting["query"], curvature="dense_hessian",
                             damping=0.3, weight_decay=WD)
    np.testing.assert_allclose(values(S), reference(setting, 0.3 + shift, WD), rtol=1e-8, atol=1e-10)
    assert "damping=0.3 (given) on the Hessian shifted to PSD" in str(S.explain())
    S = ga.methods.influence(setting["task"], setting["train"], setting["query"], curvature="dense_hessian",
                             relative_damping=0.5, weight_decay=WD)
    lam = shift + 0.5 * float(mu.clamp_min(0).sum()) / mu.numel()
    np.testing.assert_allclose(values(S), reference(setting, lam, WD), rtol=1e-8, atol=1e-10)


def test_default_damping_is_the_psd_shift_plus_a_third_of_the_mean(setting):
    """λ = max(0, −μ_min) + 0.3 × (mean of the eigenvalues, negatives counted as 0); the
    damped matrix is positive definite, its smallest eigenvalue 0.3 × that mean."""
    mu = torch.linalg.eigvalsh(setting["H"])
    lam = -float(mu[0]) + 0.3 * float(mu.clamp_min(0).sum()) / mu.numel()
    S = ga.methods.influence(setting["task"], setting["train"], setting["query"], curvature="dense_hessian")
    want = reference(setting, lam)
    np.testing.assert_allclose(values(S), want, rtol=1e-7, atol=1e-9 * np.abs(want).max())
    text = str(S.explain())
    assert "shifted to PSD" in text and "the default for a formed Hessian" in text
    # with a weight decay, the shift is read from H + wd·I (it takes up the decay's share)
    Sw = ga.methods.influence(setting["task"], setting["train"], setting["query"], curvature="dense_hessian",
                              weight_decay=WD)
    lam_w = max(0.0, -float(mu[0]) - WD) + 0.3 * float((mu + WD).clamp_min(0).sum()) / mu.numel()
    np.testing.assert_allclose(values(Sw), reference(setting, lam_w, WD), rtol=1e-7,
                               atol=1e-9 * np.abs(want).max())


def test_a_psd_rule_on_a_psd_matrix_adds_no_shift(setting):
    """The Gauss-Newton is PSD: ``psd=True`` changes nothing there (round-off aside)."""
    args = (setting["task"], setting["train"], setting["query"])
    plain = values(ga.methods.influence(*args, curvature="gauss_newton",
                                        damping=DampingRule("mean", 0.3, per_block=False)))
    shifted = values(ga.methods.influence(*args, curvature="gauss_newton",
                                          damping=DampingRule("mean", 0.3, per_block=False, psd=True)))
    np.testing.assert_allclose(shifted, plain, rtol=1e-6, atol=1e-9 * np.abs(plain).max())


def test_the_default_rule_is_named_and_shifted():
    assert DENSE_HESSIAN_DAMPING.psd and not DENSE_HESSIAN_DAMPING.per_block
    assert "shifted to PSD" in DENSE_HESSIAN_DAMPING.describe()


def test_a_formed_hessian_refuses_a_projector(setting):
    with pytest.raises(ValueError, match="parameter coordinates"):
        ga.methods.influence(setting["task"], setting["train"], setting["query"], curvature="dense_hessian",
                             projector=ga.proj.gaussian(8, seed=0))


def test_auto_forms_the_hessian_only_where_it_can(setting):
    """``resolve_curvature(..., dense="dense_hessian")``: the formed Hessian for a classifier; the
    dense Gauss-Newton, with the reason in the note, in projected coordinates, for a task whose
    curvature is the sampled Gauss-Newton (a language model) and for attention torch has no
    forward-mode AD for."""
    from torch import nn
    from gradalg.methods.influence import resolve_curvature

    task = setting["task"]
    assert resolve_curvature("auto", "direct", 27, dense="dense_hessian", task=task)[0] == "dense_hessian"
    name, note = resolve_curvature("auto", "direct", 27, dense="dense_hessian", task=task, projected=True)
    assert name == "gauss_newton" and "not the Hessian: projected coordinates" in note
    lm = ga.Task(task.model, task.loss, curvature_objective="sampled", sampled_loss=task.sampled_loss)
    name, note = resolve_curvature("auto", "direct", 27, dense="dense_hessian", task=lm)
    assert name == "gauss_newton" and "sampled Gauss-Newton" in note

    class WithAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 1)
            self.head = nn.Linear(4, 3)

    attn = ga.tasks.classification(WithAttention())
    name, note = resolve_curvature("auto", "direct", 27, dense="dense_hessian", task=attn)
    assert name == "gauss_newton" and "MultiheadAttention" in note
    # above the dense limit it is EK-FAC whatever the dense choice
    with ga.options(dense_curvature_dim=10):
        assert resolve_curvature("auto", "direct", 27, dense="dense_hessian", task=task)[0] == "ekfac"


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_a_float32_llamas_formed_hessian_is_its_float64_copys_dense_hessian(batching):
    """A float32 Llama (a bias-free ``o_proj``): the formation's float64 identity columns are the
    tangents of float32 parameters. Before, vmap's bias-free ``F.linear`` raised "expected scalar
    type Double but found Float" (the loop ran: torch cast the tangent there); each tangent is now
    cast to its parameter's dtype, both ways. Against torch.func's Hessian of the mean loss of a
    float64 copy (same weights): float32 products of a 3-example, 8-token loss, measured 2.4e-7 of
    the largest entry off (0.55; the entries' spread 0.04); 2e-5 of it allows ~80x that and is
    3e-4 of the spread, so a wrong block, order or scale fails."""
    import copy
    from transformers import LlamaConfig, LlamaForCausalLM
    from gradalg.expr.curvature import Formed
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=31, max_position_embeddings=32, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.randint(1, 31, (3, 8), generator=torch.Generator().manual_seed(0))
    layer = "model.layers.0.self_attn.o_proj"
    task = ga.tasks.causal_lm(model)
    with ga.options(products_batching=batching):
        formed = ga.Operator(Formed(ga.hessian(task, {"input_ids": ids}, layers=[layer]).expr, chunk=100)).to_dense()
    wide = copy.deepcopy(model).double()
    W = wide.get_parameter(f"{layer}.weight").detach()
    mean_loss = lambda w: task.summed_loss(_Swapped(wide, f"{layer}.weight", w), {"input_ids": ids}) / 3
    H = hessian(mean_loss)(W).detach().reshape(W.numel(), W.numel())
    assert formed.dtype == torch.float64 and float(H.abs().max()) > 0.1
    torch.testing.assert_close(formed, (H + H.T) / 2, rtol=0, atol=2e-5 * float(H.abs().max()))


class _Swapped(torch.nn.Module):
    """``model`` with its parameter ``name`` replaced by ``value`` (for torch.func.hessian)."""

    def __init__(self, model, name, value):
        super().__init__()
        self.inner, self.name, self.value = model, name, value

    def __call__(self, *args, **kwargs):
        return functional_call(self.inner, {self.name: self.value}, args, kwargs)
