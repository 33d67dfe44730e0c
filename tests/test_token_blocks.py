"""Kernels over factors in token blocks (``ga.options(token_block=...)``): the same numbers
as one block of all positions, with temporaries bounded independently of T.

A GPT-2 with T = 256 positions and blocks of 32 (8 blocks per example, 64 pairs of
blocks for the ghost kernel); every method family's scores with blocks equal the scores
with one block to float64 rounding (rtol 1e-10): ghost and dense Grad-Dot (embedding
rows as one-hot factors included), Grad-Cos (ghost norms), Kronecker and sparse
projections, K-FAC and EK-FAC influence.
"""
import pytest
import torch

import gradalg as ga
from gradalg.plan import DecisionKind
from gradalg.plan.shapes import ModelFacts
from gradalg.capture import factors as F_mod
from gradalg.capture.factors import Factors, OneHot, ghost_inner, ghost_workspace_elements, materialize, self_inner
from gradalg.curvature.kron import KronStats
from gradalg.linalg.kron import rotate_factors
from references import one_thread  # noqa: F401 - one intra-op thread per test module
from models import lm_loss

VOCAB, T, BLOCK = 53, 256, 32
LAYERS = ["transformer.wte", "transformer.h.*.mlp.c_fc", "transformer.h.*.attn.c_proj", "lm_head"]
ONE_BLOCK = 10**9      # token_block larger than any T: the unblocked kernels


@pytest.fixture(scope="module")
def setup():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=T, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     tie_word_embeddings=False)
    model = GPT2LMHeadModel(cfg).double().eval()
    g = torch.Generator().manual_seed(1)

    def data(n):
        lengths = torch.randint(T // 2, T + 1, (n,), generator=g)
        mask = torch.arange(T)[None, :] < lengths[:, None]
        return torch.randint(1, VOCAB, (n, T), generator=g).masked_fill(~mask, 0), mask.long()
    task = ga.Task(model, lm_loss, token_mask=lambda b: b[1].bool())
    return task, data(4), data(3)


def run(expr_fn, token_block, **opts):
    with ga.options(token_block=token_block, progress=False, **opts):
        ex = ga.exec.LocalExecutor()
        out = torch.as_tensor(expr_fn().compute(executor=ex).values)
    return out, ex


def grads(setup, layers=LAYERS):
    task, train, queries = setup
    return ga.grads(task, queries, layers=layers), ga.grads(task, train, layers=layers)


def assert_blocked_equal(expr_fn, **opts):
    blocked, ex = run(expr_fn, BLOCK, **opts)
    whole, _ = run(expr_fn, ONE_BLOCK, **opts)
    assert blocked.abs().max() > 0
    torch.testing.assert_close(blocked, whole, rtol=1e-10, atol=1e-12 * float(whole.abs().max()))
    return ex


@pytest.mark.parametrize("ghost", ["always", "never"])
def test_grad_dot_ghost_and_dense(setup, ghost):
    Q, G = grads(setup)
    # small slices: the ghost kernel also slices examples of both sides within a pair of blocks
    ex = assert_blocked_equal(lambda: Q @ G.T, ghost=ghost, ghost_slice_elements=2**11)
    assert ex.trace["ghost" if ghost == "always" else "dense"] > 0


def test_grad_cos_norms_by_blocks(setup):
    Q, G = grads(setup)
    ex = assert_blocked_equal(lambda: Q @ G.normalize().T, ghost="always")
    assert ex.trace["ghost"] > 0


def test_self_scores_and_normalized_rows(setup):
    """‖G_i‖² of a self-score (the diagonal S_ii, ghost norms in blocks) and rows
    normalized before a dense product (norms by blocks in the row-wise step)."""
    _, G = grads(setup)
    assert_blocked_equal(lambda: (G @ G.T).diag(), ghost="always", ghost_slice_elements=2**11)
    assert_blocked_equal(lambda: G.normalize() @ G.normalize().T, ghost="never")


@pytest.mark.parametrize("make", [lambda: ga.proj.kron(k=6, seed=0), lambda: ga.proj.sparse(64, seed=0),
                                  lambda: ga.proj.grass(32, seed=0), lambda: ga.proj.factgrass(32, seed=0)],
                         ids=["kron", "sparse", "grass", "factgrass"])
def test_projections(setup, make):
    Q, G = grads(setup, layers=LAYERS[1:])
    P = make()
    assert_blocked_equal(lambda: P(Q) @ P(G).T, ghost="never")


@pytest.mark.parametrize("fn", [ga.kfac, ga.ekfac], ids=["kfac", "ekfac"])
def test_kron_influence(setup, fn):
    Q, G = grads(setup, layers=LAYERS[1:])
    assert_blocked_equal(lambda: Q @ fn(G).damp(1e-3).inv() @ G.T)


def test_kron_projected_kfac_statistics(setup):
    Q, G = grads(setup, layers=LAYERS[1:])
    P = ga.proj.kron(k=6, seed=0)
    assert_blocked_equal(lambda: P(Q) @ ga.ekfac(P(G)).damp(1e-3).inv() @ P(G).T)


# kernels on factors directly: equal numbers, and the largest intermediate they allocate

def random_factors(n, T_, n_in, n_out, one_hot=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if one_hot:
        valid = torch.rand(n, T_, generator=g) > 0.2
        A = OneHot(torch.randint(0, n_in, (n, T_), generator=g), n_in, valid)
    else:
        A = torch.randn(n, T_, n_in, generator=g, dtype=torch.float64)
    return Factors(A, torch.randn(n, T_, n_out, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("one_hot", [False, True])
def test_kernels_equal_unblocked(one_hot):
    L, R = random_factors(3, 100, 7, 5, one_hot, 1), random_factors(4, 70, 7, 5, one_hot, 2)
    torch.testing.assert_close(ghost_inner(L, R, 2**10, 16), ghost_inner(L, R), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(self_inner(L, 2**8, 16), self_inner(L), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(self_inner(L), (materialize(L) ** 2).sum((1, 2)), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(materialize(L, 16), materialize(L), rtol=1e-12, atol=1e-12)
    P_out, P_in = torch.randn(3, 5, dtype=torch.float64), torch.randn(4, 7, dtype=torch.float64)
    torch.testing.assert_close(F_mod.kron_project(L, P_out, P_in, 16), P_out @ materialize(L) @ P_in.T)
    Q_S, Q_A = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))[0], torch.linalg.qr(
        torch.randn(7, 7, dtype=torch.float64))[0]
    torch.testing.assert_close(rotate_factors(L, Q_S, Q_A, 16), Q_S.T @ materialize(L) @ Q_A)
    whole, blocked = KronStats(), KronStats()
    whole.update(L)
    blocked.update(L, 16)
    for a, b in zip(whole.covariances(), blocked.covariances()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert whole.tokens == blocked.tokens


def test_ghost_intermediates_bounded_independently_of_T(monkeypatch):
    """The (nL', nR', bL, bR) intermediates the ghost kernel allocates: the same largest size
    for T = 64 and T = 512, at most max(max_elements, token_block²), as the plan counts."""
    seen = []
    real = F_mod._act_gram

    def spy(AL, AR, dtype):
        out = real(AL, AR, dtype)
        seen.append(out.numel())
        return out
    monkeypatch.setattr(F_mod, "_act_gram", spy)
    largest = {}
    for T_ in (64, 512):
        seen.clear()
        L, R = random_factors(4, T_, 6, 5, seed=3), random_factors(6, T_, 6, 5, seed=4)
        ghost_inner(L, R, max_elements=4096, token_block=32)
        largest[T_] = max(seen)
        assert largest[T_] <= ghost_workspace_elements(4, 6, T_, T_, 4096, 32) <= max(4096, 32 * 32)
    assert largest[64] == largest[512]


def test_plan_shows_and_counts_token_blocks(setup):
    """The ghost decision names the token block; the scores job's ghost workspace is the
    same for any T above the block (counted by ScoresJob.ghost_workspace_bytes)."""
    Q, G = grads(setup)
    with ga.options(ghost="always", token_block=BLOCK, progress=False):
        plan = ga.exec.LocalExecutor().plan((Q @ G.T).expr)
    assert any(f"pairs of blocks of {BLOCK} positions" in d.reason for d in plan.decisions.of(DecisionKind.KERNEL))
    job = next(j for j in plan.jobs.values() if j.kind == "scores")
    assert job.token_block == BLOCK
    facts = ModelFacts(dtype=torch.float64, shapes=plan.facts.shapes)         # the plan's shapes, float64 rows
    assert job.ghost_workspace_bytes(facts) == 3 * 8 * min(
        job.slice_elements, job.held.n * job.streams[0].n * BLOCK * BLOCK)
    with pytest.raises(ga.errors.OptionError):
        ga.options(token_block=0)


def test_unblocked_ghost_workspace_is_refused_where_blocks_fit(setup):
    """Under a 4 MB budget the ghost kernel's unblocked (3, 4, 256, 256) intermediates
    (3 × 6.3 MB) are refused before anything runs; blocks of 32 positions fit."""
    Q, G = grads(setup, layers=LAYERS[1:])
    with ga.options(ghost="always", memory_budget="4MB", token_block=ONE_BLOCK, progress=False):
        with pytest.raises(ga.errors.MemoryBudgetError, match="over the memory budget"):
            ga.exec.LocalExecutor().plan((Q @ G.T).expr)
    with ga.options(ghost="always", memory_budget="4MB", token_block=BLOCK, progress=False):
        assert ga.exec.LocalExecutor().plan((Q @ G.T).expr).peak_bytes <= 4 * 2**20
