"""Per-token rows (``G.per_token()``) against a loop-of-backward oracle.

The oracle knows nothing of factors: for example i and position t it adds, at every
recorded module, a perturbation E acting at position t only
(y_t ← y_t + f(x_t; θ + E) − f(x_t; θ)) and takes ∂L_i/∂E at E = 0 with one backward —
the gradient of the example's loss with respect to the parameters as used at position t.
Summed over t it is the ordinary per-example gradient (checked too).
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import gradalg as ga  # noqa: E402
from gradalg.data import slice_batch  # noqa: E402
from gradalg.plan.planner import plan  # noqa: E402
from gradalg.proj.matrices import kron_matrices  # noqa: E402
from models import gpt2, lm_task, padded_token_data  # noqa: E402
from references import block_rows, one_thread, reference_rows  # noqa: E402,F401

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------------- the oracle
def position_rows(task, batch, layers, tokens) -> torch.Tensor:
    """Oracle per-token rows (n·tokens, dim) in gradalg's block layout, row (i, t) at i·tokens + t."""
    modules = dict(task.model.named_modules())
    n = batch[0].shape[0]
    rows = []
    for i in range(n):
        one = slice_batch(batch, slice(i, i + 1))
        for t in range(tokens):
            perturb, handles = {}, []
            for name in layers:
                module = modules[name]
                params = dict(module.named_parameters(recurse=False))
                E = {p: torch.zeros_like(v, requires_grad=True) for p, v in params.items()}
                perturb.update({f"{name}.{p}": e for p, e in E.items()})

                def hook(mod, inputs, out, E=E, params=params, t=t, busy=[]):
                    if busy or out.shape[1] <= t:     # busy: the re-evaluations below call the hook
                        return None
                    busy.append(True)
                    try:
                        moved = torch.func.functional_call(mod, {p: params[p] + E[p] for p in params}, inputs)
                        fixed = torch.func.functional_call(mod, {p: params[p].detach() for p in params}, inputs)
                    finally:
                        busy.clear()
                    at_t = torch.zeros(out.shape[1], dtype=out.dtype)
                    at_t[t] = 1.0
                    return out + (moved - fixed) * at_t.view(1, -1, *([1] * (out.dim() - 2)))

                handles.append(module.register_forward_hook(hook))
            try:
                loss = task.summed_loss(task.model, one)
                names = list(perturb)
                grads = torch.autograd.grad(loss, [perturb[k] for k in names], allow_unused=True)
            finally:
                for h in handles:
                    h.remove()
            g = {k: (torch.zeros_like(perturb[k]) if v is None else v).unsqueeze(0) for k, v in zip(names, grads)}
            rows.append(block_rows(task.model, layers, g)[0])
    return torch.stack(rows)


def dense_rows(G: ga.GradientSet) -> torch.Tensor:
    blocks = G.to_dense()
    return torch.cat([blocks[name].flatten(1) for name in G.layers], dim=1).to(F64)


# ---------------------------------------------------------------------- models
def seq_mlp_task():
    """A position-wise MLP over (B, T, d) features with per-token cross-entropy summed per
    sequence, padding masked: per-position rows are per-token-loss gradients here."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)

    def loss(model, batch):
        x, y, m = batch
        tok = F.cross_entropy(model(x).transpose(1, 2), y.masked_fill(m == 0, -100), reduction="none",
                              ignore_index=-100)
        return tok.sum()

    g = torch.Generator().manual_seed(1)
    n, T = 7, 5
    X = torch.randn(n, T, 4, generator=g, dtype=F64)
    Y = torch.randint(0, 3, (n, T), generator=g)
    lengths = torch.tensor([5, 3, 4, 2, 5, 1, 4])
    M = (torch.arange(T)[None] < lengths[:, None]).long()
    task = ga.Task(model, loss, token_mask=lambda b: b[2].bool(), name="seq-mlp")
    return task, (X[:4], Y[:4], M[:4]), (X[4:], Y[4:], M[4:]), ["0", "2"], T


def gpt2_task():
    """Tiny GPT-2 in float64, right-padded variable lengths, summed per-token CE per sequence."""
    model = gpt2(n_layer=1, n_embd=16, vocab=31)
    ids, mask = padded_token_data(n=6, vocab=31, min_len=2, max_len=6)
    layers = ["transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_proj", "lm_head"]
    return lm_task(model), (ids[:4], mask[:4]), (ids[4:], mask[4:]), layers, 6


@pytest.fixture(scope="module", params=["seq_mlp", "gpt2"])
def setup(request):
    task, train, query, layers, T = {"seq_mlp": seq_mlp_task, "gpt2": gpt2_task}[request.param]()
    G = ga.grads(task, train, layers, batch_size=3)      # batches of 3 and 1: chunked streaming
    Q = ga.grads(task, query, layers)
    oracle_G = position_rows(task, train, layers, T)
    oracle_Q = position_rows(task, query, layers, T)
    return dict(task=task, train=train, query=query, layers=layers, T=T, G=G, Q=Q,
                oracle_G=oracle_G, oracle_Q=oracle_Q, rows_G=reference_rows(task, train, layers),
                rows_Q=reference_rows(task, query, layers))


# ---------------------------------------------------------------------- rows
def test_oracle_sums_to_per_example_gradients(setup):
    T = setup["T"]
    summed = setup["oracle_G"].view(-1, T, setup["oracle_G"].shape[1]).sum(1)
    torch.testing.assert_close(summed, setup["rows_G"], **TOL)


def test_per_token_rows_equal_the_oracle(setup):
    Gt = setup["G"].per_token()
    assert Gt.n == setup["G"].n * setup["T"]
    assert Gt.ids[:2] == ((0, 0), (0, 1))
    torch.testing.assert_close(dense_rows(Gt), setup["oracle_G"], **TOL)


# ---------------------------------------------------------------------- scores
def test_query_token_scores(setup):
    S = (setup["Q"].per_token() @ setup["G"].T).compute()
    nq, T, nt = setup["Q"].n, setup["T"], setup["G"].n
    assert S.dims == ("query", "query_token", "train") and S.shape == (nq, T, nt)
    assert list(S["query_token"].values) == list(range(T))
    ref = (setup["oracle_Q"] @ setup["rows_G"].T).view(nq, T, nt)
    valid = setup["query"][-1].bool()                                    # attention / token mask (nq, T)
    got = torch.from_numpy(S.values)
    assert torch.isnan(got[~valid]).all() and not torch.isnan(got[valid]).any()
    torch.testing.assert_close(got[valid], ref[valid], **TOL)
    ordinary = (setup["Q"] @ setup["G"].T).compute()
    np.testing.assert_allclose(S.sum("query_token").values, ordinary.values, rtol=1e-11, atol=1e-12)


def test_train_token_scores_preconditioned(setup):
    """Kronfluence's per-train-token influence: ⟨H⁻¹ q, d_jt a_jtᵀ⟩ with H the damped Fisher."""
    G, Q, T = setup["G"], setup["Q"], setup["T"]
    H = ga.fisher(G, structure="block").damp(0.1).inv()
    S = (Q @ H @ G.per_token().T).compute()
    assert S.dims == ("query", "train", "train_token")
    rows = setup["rows_G"]
    Fm = torch.zeros(rows.shape[1], rows.shape[1], dtype=F64)          # per-layer blocks of (1/n) Σ g gᵀ
    for s in G.space.offsets().values():
        Fm[s, s] = rows[:, s].T @ rows[:, s] / rows.shape[0]
    Fm += 0.1 * torch.eye(rows.shape[1], dtype=F64)
    ref = (setup["rows_Q"] @ torch.linalg.solve(Fm, setup["oracle_G"].T)).view(Q.n, G.n, T)
    valid = setup["train"][-1].bool()                                    # (nt, T)
    got = torch.from_numpy(S.values)
    assert torch.isnan(got[:, ~valid]).all()
    torch.testing.assert_close(got[:, valid], ref[:, valid], **TOL)
    ordinary = (Q @ H @ G.T).compute()
    np.testing.assert_allclose(S.sum("train_token").values, ordinary.values, rtol=1e-9, atol=1e-11)


def test_both_token_axes_and_self_scores(setup):
    G, Q, T = setup["G"], setup["Q"], setup["T"]
    S = (Q.per_token() @ G.per_token().T).compute()
    assert S.dims == ("query", "query_token", "train", "train_token")
    ref = (setup["oracle_Q"] @ setup["oracle_G"].T).view(Q.n, T, G.n, T)
    np.testing.assert_allclose(np.nan_to_num(S.values), ref.numpy() * np.isfinite(S.values), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(S.sum(["query_token", "train_token"]).values, (Q @ G.T).compute().values,
                               rtol=1e-10, atol=1e-12)
    Gt = G.per_token()
    d = (Gt @ Gt.T).diag().compute()
    assert d.dims == ("train", "train_token")
    sq = (setup["oracle_G"] ** 2).sum(1).view(G.n, T)
    valid = setup["train"][-1].bool()
    torch.testing.assert_close(torch.from_numpy(d.values)[valid], sq[valid], **TOL)


def test_kron_projection_acts_on_rank_one_factors(setup):
    G, T = setup["G"], setup["T"]
    P = ga.proj.kron(k=12, seed=3)
    PGt = P(G.per_token())
    assert all(r == "projected" for r in PGt.representation.values())
    got = dense_rows(PGt)
    offsets, parts = 0, []
    for block in G.space.blocks:
        out_f, in_f = block.shape
        Po, Pi = kron_matrices(P, block.name, out_f, in_f, dtype=F64)
        g = setup["oracle_G"][:, offsets:offsets + block.dim].view(-1, out_f, in_f)
        parts.append((Po @ g @ Pi.T).flatten(1))
        offsets += block.dim
    torch.testing.assert_close(got, torch.cat(parts, 1), **TOL)
    S = (P(setup["Q"]) @ ga.fisher(P(G)).damp(0.1).inv() @ PGt.T).compute()
    ordinary = (P(setup["Q"]) @ ga.fisher(P(G)).damp(0.1).inv() @ P(G).T).compute()
    np.testing.assert_allclose(S.sum("train_token").values, ordinary.values, rtol=1e-9, atol=1e-11)


def test_kfac_influence_per_query_token(setup):
    """EK-FAC-preconditioned influence split over the query's positions (held side per token)."""
    G, Q = setup["G"], setup["Q"]
    H = ga.ekfac(G).damp(0.1).inv()
    S = (Q.per_token() @ H @ G.T).compute()
    np.testing.assert_allclose(S.sum("query_token").values, (Q @ H @ G.T).compute().values,
                               rtol=1e-9, atol=1e-11)


def test_rows_captured_around_a_training_loop():
    """``ga.capture`` rows split the same way (positions read off the stored factors)."""
    task, train, query, layers, T = seq_mlp_task()
    with ga.capture(task.model, layers) as cap:
        for start in (0, 3):
            batch = slice_batch(train, slice(start, start + 3))
            task.model.zero_grad()
            task.summed_loss(task.model, batch).backward()
    C = cap.grads.per_token()
    assert C.n == 4 * T
    Q = ga.grads(task, query, layers)
    got = (Q @ C.T).compute()
    ref = (Q @ ga.grads(task, train, layers).per_token().T).compute()
    np.testing.assert_allclose(got.values, np.nan_to_num(ref.values), rtol=1e-10, atol=1e-12)


def test_dask_shards_stream_token_rows():
    """The Dask executor's score blocks hold T columns per training example of a shard."""
    from distributed import Client, LocalCluster

    task, train, query, layers, T = seq_mlp_task()
    G, Q = ga.grads(task, train, layers), ga.grads(task, query, layers)
    S = Q @ G.per_token().T
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        got = S.compute(executor=ga.exec.DaskExecutor(client=client, min_shard_examples=1))
    ref = S.compute()
    assert got.dims == ref.dims and got.shape == ref.shape
    np.testing.assert_allclose(got.values, ref.values, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------- limits and memory
def test_position_wise_model_rows_are_per_token_loss_gradients():
    """For a position-wise MLP, row (i, t) is the gradient of the loss at token t alone."""
    task, train, _, layers, T = seq_mlp_task()
    X, Y, M = train
    rows = dense_rows(ga.grads(task, train, layers).per_token())
    i, t = 0, 2
    model = task.model
    ref = {}
    logits = model(X[i:i + 1, t])
    loss = F.cross_entropy(logits, Y[i:i + 1, t], reduction="sum")
    names = [f"{m}.{p}" for m in layers for p in ("weight", "bias")]
    params = dict(model.named_parameters())
    for name, g in zip(names, torch.autograd.grad(loss, [params[n] for n in names])):
        ref[name] = g.unsqueeze(0)
    torch.testing.assert_close(rows[i * T + t], block_rows(model, layers, ref)[0], **TOL)


def test_variable_length_batches_pad_to_the_longest_example():
    """Dict items of different lengths, padded per batch by a collate function: positions
    come from the longest item, shorter batches are zero-padded, padding is NaN, and the
    scores equal those of the same sequences padded once to a fixed length."""
    from torch.utils.data import DataLoader

    task, train, query, layers, T = gpt2_task()
    ids, mask = train
    items = [{"input_ids": ids[i, :int(mask[i].sum())]} for i in range(len(ids))]

    def collate(batch):
        width = max(len(b["input_ids"]) for b in batch)
        x = torch.zeros(len(batch), width, dtype=torch.long)
        m = torch.zeros(len(batch), width, dtype=torch.long)
        for k, b in enumerate(batch):
            x[k, :len(b["input_ids"])] = b["input_ids"]
            m[k, :len(b["input_ids"])] = 1
        return {"input_ids": x, "attention_mask": m}

    def loss(model, batch):
        return task.loss(model, (batch["input_ids"], batch["attention_mask"]))

    dict_task = ga.Task(task.model, loss, token_mask=lambda b: b["attention_mask"].bool())
    loader = DataLoader(items, batch_size=2, shuffle=False, collate_fn=collate)
    longest = int(mask.sum(1).max())
    Gd = ga.grads(dict_task, loader, layers).per_token()
    assert Gd.expr.tokens == longest
    Q = ga.grads(task, query, layers)
    got = (Q @ Gd.T).compute()
    ref = (Q @ ga.grads(task, train, layers).per_token().T).compute()       # padded to T ≥ longest
    assert np.isnan(ref.values[..., longest:]).all()
    ref = ref.isel(train_token=slice(0, longest))
    assert got.shape == (Q.n, len(items), longest)
    np.testing.assert_array_equal(np.isnan(got.values), np.isnan(ref.values))
    np.testing.assert_allclose(got.values, ref.values, rtol=1e-9, atol=1e-12)


def test_attention_rows_are_not_per_token_loss_gradients():
    """In GPT-2, row (i, t) differs from ∇ of the loss at token t (d_it collects later
    tokens' losses through attention), as the docs state; rows still sum to G_i."""
    task, train, _, layers, T = gpt2_task()
    ids, mask = train
    one = (ids[1:2], mask[1:2])                        # 5 real tokens
    rows = dense_rows(ga.grads(task, one, layers).per_token())
    model = task.model

    def loss_at(u):
        def loss(model, batch):
            x, m = batch
            logits = model(input_ids=x, attention_mask=m).logits[:, u]
            return F.cross_entropy(logits, x[:, u + 1], reduction="sum") / (m[:, 1:].sum(1)).to(F64).sum()
        return ga.Task(model, loss)

    per_loss = torch.cat([reference_rows(loss_at(u), one, layers) for u in range(4)])
    torch.testing.assert_close(per_loss.sum(0), rows.sum(0), **TOL)      # both decompose G_i
    gap = (per_loss[0] - rows[0]).norm() / rows[0].norm()
    assert gap > 0.1


def test_scaled_rows_split_like_their_factors():
    """Row weights before the split scale every token row of the example (TRAK's 1 − p)."""
    task, train, query, layers, T = seq_mlp_task()
    G, Q = ga.grads(task, train, layers), ga.grads(task, query, layers)
    w = ga.row_weights(lambda model, batch: batch[0][:, 0, 0] ** 2, "x00²")
    got = (Q @ G.scale(w).per_token().T).compute()
    plain = (Q @ G.per_token().T).compute()
    weights = (train[0][:, 0, 0] ** 2).numpy()
    np.testing.assert_allclose(got.values, plain.values * weights[None, :, None], rtol=1e-12, atol=1e-14)


def test_refusals():
    task, train, _, layers, T = seq_mlp_task()
    G = ga.grads(task, train, layers)
    with pytest.raises(ga.PerTokenError, match="factored"):
        ga.grads(task, train, layers, backend="func").per_token()
    with pytest.raises(ga.PerTokenError, match="P\\(G.per_token\\(\\)\\)"):
        ga.proj.kron(k=4)(G).per_token()
    with pytest.raises(ga.PerTokenError, match="tokens=5"):
        (G.per_token(tokens=3) @ G.T).compute()
    with pytest.raises(ga.PerTokenError, match="no sequence dimension"):
        ga.grads(task, (torch.randn(3, 4, dtype=F64), torch.zeros(3, dtype=torch.long),
                        torch.ones(3, dtype=torch.long)), layers).per_token()


def test_layers_on_other_positions_are_refused():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3).to(F64), nn.Linear(3, 2).to(F64)

        def forward(self, x):
            return self.b(self.a(self.a(x)))

    model = Twice()
    task = ga.Task(model, lambda m, b: m(b[0]).pow(2).sum())
    G = ga.grads(task, (torch.randn(2, 4, 3, dtype=F64),), ["a", "b"])
    with pytest.raises(ga.PerTokenError, match="positions per example"):
        (G.per_token() @ G.T).compute()


def test_planner_counts_token_rows_and_refuses_over_budget():
    """Flat (sparse-projected) per-token rows take T times the bytes of example rows: the
    planner's held-side estimate counts them, and a budget that holds the example rows but
    not the token rows is refused when planning, before any capture."""
    task, train, query, layers, T = seq_mlp_task()
    G, Q = ga.grads(task, train, layers), ga.grads(task, query, layers)
    P = ga.proj.sparse(k=16, seed=0)    # no dense (k, dim) matrix: the held rows are the budget's subject
    per_token, ordinary = P(Q.per_token()) @ P(G.per_token()).T, P(Q) @ P(G).T

    def scores_pass(S):
        return next(ps for ps in plan(S.expr).passes if any(j.kind == "scores" for j in ps.jobs))

    elem = next(task.model.parameters()).element_size()   # rows are kept in the model's dtype (float64 here)
    held = min(Q.n, G.n) * 16 * elem               # rows of the smaller side
    fixed_ordinary, fixed_token = scores_pass(ordinary).fixed_bytes, scores_pass(per_token).fixed_bytes
    # the same projection state on both sides (the sparse map's indices and signs), plus the rows
    assert fixed_token - fixed_ordinary == (T - 1) * held and fixed_ordinary >= held
    budget = int(fixed_token + scores_pass(per_token).per_example_bytes) - 1
    with ga.options(memory_budget=budget):
        plan(ordinary.expr)
        with pytest.raises(ga.MemoryBudgetError, match="memory budget"):
            plan(per_token.expr)


# ---------------------------------------------------------------------- plot
def test_heatmap_renders(setup):
    from matplotlib.figure import Figure
    G, Q = setup["G"], setup["Q"]
    S_train = (Q @ G.per_token().T).compute()
    fig = ga.viz.token_heatmap(S_train, query=S_train["query"].values[1], top=3,
                               tokens={0: ["a", "b", "c"]})
    assert isinstance(fig, Figure)
    image = fig.axes[0].images[0].get_array()
    assert image.shape == (3, setup["T"])
    totals = S_train.sel(query=S_train["query"].values[1]).sum("train_token").values
    ranked = np.sort(totals)[::-1][:3]
    np.testing.assert_allclose(np.nansum(np.ma.filled(image, np.nan), axis=1), ranked, rtol=1e-9)
    fig.canvas.draw()
    S_query = (Q.per_token() @ G.T).compute()
    fig2 = ga.viz.token_heatmap(S_query, top=2, tokens=[f"t{i}" for i in range(setup["T"])])
    assert [t.get_text() for t in fig2.axes[0].get_xticklabels()][:2] == ["t0", "t1"]
    fig2.canvas.draw()
    with pytest.raises(ValueError, match="per-token"):
        ga.viz.token_heatmap((Q @ G.T).compute())
    import matplotlib.pyplot as plt
    plt.close("all")
