"""bf16 / fp16 models: captured in their dtype, accumulated in float32 (kernels) and float64
(statistics). The error against the float64 oracle is the model's own rounding, not gradalg's.

Measured on this GPT-2 (2 layers, width 32, 8 training sequences of 4-12 tokens, 4 queries;
relative Frobenius errors against the same weights in float64):

=========  ============  ===========  ===========================
dtype      Grad-Dot      Fisher       unit roundoff u = 2^-(p+1)
=========  ============  ===========  ===========================
bfloat16   5.8e-3        1.0e-2       3.9e-3   (p = 8 bits)
float16    8.1e-4        1.2e-3       4.9e-4   (p = 11 bits)
float32    2.0e-7        2.9e-7       6.0e-8
=========  ============  ===========  ===========================

Errors are 1.5-2.6 u: each activation and output gradient is rounded once to the model's
precision (≈ u each) on top of a forward and backward run in that precision. The
tolerance is 8 u. The kernels' own contribution is checked separately: on the same
half-precision factors, gradalg's inner products equal float64 arithmetic to float32
accuracy, which sums rounded to bf16 would not.
"""
import copy

import pytest
import torch

import gradalg as ga
from gradalg.capture.factors import Factors, ghost_inner, materialize, self_inner
from gradalg.exec.local import LocalExecutor
from references import one_thread  # noqa: F401 - one intra-op thread per test module
from models import lm_loss, padded_token_data

VOCAB = 53
LAYERS = ["transformer.h.*.mlp.c_fc", "transformer.h.*.attn.c_attn", "lm_head"]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
TOL = {dt: 8 * u for dt, u in UNIT_ROUNDOFF.items()}


@pytest.fixture(scope="module")
def setup():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).double().eval()
    data = padded_token_data(n=8, vocab=VOCAB, min_len=4, max_len=12, seed=1)
    queries = padded_token_data(n=4, vocab=VOCAB, min_len=4, max_len=12, seed=2)
    return model, data, queries, scores(model, data, queries), fisher(model, data)


def task_of(model):
    return ga.Task(model, lm_loss, token_mask=lambda b: b[1].bool())


def scores(model, data, queries):
    t = task_of(model)
    S = ga.grads(t, queries, layers=LAYERS) @ ga.grads(t, data, layers=LAYERS).T
    return torch.as_tensor(S.compute().values)


def fisher(model, data):
    G = ga.grads(task_of(model), data, layers=["transformer.h.1.mlp.c_fc"])
    return LocalExecutor().resolve(ga.fisher(G).expr).data


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_grad_dot_and_fisher_against_float64(setup, dtype):
    model64, data, queries, S64, F64_ = setup
    model = copy.deepcopy(model64).to(dtype)
    G = ga.grads(task_of(model), data, layers=LAYERS)
    chunk = LocalExecutor().gradients(G.expr)
    assert all(f.D.dtype == dtype for f in chunk.blocks.values())        # captured in the model's dtype
    S = scores(model, data, queries)
    assert S.dtype == torch.float32                                       # accumulated in float32
    F = fisher(model, data)
    assert F.dtype == torch.float64                                       # statistics in float64
    assert rel(S, S64) < TOL[dtype]
    assert rel(F, F64_) < TOL[dtype]
    # and not better than the model's precision allows: the test would see a float64 shortcut
    assert rel(S, S64) > 0.1 * UNIT_ROUNDOFF[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ghost_and_dense_agree_in_half_precision(setup, dtype):
    model64, data, queries, _, _ = setup
    model = copy.deepcopy(model64).to(dtype)
    with ga.options(ghost="always"):
        ghost = scores(model, data, queries)
    with ga.options(ghost="never"):
        dense = scores(model, data, queries)
    assert rel(ghost, dense) < 1e-5      # both float32 sums of the same half-precision factors


def test_capture_of_a_bf16_model_matches_grads(setup):
    model64, data, _, _, _ = setup
    model = copy.deepcopy(model64).to(torch.bfloat16)
    with ga.capture(model, layers=LAYERS) as cap:
        model.zero_grad()
        lm_loss(model, data).backward()
    G = ga.grads(task_of(model), data, layers=LAYERS, batch_size=8)
    assert rel(torch.as_tensor((cap.grads @ cap.grads.T).compute().values),
               torch.as_tensor((G @ G.T).compute().values)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_accumulate_half_factors_in_float32(dtype):
    g = torch.Generator().manual_seed(0)
    L = Factors(torch.randn(3, 64, 48, generator=g).to(dtype), torch.randn(3, 64, 40, generator=g).to(dtype))
    R = Factors(torch.randn(4, 64, 48, generator=g).to(dtype), torch.randn(4, 64, 40, generator=g).to(dtype))
    exact = ghost_inner(Factors(L.A.double(), L.D.double()), Factors(R.A.double(), R.D.double()))
    got = ghost_inner(L, R)
    assert got.dtype == torch.float32 and rel(got, exact) < 1e-5
    dense = materialize(L)
    assert dense.dtype == torch.float32
    assert rel(dense, materialize(Factors(L.A.double(), L.D.double()))) < 1e-6
    assert rel(self_inner(L), (materialize(Factors(L.A.double(), L.D.double())) ** 2).sum((1, 2))) < 1e-5
    # what sums kept in the half dtype would give: visibly worse than float32 accumulation
    naive = torch.einsum("nto,nti->noi", L.D, L.A)
    assert rel(naive, materialize(Factors(L.A.double(), L.D.double()))) > 10 * rel(dense, materialize(
        Factors(L.A.double(), L.D.double())))


@pytest.mark.parametrize("damping", [1e-4, 1e-1])
def test_half_precision_influence_adds_no_error_of_its_own(setup, damping):
    """Empirical-Fisher influence on the bf16 model equals a float64 solve from that model's
    own bf16 per-example gradients (loop of backward) to within the capture's rounding:
    what inverting (F + λI) does to the model's rounding is the model's, not gradalg's
    (``benchmarks/low_precision_damping.py`` tabulates both by damping)."""
    from gradalg.capture.reference import per_example_grads
    model64, data, queries, _, _ = setup
    model = copy.deepcopy(model64).to(torch.bfloat16)
    layers = ["transformer.h.1.mlp.c_fc"]
    names = [n for n, _ in model.named_parameters() if n.startswith(layers[0] + ".")]

    def rows(batch):
        g = per_example_grads(task_of(model), batch, names, method="loop")
        return torch.cat([g[n].reshape(g[n].shape[0], -1).double() for n in names], 1)

    G, Q = rows(data), rows(queries)
    n = G.shape[0]
    own = Q @ G.T @ torch.linalg.inv(G @ G.T / n + damping * torch.eye(n, dtype=G.dtype))   # Woodbury
    t = task_of(model)
    Gs, Qs = ga.grads(t, data, layers=layers), ga.grads(t, queries, layers=layers)
    S = Qs @ ga.fisher(Gs).damp(damping).inv() @ Gs.T
    got = torch.as_tensor(S.compute().values)
    assert rel(got, own) < TOL[torch.bfloat16]
