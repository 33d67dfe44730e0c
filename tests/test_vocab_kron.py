"""K-FAC / EK-FAC of vocabulary-wide layers: factors wider than
``ga.options(kron_diagonal_width)`` are kept as their diagonal (identity eigenbasis).

References are dense, built here from the captured factors or from a loop of backward
passes (``test_tied.oracle``), on a GPT-2 with a 96-token vocabulary and n_embd 16, with
``kron_diagonal_width=64`` so that the vocabulary side is the diagonal one:

* an embedding's input factor is exactly diagonal (token counts): the structured K-FAC
  equals the dense one;
* a head's output-gradient factor S is replaced by diag(S);
* EK-FAC's eigenvalues are the exact diagonal of the Fisher in the (I ⊗ Q_A) basis;
* the preconditioned scores equal a dense construction of the same approximation.
"""
import re

import pytest
import torch

import gradalg as ga
from gradalg.curvature.kron import KronStats
from gradalg.exec.local import LocalExecutor
from gradalg.plan import DecisionKind
from references import one_thread  # noqa: F401 - one intra-op thread per test module
from models import lm_loss, padded_token_data
from test_tied import oracle, task_of

F64 = torch.float64
V, E = 96, 16
NARROW = 64            # kron_diagonal_width below the vocabulary: its side is diagonal
DAMP = 1e-3


def gpt2(tied: bool, vocab=V, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=1, n_embd=E, n_head=2, vocab_size=vocab, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).to(F64).eval()


@pytest.fixture(scope="module")
def data():
    return (padded_token_data(n=6, vocab=V, min_len=3, max_len=8, seed=1),
            padded_token_data(n=3, vocab=V, min_len=2, max_len=8, seed=2))


def dense_factors(G, name):
    """(S, A) of block ``name`` as dense matrices, from the captured (pooled) factors:
    S = (1/n) Σ_i D_iᵀ D_i, A = Σ_i A_iᵀ A_i / #(non-zero rows of A)."""
    chunk = LocalExecutor().gradients(G.expr)
    F_ = chunk.blocks[name]
    A = F_.A.to_dense(F64) if hasattr(F_.A, "idx") else F_.A.to(F64)
    A, D = A.flatten(0, 1), F_.D.to(F64).flatten(0, 1)
    return D.T @ D / G.n, A.T @ A / (A != 0).any(1).sum()


def rows(G, name):
    return G.to_dense()[name].flatten(1).to(F64)


def kfac_dense(S, A):
    return torch.kron(S, A)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def influence_dense(Q, G, F):
    """Q (m, d) · (F + λI)⁻¹ · Gᵀ (d, n), dense."""
    return Q @ torch.linalg.solve(F + DAMP * torch.eye(len(F), dtype=F64), G.T)


def computed(S):
    return torch.as_tensor(S.compute().values)


# ------------------------------------------------------------------ embedding: exact
def test_embedding_input_factor_is_the_exact_token_counts(data):
    train, _ = data
    G = ga.grads(task_of(gpt2(tied=False)), train, layers=["transformer.wte"])
    name = "transformer.wte"
    S, A = dense_factors(G, name)
    assert torch.count_nonzero(A - torch.diag(torch.diagonal(A))) == 0     # one-hot inputs: diagonal
    with ga.options(kron_diagonal_width=NARROW, progress=False):
        op = LocalExecutor().operator(ga.kfac(G).expr)
        assert op.bases[name][1] is None and op.bases[name][0] is not None   # A diagonal, S (16×16) dense
        assert op.rules[:1] == ("kronecker.diagonal_factor",)
        diag_op = op.dense()
    with ga.options(progress=False):
        dense_op = ga.kfac(G).to_dense()                                     # the dense eigendecomposition
    assert rel(diag_op, kfac_dense(S, A)) < 1e-10
    assert rel(diag_op, dense_op) < 1e-10
    # the statistics themselves: the (V,) sum is the dense sum's diagonal, counted from ids
    chunk = LocalExecutor().gradients(G.expr)
    narrow, wide = KronStats(diagonal_width=NARROW), KronStats(diagonal_width=None)
    narrow.update(chunk.blocks[name], token_block=3)
    wide.update(chunk.blocks[name], token_block=3)
    assert narrow.A.shape == (V,) and wide.A.shape == (V, V) and narrow.tokens == wide.tokens
    torch.testing.assert_close(torch.diag(narrow.A), wide.A, rtol=0, atol=0)


# ------------------------------------------------------------------ head: diag(S)
@pytest.mark.parametrize("eigen_correction", [False, True], ids=["kfac", "ekfac"])
def test_untied_head_output_factor_is_diag_of_the_dense_one(data, eigen_correction):
    train, queries = data
    task = task_of(gpt2(tied=False))
    name = "lm_head"
    G, Q = ga.grads(task, train, layers=[name]), ga.grads(task, queries, layers=[name])
    S, A = dense_factors(G, name)
    with ga.options(kron_diagonal_width=NARROW, progress=False):
        op = LocalExecutor().operator(ga.kfac(G, eigen_correction=eigen_correction).expr)
        scores = computed(Q @ ga.kfac(G, eigen_correction=eigen_correction).damp(DAMP).inv() @ G.T)
    Q_S, Q_A = op.bases[name]
    assert Q_S is None and Q_A.shape == (E, E)
    g = rows(G, name)
    if eigen_correction:
        # Λ = (1/n) Σ_i (G_i Q_A)², the exact diagonal of the Fisher in the (I ⊗ Q_A) basis
        lam = (torch.einsum("nvi,ia->nva", g.view(-1, V, E), Q_A) ** 2).mean(0)
        assert rel(op.eigenvalues[name], lam) < 1e-10
        K = torch.kron(torch.eye(V, dtype=F64), Q_A.contiguous())
        F = (K * lam.flatten()) @ K.T
    else:
        F = kfac_dense(torch.diag(torch.diagonal(S)), A)
    assert rel(op.dense(), F) < 1e-10
    assert rel(scores, influence_dense(rows(Q, name), g, F)) < 1e-8


# ------------------------------------------------------------------ tied embedding/head
def test_kfac_of_a_tied_embedding_and_head_is_the_kronecker_of_the_pooled_covariances(data):
    train, queries = data
    model = gpt2(tied=True)
    task = task_of(model)
    G, Q = ga.grads(task, train, layers=["lm_head"]), ga.grads(task, queries, layers=["transformer.wte"])
    name = "transformer.wte"                      # one block, in the weight's (V, E) layout
    S, A = dense_factors(G, name)
    with ga.options(progress=False):
        dense = LocalExecutor().operator(ga.kfac(G).expr).dense()
        dense_scores = computed(Q @ ga.kfac(G).damp(DAMP).inv() @ G.T)
    assert rel(dense, kfac_dense(S, A)) < 1e-10
    g, q = rows(G, name), rows(Q, name)
    ref = oracle(model, lm_loss, train, [model.transformer.wte.weight])
    assert rel(g, ref) < 1e-8                     # the block's rows are the true summed gradients
    assert rel(dense_scores, influence_dense(q, g, kfac_dense(S, A))) < 1e-8
    with ga.options(kron_diagonal_width=NARROW, progress=False):
        op = LocalExecutor().operator(ga.kfac(G).expr)
        scores = computed(Q @ ga.kfac(G).damp(DAMP).inv() @ G.T)
        ekfac = LocalExecutor().operator(ga.ekfac(G).expr)
        ekfac_scores = computed(Q @ ga.ekfac(G).damp(DAMP).inv() @ G.T)
    F = kfac_dense(torch.diag(torch.diagonal(S)), A)
    assert op.bases[name][0] is None
    assert rel(op.dense(), F) < 1e-10
    assert rel(scores, influence_dense(q, g, F)) < 1e-8
    # EK-FAC: eigenvalues re-fit to the true summed gradients, per coordinate of (I ⊗ Q_A)
    Q_A = ekfac.bases[name][1]
    lam = (torch.einsum("nvi,ia->nva", ref.view(-1, V, E), Q_A) ** 2).mean(0)
    assert rel(ekfac.eigenvalues[name], lam) < 1e-8
    K = torch.kron(torch.eye(V, dtype=F64), Q_A.contiguous())
    assert rel(ekfac_scores, influence_dense(q, g, (K * lam.flatten()) @ K.T)) < 1e-8


def test_kfac_of_a_kron_projected_tied_block_runs(data):
    """The refusal of K-FAC on a tied block is gone for projected rows too (LoGra's K-FAC)."""
    train, queries = data
    task = task_of(gpt2(tied=True))
    P = ga.proj.kron(k=8, seed=0)
    G, Q = P(ga.grads(task, train, layers=["lm_head"])), P(ga.grads(task, queries, layers=["lm_head"]))
    with ga.options(progress=False):
        scores = computed(Q @ ga.kfac(G).damp(DAMP).inv() @ G.T)
    assert scores.shape == (3, 6) and torch.isfinite(scores).all()


# ------------------------------------------------------------------ the plan shows it
def test_plan_names_the_diagonal_factor_and_the_resolved_operator_records_it(data):
    train, queries = data
    task = task_of(gpt2(tied=True))
    G, Q = ga.grads(task, train, layers=["lm_head"]), ga.grads(task, queries, layers=["lm_head"])
    S = Q @ ga.ekfac(G).damp(DAMP).inv() @ G.T
    with ga.options(kron_diagonal_width=NARROW, progress=False):
        explained = S.explain()
        text = str(explained)
        op = LocalExecutor().operator(ga.ekfac(G).expr)
    assert explained.plan.decisions.one(DecisionKind.KRON_DIAGONAL, block="transformer.wte").chosen == "diagonal"
    assert f"wider than ga.options(kron_diagonal_width={NARROW}): S ({V}×{V}) approximated by diag(S)" in text
    rules_line = next(x for x in text.splitlines() if "kronecker.invert_eigenvalues" in x)
    assert "kronecker.diagonal_factor" in rules_line
    assert op.rules == ("kronecker.diagonal_factor",)
    with ga.options(progress=False):   # the default width (16384) keeps a 96-wide factor dense
        explained = S.explain()
        text = str(explained)
    assert not explained.plan.decisions.of(DecisionKind.KRON_DIAGONAL) and "kronecker.diagonal_factor" not in text


def test_gpt2_small_vocabulary_is_planned_without_a_vocabulary_squared_factor():
    """GPT-2 small's tied 50,257 × 768 block on the meta device: at the default options the
    plan keeps the vocabulary side diagonal, and its statistics take megabytes, not the
    tens of GB of a dense 50,257² factor and its eigendecomposition."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=768, n_head=12, vocab_size=50257))
    task = task_of(model)
    ids = torch.zeros(8, 64, dtype=torch.long)
    batch = (ids, torch.ones_like(ids))
    G = ga.grads(task, batch, layers=["lm_head"])
    explained = (G @ ga.ekfac(G).damp(DAMP).inv() @ G.T).explain()
    text = str(explained)
    assert explained.plan.decisions.one(DecisionKind.KRON_DIAGONAL, block="transformer.wte").chosen == "diagonal"
    assert "50,257×50,257" in text and "kron_diagonal_width=16384" in text
    from gradalg.plan.jobs.kron import kron_bytes
    assert kron_bytes(G.space, 8192, 16384) < 0.4e9 < 50e9 < kron_bytes(G.space, 8192, None)


# ------------------------------------------------------------------ refusals and their fixes
def test_memory_refusal_names_the_diagonal_width_that_fits_and_it_runs(data):
    """A budget too small for a dense 2048² output factor: the refusal spells the
    statistics out and names ga.options(kron_diagonal_width=...); applied as written, the
    same expression runs under the same budget."""
    vocab = 2048
    model = gpt2(tied=False, vocab=vocab)
    task = task_of(model)
    train = padded_token_data(n=4, vocab=vocab, min_len=3, max_len=8, seed=1)
    G = ga.grads(task, train, layers=["lm_head"])
    S = G @ ga.kfac(G).damp(DAMP).inv() @ G.T
    budget = "60MB"
    with ga.options(memory_budget=budget, kron_float64_width=1024, progress=False):
        with pytest.raises(ga.MemoryBudgetError) as info:
            S.compute()
    msg = str(info.value)
    assert f"({vocab}×{vocab}, float32)" in msg
    fix = re.search(r"ga\.options\(kron_diagonal_width=(\d+)\)", msg)
    assert fix, msg
    with ga.options(memory_budget=budget, kron_float64_width=1024, kron_diagonal_width=int(fix.group(1)),
                    progress=False):
        scores = computed(S)
    assert scores.shape == (4, 4) and torch.isfinite(scores).all()


def test_a_stored_operator_with_a_diagonal_factor_keeps_its_numbers(data, tmp_path):
    """The identity basis of a diagonal factor is not written (no V × V array); the loaded
    operator gives the same scores."""
    pytest.importorskip("zarr")
    train, queries = data
    task = task_of(gpt2(tied=True))
    G, Q = ga.grads(task, train, layers=["lm_head"]), ga.grads(task, queries, layers=["lm_head"])
    with ga.options(kron_diagonal_width=NARROW, progress=False):
        stored = ga.store.write_operator(ga.ekfac(G), tmp_path / "ekfac.zarr")
        ref = computed(Q @ ga.ekfac(G).damp(DAMP).inv() @ G.T)
    loaded = ga.store.open_operator(tmp_path / "ekfac.zarr")
    with ga.options(progress=False):
        out = computed(Q @ loaded.damp(DAMP).inv() @ G.T)
        again = computed(Q @ stored.damp(DAMP).inv() @ G.T)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=0)
    torch.testing.assert_close(again, ref, rtol=1e-10, atol=0)


# ------------------------------------------------------------------ influence's default damping
def _mass_lambda(mu: torch.Tensor, q: float = 0.99) -> float:
    """The eigenvalue where the largest ones first hold q of the block's trace (by hand)."""
    s = torch.sort(mu.clamp_min(0), descending=True).values
    k = int((torch.cumsum(s, 0) < q * s.sum()).sum())
    return float(s[k])


def test_influence_default_damping_on_a_diagonal_factor_is_per_block_from_diag_s(data):
    """influence's K-FAC default (λ_b per Kronecker block, mass 0.99, since issue 31; H given
    as ga.kfac(G), the task here has no Gauss-Newton objective) on a model whose head's
    vocabulary side is kept diagonal: each block's λ_b is read from the
    spectrum of the approximation actually used, diag(S) ⊗ A for the head and S ⊗ A for the
    MLP beside it, and the scores are Σ_b q_b (F_b + λ_b I)⁻¹ g_bᵀ, dense. Issue 31's
    fidelity rows 'vocabulary factor diagonal' moved with this default (a stale cache had
    kept them at the earlier 0.1 × pooled mean): this pins their path against a reference."""
    train, queries = data
    task = task_of(gpt2(tied=False))
    names = ["transformer.h.0.mlp.c_fc", "lm_head"]                  # factors 64 / 16 (dense), 96 / 16 (S diagonal)
    G, Q = ga.grads(task, train, layers=names), ga.grads(task, queries, layers=names)
    with ga.options(kron_diagonal_width=NARROW, progress=False):
        op = LocalExecutor().operator(ga.kfac(G).expr)
        scores = computed(ga.methods.influence(task, train, queries, layers=names, curvature=ga.kfac(G)))
    assert op.bases["lm_head"][0] is None and op.bases["transformer.h.0.mlp.c_fc"][0] is not None
    ref, lams = 0, {}
    for name in names:
        S, A = dense_factors(G, name)
        S = torch.diag(torch.diagonal(S)) if name == "lm_head" else S
        F = kfac_dense(S, A)
        lams[name] = _mass_lambda(torch.linalg.eigvalsh(F))
        g, q = rows(G, name), rows(Q, name)
        ref = ref + q @ torch.linalg.solve(F + lams[name] * torch.eye(len(F), dtype=F64), g.T)
    assert abs(lams["lm_head"] / lams["transformer.h.0.mlp.c_fc"] - 1) > 0.1   # two different λ_b
    assert rel(scores, ref) < 1e-8
    # a wrong λ on the diagonal block (the dense S's spectrum, or the earlier pooled rule) is seen
    S, A = dense_factors(G, "lm_head")
    dense_head = _mass_lambda(torch.linalg.eigvalsh(kfac_dense(S, A)))
    assert abs(dense_head / lams["lm_head"] - 1) > 1e-3


def test_ekfac_default_damping_on_a_diagonal_factor_reads_the_refit_grid(data):
    """EK-FAC at influence's default on the head alone, S diagonal: λ is the mass-0.99
    eigenvalue of the re-fitted grid Λ = (1/n) Σ_i (G_i Q_A)², and the scores are
    q (K diag(Λ) Kᵀ + λ I)⁻¹ gᵀ with K = I ⊗ Q_A, dense."""
    train, queries = data
    task = task_of(gpt2(tied=False))
    name = "lm_head"
    G, Q = ga.grads(task, train, layers=[name]), ga.grads(task, queries, layers=[name])
    with ga.options(kron_diagonal_width=NARROW, progress=False):
        op = LocalExecutor().operator(ga.ekfac(G).expr)
        scores = computed(ga.methods.influence(task, train, queries, layers=[name], curvature=ga.ekfac(G)))
    Q_S, Q_A = op.bases[name]
    assert Q_S is None
    g = rows(G, name)
    lam = (torch.einsum("nvi,ia->nva", g.view(-1, V, E), Q_A) ** 2).mean(0)
    K = torch.kron(torch.eye(V, dtype=F64), Q_A.contiguous())
    F = (K * lam.flatten()) @ K.T
    damping = _mass_lambda(lam.flatten())
    ref = rows(Q, name) @ torch.linalg.solve(F + damping * torch.eye(len(F), dtype=F64), g.T)
    assert rel(scores, ref) < 1e-8
