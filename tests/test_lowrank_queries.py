"""Low-rank query gradients (``G.low_rank(r)``, ``query_gradient_rank=``) against a dense reference.

The reference knows nothing of factors or of gradalg's kernels: per-example gradients from
torch.func (``references.reference_rows``), each query's (out, in) block truncated by
``torch.linalg.svd`` in plain torch (U_k Σ_k V_kᵀ, k = min(r, out, in)), and inner products
summed over blocks. Preconditioned queries (influence) take their exact rows H⁻¹q from
gradalg's exact expression ``(Q @ H⁻¹).to_dense()`` (tested against dense references
elsewhere): what is under test here is the truncation, the held factors and their scores.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.plan import DecisionKind
from gradalg.errors import PerTokenError
from gradalg.methods.influence import curvature_operator
from gradalg.plan.jobs import ScoresJob
from gradalg.plan.planner import plan
from gradalg.plan.rules import simplify_until_fixpoint
from models import classification_data, gpt2, lm_task, mlp, padded_token_data
from references import one_thread, reference_rows  # noqa: F401

F64 = torch.float64
TIGHT = dict(rtol=1e-9, atol=1e-11)
GPT2_LAYERS = ["transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc",
               "transformer.h.0.mlp.c_proj", "lm_head"]


# ---------------------------------------------------------------------- the reference
def truncate_rows(rows: torch.Tensor, space, rank: int) -> torch.Tensor:
    """(n, dim) rows with each (out, in) block replaced by its rank-min(r, out, in) SVD truncation."""
    parts, off = [], 0
    for b in space.blocks:
        block = rows[:, off:off + b.dim]
        off += b.dim
        if len(b.shape) != 2:
            parts.append(block)
            continue
        out_f, in_f = b.shape
        k = min(rank, out_f, in_f)
        U, S, Vh = torch.linalg.svd(block.reshape(-1, out_f, in_f).to(F64), full_matrices=False)
        parts.append(((U[:, :, :k] * S[:, None, :k]) @ Vh[:, :k]).flatten(1))
    return torch.cat(parts, dim=1)


def dense_rows(G: ga.GradientSet) -> torch.Tensor:
    blocks = G.to_dense()
    return torch.cat([blocks[name].flatten(1) for name in G.layers], dim=1).to(F64)


# ---------------------------------------------------------------------- setups
@pytest.fixture(scope="module")
def lm():
    """A tiny GPT-2 (random weights, float64), right-padded sequences with an attention mask,
    an embedding (one-hot inputs), attention, MLP and head blocks."""
    model = gpt2(n_layer=1, n_embd=16, vocab=31)
    ids, mask = padded_token_data(n=9, vocab=31, min_len=3, max_len=9)
    task = lm_task(model)
    train, query = (ids[:6], mask[:6]), (ids[6:], mask[6:])
    G = ga.grads(task, train, GPT2_LAYERS, batch_size=4)     # chunks of 4 and 2
    Q = ga.grads(task, query, GPT2_LAYERS)
    return dict(task=task, train=train, query=query, G=G, Q=Q,
                RG=reference_rows(task, train, GPT2_LAYERS), RQ=reference_rows(task, query, GPT2_LAYERS))


@pytest.fixture(scope="module")
def cls():
    model = mlp(d_in=8, hidden=16, classes=3)
    task = ga.tasks.classification(model)
    train, query = classification_data(12, seed=1), classification_data(4, seed=2)
    return dict(task=task, train=train, query=query, G=ga.grads(task, train, ["0", "2"], batch_size=5),
                Q=ga.grads(task, query, ["0", "2"]), RG=reference_rows(task, train, ("0", "2")))


# ---------------------------------------------------------------------- scores
@pytest.mark.parametrize("rank", [1, 3, 16])
@pytest.mark.parametrize("ghost", ["auto", "always", "never"])
def test_rank_r_scores_equal_the_svd_reference(lm, rank, ghost):
    """Grad-Dot with rank-r queries on a padded GPT-2: both kernels (ghost over the rank-r
    factors, dense from the factors materialized once) give the reference's numbers. At rank
    16 every query has at most 9 positions (rank ≤ 9): its factors are kept, exactly."""
    with ga.options(ghost=ghost):
        S = (lm["Q"].low_rank(rank) @ lm["G"].T).compute()
    ref = truncate_rows(lm["RQ"], lm["Q"].space, rank) @ lm["RG"].T
    np.testing.assert_allclose(S.values, ref.numpy(), **TIGHT)
    exact = (lm["RQ"] @ lm["RG"].T).numpy()
    if rank < 9:
        assert np.abs(S.values - exact).max() > 1e-6 * np.abs(exact).max()   # it does truncate


def test_rank_at_least_min_out_in_is_the_exact_scores(lm):
    """r ≥ min(out, in) of every block: the rule ``full_rank_approximation`` removes the node;
    the scores are the exact ones (and the plan is the exact plan)."""
    r = max(min(b.shape) for b in lm["Q"].space.blocks)
    S = lm["Q"].low_rank(r) @ lm["G"].T
    p = plan(S.expr)
    assert "full_rank_approximation" in [f.rule for f in p.fired]
    exact = (lm["Q"] @ lm["G"].T).compute().values
    np.testing.assert_allclose(S.compute().values, exact, **TIGHT)
    np.testing.assert_allclose(exact, (lm["RQ"] @ lm["RG"].T).numpy(), **TIGHT)


def test_factored_rows_of_rank_at_most_r_are_kept(cls):
    """An MLP's per-example gradients are rank one (T = 1): rank 1 keeps them exactly."""
    S = ga.methods.grad_dot(cls["task"], cls["train"], cls["query"], layers=["0", "2"], query_gradient_rank=1)
    RQ = reference_rows(cls["task"], cls["query"], ("0", "2"))
    np.testing.assert_allclose(S.compute().values, (RQ @ cls["RG"].T).numpy(), **TIGHT)


@pytest.mark.parametrize("rank", [1, 2])
def test_ekfac_influence_with_query_gradient_rank_equals_reference(cls, rank):
    """EK-FAC influence on an MLP: the preconditioned queries H⁻¹q (dense rows) truncated."""
    task, train, query = cls["task"], cls["train"], cls["query"]
    S = ga.methods.influence(task, train, query, layers=["0", "2"], curvature="ekfac", query_gradient_rank=rank)
    Hinv = curvature_operator(task, train, layers=["0", "2"], curvature="ekfac")
    HQ = dense_rows(cls["Q"] @ Hinv)
    ref = truncate_rows(HQ, cls["Q"].space, rank) @ cls["RG"].T
    np.testing.assert_allclose(S.compute().values, ref.numpy(), **TIGHT)
    exact = ga.methods.influence(task, train, query, layers=["0", "2"], curvature="ekfac").compute().values
    np.testing.assert_allclose(exact, (HQ @ cls["RG"].T).numpy(), **TIGHT)
    big = ga.methods.influence(task, train, query, layers=["0", "2"], curvature="ekfac", query_gradient_rank=16)
    np.testing.assert_allclose(big.compute().values, exact, **TIGHT)


def test_ekfac_preconditioned_gpt2_queries(lm):
    """EK-FAC on the padded GPT-2, the held side ``(Q @ H⁻¹).low_rank(2)``."""
    Hinv = ga.ekfac(lm["G"]).damp(0.1).inv()
    S = ((lm["Q"] @ Hinv).low_rank(2) @ lm["G"].T).compute()
    HQ = dense_rows(lm["Q"] @ Hinv)
    ref = truncate_rows(HQ, lm["Q"].space, 2) @ lm["RG"].T
    np.testing.assert_allclose(S.values, ref.numpy(), **TIGHT)


def test_float32_model(lm):
    """A float32 GPT-2: rank-r scores match the float64 reference of the same weights."""
    model = gpt2(n_layer=1, n_embd=16, vocab=31, dtype=torch.float32)
    task = lm_task(model)
    G = ga.grads(task, lm["train"], GPT2_LAYERS, batch_size=4)
    Q = ga.grads(task, lm["query"], GPT2_LAYERS)
    S = (Q.low_rank(3) @ G.T).compute().values
    ref = (truncate_rows(lm["RQ"], Q.space, 3) @ lm["RG"].T).numpy()
    np.testing.assert_allclose(S, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


# ---------------------------------------------------------------------- per-token rows
def test_per_token_training_rows_against_low_rank_queries(lm):
    """Per-token training rows (rank one each) streamed against rank-r queries sum to the
    per-example scores; per-token query rows are rank one, so low_rank keeps them exactly."""
    Q2 = lm["Q"].low_rank(2)
    per_tok = (Q2 @ lm["G"].per_token().T).compute()
    np.testing.assert_allclose(np.nansum(per_tok.values, axis=-1), (Q2 @ lm["G"].T).compute().values, **TIGHT)
    q_tok = (lm["Q"].per_token().low_rank(1) @ lm["G"].T).compute()
    np.testing.assert_allclose(q_tok.values, (lm["Q"].per_token() @ lm["G"].T).compute().values,
                               equal_nan=True, **TIGHT)
    with pytest.raises(PerTokenError, match="per-token rows need factored gradients straight from capture"):
        Q2.per_token()


# ---------------------------------------------------------------------- plan: memory and display
def test_held_bytes_and_kernel_cost_reflect_the_rank(lm):
    Q, G = lm["Q"], lm["G"]
    sizes = {}
    for r in (1, 4):
        p = plan((Q.low_rank(r) @ G.T).expr)
        job = next(j for j in p.jobs.values() if isinstance(j, ScoresJob))
        want = 0
        for b in Q.space.blocks:
            out_f, in_f = b.shape
            want += r * (out_f + in_f) if min(b.shape) > r else min(out_f * in_f, 9 * (out_f + in_f))
        # held rows: r·(out + in) per truncated block; untruncated blocks keep their factors
        # (T = 9 positions) or flat rows, whichever is smaller
        assert job.held_storage and p.decisions
        from gradalg.plan.memory import rows_bytes
        got = rows_bytes(job.held, job.held_storage, p.facts)
        assert got == Q.n * want * 8, (r, got, Q.n * want * 8)
        sizes[r] = got
        d = p.decisions.one(DecisionKind.LOW_RANK)
        assert d.chosen == f"rank-{r} factors"
    assert sizes[1] < sizes[4]
    text = str((Q.low_rank(4) @ G.T).explain())
    assert "rank-4 factors" in text and "rank-4 approximation" in text


def test_kernel_is_costed_with_r_held_positions(lm):
    """The ghost kernel's estimate uses r held positions (rank 1 costs less than rank 4)."""
    def ghost_seconds(r):
        with ga.options(ghost="always"):
            p = plan((lm["Q"].low_rank(r) @ lm["G"].T).expr)
        d = p.decisions.one(DecisionKind.KERNEL, block="transformer.h.0.mlp.c_fc")
        return d.alternatives["ghost"]
    assert ghost_seconds(1) < ghost_seconds(4)


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4", None])
def test_bad_rank_is_refused(lm, cls, bad):
    with pytest.raises(ValueError, match="positive int"):
        lm["Q"].low_rank(bad)
    if bad is not None:
        with pytest.raises(ValueError, match="positive int"):
            ga.methods.influence(cls["task"], cls["train"], cls["query"], curvature="ekfac", query_gradient_rank=bad)
        with pytest.raises(ValueError, match="positive int"):
            ga.methods.grad_dot(cls["task"], cls["train"], cls["query"], query_gradient_rank=bad)


def test_space_without_matrices_is_refused(cls):
    P = ga.proj.gaussian(8, seed=0)
    with pytest.raises(ValueError, match="no block of this space is a matrix"):
        P(cls["Q"]).low_rank(2)


def test_query_pass_prices_one_svd_per_query_and_truncated_block(lm):
    """The collect pass of the held rank-r rows counts a thin SVD (an eigensolve of width
    min(out, in)) for each query and each block it truncates, and none for blocks it keeps."""
    Q, G = lm["Q"], lm["G"]
    p = plan((Q.low_rank(3) @ G.T).expr)
    collect = next(ps for ps in p.passes if any(j.kind == "collect" for j in ps.jobs))
    eighs = sorted((int(d), int(c)) for d, c in collect.cost.eighs)
    want = sorted((min(b.shape), Q.n) for b in Q.space.blocks if min(b.shape) > 3)
    assert eighs == want
    exact = plan((Q @ G.T).expr)
    collect0 = next(ps for ps in exact.passes if any(j.kind == "collect" for j in ps.jobs))
    assert collect0.cost.eighs == () and collect.seconds > collect0.seconds


def test_logra_with_query_gradient_rank(cls):
    """LoGra on the MLP: Kronecker-projected blocks (k = 16 per layer), the preconditioned
    projected queries truncated to rank 1."""
    task, train, query = cls["task"], cls["train"], cls["query"]
    S = ga.methods.logra(task, train, query, layers=["0", "2"], k=16, query_gradient_rank=1)
    exact = ga.methods.logra(task, train, query, layers=["0", "2"], k=16)
    inner, _ = simplify_until_fixpoint(exact.expr)     # Inner(P(Q), H⁻¹, P(G))
    PQ, PG = ga.GradientSet(inner.left), ga.GradientSet(inner.right)
    assert any(len(b.shape) == 2 and min(b.shape) > 1 for b in PQ.space.blocks)
    HQ = dense_rows(PQ @ ga.Operator(inner.op))
    ref = truncate_rows(HQ, PQ.space, 1) @ dense_rows(PG).T
    got = S.compute().values
    np.testing.assert_allclose(got, ref.numpy(), **TIGHT)
    assert np.abs(got - exact.compute().values).max() > 1e-6 * np.abs(got).max()
