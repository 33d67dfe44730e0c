"""Projections: determinism, the matrices behind them, and what they preserve.

References are computed in float64 torch from ``ga.per_example_grads`` and the
projector's own matrices (``ga.proj.dense_matrix`` / ``ga.proj.kron_matrices``).
"""
from __future__ import annotations

import functools
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import gradalg as ga
from gradalg.capture import chunks as capture_chunks
from gradalg.proj import matrices
from gradalg.testing import assert_close
from gradalg.testing.conformance import project_dense

sys.path.insert(0, os.path.dirname(__file__))
import models
from references import one_thread, reference_rows  # noqa: F401 - one_thread is an autouse fixture

F64 = torch.float64
TIGHT = {"rtol": 1e-9, "atol": 1e-11}

KINDS = {
    "gaussian": lambda k, s: ga.proj.gaussian(k, s),
    "gaussian_per_block": lambda k, s: ga.proj.gaussian(k, s, per_block=True),
    "rademacher": lambda k, s: ga.proj.rademacher(k, s),
    "rademacher_per_block": lambda k, s: ga.proj.rademacher(k, s, per_block=True),
    "kron": lambda k, s: ga.proj.kron(k, s),
}


@functools.cache
def mlp():
    model = models.mlp()
    task = ga.tasks.classification(model)
    train = models.classification_data(12)
    query = models.classification_data(5, seed=7)
    G = ga.grads(task, train, ["0", "2"], batch_size=5)
    Q = ga.grads(task, query, ["0", "2"], batch_size=5)
    return G, Q, reference_rows(task, train, ("0", "2")), reference_rows(task, query, ("0", "2"))


@functools.cache
def gpt2():
    model = models.gpt2(n_layer=1, n_embd=16, vocab=31)
    task = models.lm_task(model)
    data = models.padded_token_data(n=4, vocab=31, max_len=6)
    layers = ["transformer.wte", "transformer.h.0.attn.c_attn", "lm_head"]
    return ga.grads(task, data, layers, batch_size=3), reference_rows(task, data, layers)


@functools.cache
def captured_pair():
    """Two gradient rows recorded once by ``ga.capture`` (projecting them runs no model)."""
    model = models.mlp(6, 10, 4, seed=9)
    x, y = models.classification_data(2, 6, 4, seed=10)
    with ga.capture(model, ["0", "2"]) as cap:
        F.cross_entropy(model(x), y, reduction="sum").backward()
    return cap.grads


def rows(G, executor=None) -> torch.Tensor:
    dense = G.to_dense(executor)
    return torch.cat([dense[n].reshape(G.n, -1).to(F64) for n in G.space.names], dim=1)


def clear_matrix_caches():
    matrices.clear_caches()


# ---------------------------------------------------------------------- determinism
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_same_seed_same_numbers_across_fresh_executors(kind):
    G = mlp()[0]
    first = rows(KINDS[kind](6, 123)(G), ga.LocalExecutor())
    clear_matrix_caches()   # the matrices are drawn again, not reused from the cache
    again = rows(KINDS[kind](6, 123)(G), ga.LocalExecutor())
    assert torch.equal(first, again)
    other = rows(KINDS[kind](6, 124)(G), ga.LocalExecutor())
    assert not torch.allclose(first, other, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_projection_does_not_depend_on_chunking(kind):
    """The same rows projected in chunks of 5 or in one chunk of 12 give the same numbers."""
    G, _, R, _ = mlp()
    P = KINDS[kind](6, 3)
    one_chunk = ga.grads(G.expr.source.task, models.classification_data(12), ["0", "2"], batch_size=12)
    assert_close(rows(P(G)), rows(P(one_chunk)), what="chunks of 5 vs one chunk", **TIGHT)
    assert_close(rows(P(G)), project_dense(R, G.space, P), what="vs reference", **TIGHT)


def test_equal_projectors_are_equal_nodes():
    G = mlp()[0]
    assert ga.proj.kron(8, 1) == ga.proj.kron(8, 1)
    assert ga.proj.kron(8, 1)(G) == ga.proj.kron(8, 1)(G)
    assert ga.proj.kron(8, 1)(G).expr.token == ga.proj.kron(8, 1)(G).expr.token
    assert ga.proj.kron(8, 1)(G) != ga.proj.kron(8, 2)(G)
    assert ga.proj.gaussian(8, 1)(G) != ga.proj.gaussian(8, 1, per_block=True)(G)
    assert ga.proj.gaussian(8, 1)(G) != ga.proj.rademacher(8, 1)(G)


def test_blocks_get_independent_matrices():
    P = ga.proj.gaussian(4, seed=0)
    a = matrices.dense_matrix(P, "fc1", 50, dtype=F64)
    b = matrices.dense_matrix(P, "fc2", 50, dtype=F64)
    assert not torch.allclose(a, b)
    P_out, P_in = matrices.kron_matrices(ga.proj.kron(4, 0), "fc1", 9, 9, dtype=F64)
    assert not torch.allclose(P_out, P_in)


def test_block_seed_is_stable_across_processes():
    """Seeds come from crc32 of the block name, not the salted ``hash()``: fixed numbers."""
    import zlib

    P = ga.proj.gaussian(4, seed=7)
    assert P.block_seed("fc1") == (7 * 1_000_003 + zlib.crc32(b"fc1/")) % 2**63
    assert P.block_seed("fc1", "in") != P.block_seed("fc1", "out")


@pytest.mark.parametrize("bad", [
    lambda: ga.proj.gaussian(0),
    lambda: ga.proj.Projector("orthogonal", 4),
    lambda: ga.proj.kron(12, k_out=3),
    lambda: ga.proj.kron(12, k_out=5, k_in=2),
])
def test_projector_validation(bad):
    with pytest.raises(ValueError):
        bad()


# ---------------------------------------------------------------------- the matrices
def test_matrix_entries():
    k, d = 64, 400
    g = matrices.dense_matrix(ga.proj.gaussian(k, 1), "b", d, dtype=F64)
    assert g.shape == (k, d)
    assert abs(float(g.mean())) < 4 / math.sqrt(k * d) / math.sqrt(k)
    assert float(g.var() * k) == pytest.approx(1.0, rel=0.03)   # N(0, 1/k)
    r = matrices.dense_matrix(ga.proj.rademacher(k, 1), "b", d, dtype=F64)
    assert torch.equal(r.abs(), torch.full_like(r, 1 / math.sqrt(k)))  # ±1/√k
    assert abs(float((r > 0).double().mean()) - 0.5) < 0.02


def test_global_gaussian_is_one_matrix_on_the_concatenated_gradient():
    """per_block=False: one (k, dim) matrix M, P(G) = R Mᵀ for every set and chunking."""
    G, Q, RG, RQ = mlp()
    P = ga.proj.gaussian(7, seed=5)
    M = torch.cat([matrices.dense_matrix(P, b.name, b.dim, dtype=F64) for b in G.space.blocks], dim=1)
    assert M.shape == (7, G.space.dim)
    PG = P(G)
    assert PG.space.names == ("projected",) and PG.space.dim == 7
    assert_close(rows(PG), RG @ M.T, what="P(G) = G Mᵀ", **TIGHT)
    assert_close(rows(P(Q)), RQ @ M.T, what="P(Q) = Q Mᵀ", **TIGHT)
    # the per-block projection uses the same column blocks, each its own k coordinates
    Pb = ga.proj.gaussian(7, seed=5, per_block=True)
    per_block = rows(Pb(G))
    assert_close(per_block[:, :7] + per_block[:, 7:], RG @ M.T, what="Σ per-block = global", **TIGHT)


@pytest.mark.parametrize("case", ["mlp", "gpt2"])
def test_kron_projection_of_factors(case, monkeypatch):
    """P_out G_i P_inᵀ from the factors equals the projection of the materialized reference,
    and no layer-sized (out, in) gradient is ever formed."""
    G, R = (mlp()[0], mlp()[2]) if case == "mlp" else gpt2()
    P = ga.proj.kron(6, seed=2)
    formed = []
    real = capture_chunks.materialize

    def spy(factors):
        out = real(factors)
        formed.append(tuple(out.shape[1:]))
        return out

    monkeypatch.setattr(capture_chunks, "materialize", spy)
    ex = ga.LocalExecutor()
    got = rows(P(G), ex)
    offsets = G.space.offsets()
    expected = []
    for b in G.space.blocks:
        P_out, P_in = ga.proj.kron_matrices(P, b.name, *b.shape, dtype=F64)
        assert P_out.shape == (P.kron_shape(*b.shape)[0], b.shape[0])
        block = R[:, offsets[b.name]].reshape(-1, *b.shape)
        expected.append((P_out @ block @ P_in.T).flatten(1))
    assert_close(got, torch.cat(expected, 1), what="kron projection", rtol=1e-9, atol=1e-10)
    assert ex.trace["kron_factored"] > 0
    layer_shapes = {b.shape for b in G.space.blocks}
    assert not layer_shapes & set(formed), f"a full layer gradient was materialized: {formed}"


# ---------------------------------------------------------------------- statistics
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_inner_products_preserved_in_expectation(kind):
    """E_P[⟨Px, Py⟩] = ⟨x, y⟩ and E_P‖Px‖² = ‖x‖²: the mean over 150 seeds lies within 5
    standard errors (deterministic: the seeds are fixed)."""
    G = captured_pair()
    x, y = rows(G)
    samples = []
    for seed in range(150):
        px, py = rows(KINDS[kind](8, seed)(G))
        samples.append(torch.stack([px @ py, px @ px, py @ py]))
    samples = torch.stack(samples)
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(len(samples))
    truth = torch.stack([x @ y, x @ x, y @ y])
    assert ((mean - truth).abs() < 5 * se + 1e-12).all(), (mean, truth, se)
    # and the estimate is informative: relative spread well below 1 for the norms
    assert (se[1:] / truth[1:] < 0.15).all()


# ---------------------------------------------------------------------- projected scores
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("ghost", ["always", "never"])
def test_projected_scores(kind, ghost):
    """P(Q) @ P(G).T equals the dense projection of the reference gradients."""
    G, Q, RG, RQ = mlp()
    P = KINDS[kind](5, 17)
    expected = project_dense(RQ, Q.space, P) @ project_dense(RG, G.space, P).T
    with ga.options(ghost=ghost):
        S = (P(Q) @ P(G).T).compute()
    assert S.dims == ("query", "train") and S.shape == (Q.n, G.n)
    assert_close(torch.from_numpy(S.values), expected, what=f"{kind} scores", **TIGHT)
    # train on the left: the executor holds the smaller side and transposes back
    with ga.options(ghost=ghost):
        St = (P(G) @ P(Q).T).compute()
    assert_close(torch.from_numpy(St.values), expected.T, what=f"{kind} scores transposed", **TIGHT)
