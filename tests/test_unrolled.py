"""Unrolled attribution: MAGIC against finite differences of retraining with a
re-weighted example, the replay schedules against each other and their memory, the
replayed optimizers against ``torch.optim``, SOURCE in its exact limits, and the errors
for runs that cannot be replayed."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.unroll import (SGD, Adam, AdamW, NonDeterministicTrainingError, TrainingRun,
                            UnsupportedOptimizerError, UnsupportedTrainingError, metagradients, schedule_bound)

sys.path.insert(0, os.path.dirname(__file__))
from references import one_thread  # noqa: F401,E402 - autouse fixture

F64 = torch.float64


def ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def mlp(seed=0, d_in=5, hidden=6, classes=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes)).to(F64)


def data(n, seed, d_in=5, classes=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=F64), torch.randint(0, classes, (n,), generator=g)


TRAIN, QUERIES = data(12, 1), data(4, 2)


def query_losses(run, params):
    return F.cross_entropy(torch.func.functional_call(run.model, params, (QUERIES[0],)), QUERIES[1],
                           reduction="none")


def finite_differences(run, h=1e-5):
    """(n_query, n_train) ∂f_q/∂ε_i by central differences of retraining with ε_i = 1 ± h."""
    out = torch.zeros(QUERIES[0].shape[0], run.n_train, dtype=F64)
    for i in range(run.n_train):
        w = torch.ones(run.n_train, dtype=F64)
        w[i] = 1 + h
        up = query_losses(run, run.final_params(w))
        w[i] = 1 - h
        down = query_losses(run, run.final_params(w))
        out[:, i] = (up - down) / (2 * h)
    return out


OPTIMIZERS = {
    "sgd": SGD(0.3),
    "sgd_momentum_wd": SGD(0.2, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov_schedule": SGD(lambda t: 0.3 / (1 + t), momentum=0.5, nesterov=True),
    "adamw": AdamW(0.05, weight_decay=0.1),
    "adam_coupled_wd": Adam(0.05, weight_decay=0.01),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_magic_equals_finite_differences_of_reweighted_retraining(name):
    run = TrainingRun(mlp(), ce, TRAIN, OPTIMIZERS[name], batch_size=4, epochs=3, seed=0)     # 9 steps
    scores = ga.methods.magic(run, QUERIES).compute()
    assert scores.dims == ("query", "train") and scores.shape == (4, 12)
    fd = finite_differences(run)
    rel = float((torch.from_numpy(scores.values) + fd).abs().max() / fd.abs().max())   # τ = −∂f/∂ε
    assert rel < 1e-6, rel


def test_magic_through_a_gpt2_language_model_equals_finite_differences():
    """The LM benchmark's run in miniature: a transformers GPT-2 (eager attention) on
    right-padded dict items, per-sequence mean token loss, Adam, batches with repeats,
    Σε ℓ/Σε; the query target is each query's summed token loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                       attn_implementation="eager")).to(F64)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 7, (10,), generator=g)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, 11, (10, 6), generator=g) * mask                          # (10, 6), 0 = padding
    data = {"input_ids": ids[:7], "attention_mask": mask[:7]}
    queries = {"input_ids": ids[7:], "attention_mask": mask[7:]}

    def token_nll(m, b):                                                            # (B, T-1), 0 on padding
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        targets = b["input_ids"][:, 1:].masked_fill(b["attention_mask"][:, 1:] == 0, -100)
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")

    def sequence_loss(m, b):
        return token_nll(m, b).sum(1) / b["attention_mask"][:, 1:].sum(1)

    def query_sum(m, b):
        return token_nll(m, b).sum(1)

    batches = [torch.randint(0, 7, (4,), generator=g) for _ in range(5)]
    run = TrainingRun(model, sequence_loss, data, Adam(0.05), batches=batches, reduction="weighted_mean")
    scores = torch.from_numpy(ga.methods.magic(run, queries, query_loss=query_sum).compute().values)

    def targets(w):
        return query_sum(run.model_with(run.final_params(w)), queries).detach()

    h, fd = 1e-5, torch.zeros(3, 7, dtype=F64)
    for i in range(7):
        w = torch.ones(7, dtype=F64)
        w[i] = 1 + h
        up = targets(w)
        w[i] = 1 - h
        fd[:, i] = (up - targets(w)) / (2 * h)
    assert float((scores + fd).abs().max() / fd.abs().max()) < 1e-5


@pytest.mark.parametrize("reduction", ["weighted_mean", "sum"])
def test_magic_equals_finite_differences_for_other_batch_reductions(reduction):
    run = TrainingRun(mlp(), ce, TRAIN, SGD(0.1, momentum=0.5), batch_size=4, epochs=2, seed=3, reduction=reduction)
    fd = finite_differences(run)
    S = torch.from_numpy(ga.methods.magic(run, QUERIES, checkpointing=2).compute().values)
    assert float((S + fd).abs().max() / fd.abs().max()) < 1e-6
    if reduction == "weighted_mean":           # a batch whose weights are all 0 leaves θ to weight decay/momentum
        zero = torch.ones(run.n_train, dtype=F64)
        zero[run.batches[0]] = 0
        assert torch.isfinite(torch.cat([p.flatten() for p in run.final_params(zero).values()])).all()


def test_magic_logistic_regression_minibatch_order_given():
    torch.manual_seed(3)
    model = nn.Linear(5, 3).to(F64)
    batches = [[0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11], [3, 7, 11, 0], [1, 1, 5]]   # repeats allowed
    run = TrainingRun(model, ce, TRAIN, SGD(0.5, momentum=0.8), batches=batches)
    mg = metagradients(run, lambda p: query_losses(run, p), checkpointing="log")
    fd = finite_differences(run)
    assert float((mg.values - fd).abs().max() / fd.abs().max()) < 1e-6
    assert float(mg.values[:, 2].abs().max()) > 0       # example 2 is in one batch only


@pytest.mark.parametrize("opt", ["sgd_momentum_wd", "adamw"])
def test_checkpointing_schedules_give_identical_gradients_and_bounded_memory(opt):
    run = TrainingRun(mlp(), ce, TRAIN, OPTIMIZERS[opt], batch_size=2, epochs=5, seed=1)      # 30 steps
    T = run.n_steps
    results = {s: metagradients(run, lambda p: query_losses(run, p), checkpointing=s)
               for s in ("all", "sqrt", "log", 4)}
    for s, r in results.items():
        assert torch.equal(r.values, results["all"].values), s
        assert r.ledger.held == 0
        assert r.ledger.peak == schedule_bound(s, T), (s, r.ledger)
    assert results["all"].ledger.peak == T and results["all"].ledger.forward_steps == T
    assert results["sqrt"].ledger.peak <= 2 * np.ceil(np.sqrt(T))                       # 10 of 30
    assert results["log"].ledger.peak == np.ceil(np.log2(T)) + 1                          # 6 of 30
    assert results["sqrt"].ledger.forward_steps < 2 * T


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9, weight_decay=0.01),
    lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9, nesterov=True),
    lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.01),
], ids=["sgd", "nesterov", "adamw", "adam"])
def test_replayed_run_equals_a_torch_optim_loop(make):
    model = mlp()
    run = TrainingRun(model, ce, TRAIN, make(model.parameters()), batch_size=4, epochs=3, seed=0)
    trained = run.train()
    reference = mlp()
    opt = make(reference.parameters())
    for idx in run.batches:
        opt.zero_grad()
        ce(reference, (TRAIN[0][idx], TRAIN[1][idx])).mean().backward()
        opt.step()
    for (n, a), b in zip(trained.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=n)


def test_frozen_parameters_stay_fixed_and_are_not_differentiated():
    model = mlp()
    model[0].weight.requires_grad_(False)
    run = TrainingRun(model, ce, TRAIN, SGD(0.3), batch_size=4, epochs=2, seed=0)
    assert run.param_names == ("0.bias", "2.weight", "2.bias")
    torch.testing.assert_close(run.train()[0].weight, model[0].weight, rtol=0, atol=0)
    fd = finite_differences(run)
    S = torch.from_numpy(ga.methods.magic(run, QUERIES).compute().values)
    assert float((S + fd).abs().max() / fd.abs().max()) < 1e-6


def test_dropout_with_a_random_seed_is_replayed_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3)).to(F64)
    with pytest.raises(NonDeterministicTrainingError, match="random_seed"):
        TrainingRun(model, ce, TRAIN, SGD(0.3), batch_size=4, epochs=2, seed=0)
    run = TrainingRun(model, ce, TRAIN, SGD(0.3), batch_size=4, epochs=2, seed=0, random_seed=7)
    values = torch.from_numpy(ga.methods.magic(run, QUERIES).compute().values)   # queries in eval mode
    fd = torch.zeros_like(values)
    for i in range(run.n_train):
        w = torch.ones(run.n_train, dtype=F64)
        w[i] = 1 + 1e-5
        up = ce(run.train(w), QUERIES)          # run.train returns the model in eval mode
        w[i] = 1 - 1e-5
        fd[:, i] = ((up - ce(run.train(w), QUERIES)) / 2e-5).detach()
    assert run.model[2].training                 # the run keeps its own modes
    assert float((values + fd).abs().max() / fd.abs().max()) < 1e-6


def test_a_step_that_does_not_replay_is_refused():
    def noisy(model, batch):      # draws random numbers the run cannot replay
        return ce(model, batch) * (1 + 1e-3 * torch.randn(batch[0].shape[0], dtype=F64))

    run = TrainingRun(mlp(), noisy, TRAIN, SGD(0.3), batch_size=4, epochs=1, seed=0)
    with pytest.raises(NonDeterministicTrainingError, match="step 2 of the training run does not replay"):
        ga.methods.magic(run, QUERIES, query_loss=ce, checkpointing="all").compute()


def test_unreplayable_set_ups_are_refused():
    loader = torch.utils.data.DataLoader(TensorDataset(*TRAIN), batch_size=4, shuffle=True)
    with pytest.raises(NonDeterministicTrainingError, match="DataLoader does not fix the batch order"):
        TrainingRun(mlp(), ce, loader, SGD(0.1), batch_size=4, epochs=1, seed=0)
    with pytest.raises(NonDeterministicTrainingError, match="batch order is not given"):
        TrainingRun(mlp(), ce, TRAIN, SGD(0.1))
    with pytest.raises(NonDeterministicTrainingError, match="seed="):
        TrainingRun(mlp(), ce, TRAIN, SGD(0.1), batch_size=4, epochs=1)
    with pytest.raises(UnsupportedTrainingError, match="outside"):
        TrainingRun(mlp(), ce, TRAIN, SGD(0.1), batches=[[0, 12]])
    bn = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).to(F64)
    with pytest.raises(UnsupportedTrainingError, match="'1' \\(BatchNorm1d\\) is in training mode"):
        TrainingRun(bn, ce, TRAIN, SGD(0.1), batch_size=4, epochs=1, seed=0)
    run = TrainingRun(mlp(), lambda m, b: ce(m, b).mean(), TRAIN, SGD(0.1), batch_size=4, epochs=1, seed=0)
    with pytest.raises(UnsupportedTrainingError, match="one value per example"):
        run.train()


class FusedAttention(nn.Module):
    """One self-attention over a sequence of 5 positions through the fused CPU kernel,
    whose backward has no derivative of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(2, 6), nn.Linear(10, 3)

    def forward(self, x):                                     # (B, 10) -> (B, 3)
        q, k, v = self.qkv(x.reshape(-1, 5, 2)).unsqueeze(1).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v).reshape(x.shape[0], 10))


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_a_loss_without_a_second_derivative_is_refused_by_name():
    X, y = torch.randn(8, 10, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 3
    run = TrainingRun(FusedAttention(), ce, (X, y), SGD(0.1), batch_size=4, epochs=1, seed=0)
    run.train()                                              # one derivative: training works
    with pytest.raises(UnsupportedTrainingError, match="cannot be differentiated twice.*attn_implementation"):
        ga.methods.magic(run, (X[:2], y[:2])).compute()


def test_unsupported_optimizers_are_refused():
    model = mlp()
    with pytest.raises(UnsupportedOptimizerError, match="RMSprop is not supported"):
        TrainingRun(model, ce, TRAIN, torch.optim.RMSprop(model.parameters()), batch_size=4, epochs=1, seed=0)
    with pytest.raises(UnsupportedOptimizerError, match="amsgrad"):
        TrainingRun(model, ce, TRAIN, torch.optim.Adam(model.parameters(), amsgrad=True), batch_size=4, epochs=1,
                    seed=0)
    groups = [{"params": [model[0].weight], "lr": 0.1}, {"params": [model[0].bias], "lr": 0.2}]
    with pytest.raises(UnsupportedOptimizerError, match="different settings"):
        TrainingRun(model, ce, TRAIN, torch.optim.SGD(groups), batch_size=4, epochs=1, seed=0)
    with pytest.raises(UnsupportedOptimizerError, match="momentum"):
        SGD(0.1, momentum=1.0)
    run = TrainingRun(model, ce, TRAIN, AdamW(0.01), batch_size=4, epochs=1, seed=0)
    with pytest.raises(UnsupportedOptimizerError, match="SOURCE's closed form is derived for SGD"):
        ga.methods.source(run, TensorDataset(*QUERIES))


# ----------------------------------------------------------------------------- SOURCE
def regression_task(model):
    """½(f − y)², scalar output: the Gauss-Newton term of an example is ∇f (one term)."""
    return ga.Task(model, lambda m, b: 0.5 * ((m(b[0]).squeeze(-1) - b[1]) ** 2).sum(),
                   expected_terms=lambda m, b: [m(b[0]).squeeze(-1).sum()], name="regression")


def test_source_with_one_segment_per_step_of_gradient_descent_on_a_quadratic_is_exact():
    """Least squares, full-batch GD with weight decay: H is constant, so SOURCE with one
    segment per step and the exact Gauss-Newton (= Hessian) equals the metagradient."""
    g = torch.Generator().manual_seed(4)
    X, y = torch.randn(10, 4, generator=g, dtype=F64), torch.randn(10, generator=g, dtype=F64)
    Xq, yq = torch.randn(3, 4, generator=g, dtype=F64), torch.randn(3, generator=g, dtype=F64)
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(F64)
    sq = lambda m, b: 0.5 * (m(b[0]).squeeze(-1) - b[1]) ** 2  # noqa: E731
    run = TrainingRun(model, sq, (X, y), SGD(0.2, weight_decay=0.05), batches=[list(range(10))] * 6)
    magic = ga.methods.magic(run, (Xq, yq)).compute().values
    S = ga.methods.source(run, TensorDataset(Xq, yq), n_segments=6, curvature="gauss_newton",
                          task_fn=regression_task)
    np.testing.assert_allclose(S.compute().values, magic, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("curvature", ["gauss_newton", "ekfac"])
def test_source_with_one_long_segment_is_the_influence_function(curvature):
    """K·η·λ_min → ∞: S → 0 and R → H⁻¹, so τ = ∇fᵀ(H + wd)⁻¹ ḡ: the influence function."""
    model = mlp(seed=2)
    task = ga.tasks.classification(model)
    train, queries = TensorDataset(*TRAIN), TensorDataset(*QUERIES)
    seg = ga.methods.Segment((task,), lr=0.05, steps=10**6)
    S = ga.methods.source([seg], queries, train=train, final=task, curvature=curvature, weight_decay=0.01)
    reference = ga.methods.influence(task, train, queries, curvature=curvature, damping=0.0, weight_decay=0.01)
    np.testing.assert_allclose(S.compute().values, reference.compute().values, rtol=1e-8, atol=1e-12)


def test_source_tracks_the_exact_metagradient_of_a_minibatch_run():
    X, y = data(40, 5)
    run = TrainingRun(mlp(seed=1), ce, (X, y), SGD(0.3, weight_decay=1e-3), batch_size=10, epochs=6, seed=0)
    exact = ga.methods.magic(run, QUERIES).compute().values
    for curvature in ("gauss_newton", "ekfac"):
        S = ga.methods.source(run, TensorDataset(*QUERIES), n_segments=3, checkpoints_per_segment=2,
                              curvature=curvature).compute().values
        corr = np.mean([np.corrcoef(S[q], exact[q])[0, 1] for q in range(len(exact))])
        assert corr > 0.85, (curvature, corr)
        assert 0.5 < np.abs(S).mean() / np.abs(exact).mean() < 2      # same scale (1/N), same sign
    assert isinstance(S, np.ndarray)


def test_source_is_one_gradalg_expression():
    run = TrainingRun(mlp(), ce, TRAIN, SGD(0.3), batch_size=4, epochs=3, seed=0)
    S = ga.methods.source(run, TensorDataset(*QUERIES), n_segments=3)
    assert isinstance(S, ga.Scores) and S.shape == (4, 12)
    text = repr(S)
    assert "(1−(1−ηλ)^K)/λ" in text and "(1−ηλ)^K" in text
    assert "physical" in str(S.explain()).lower() or S.explain() is not None


def test_unroll_spectral_functions_match_their_sums():
    from gradalg.expr.spectral import UnrollDecay, UnrollResponse
    lam = torch.tensor([0.0, 1e-12, 1e-6, 0.3, 1.0, 2.5, -0.2], dtype=F64)
    eta, K = 0.7, 13
    direct = eta * sum((1 - eta * lam) ** k for k in range(K))           # η Σ_{k<K} (1 − ηλ)^k
    torch.testing.assert_close(UnrollResponse(eta, K)(lam), direct, rtol=1e-12, atol=0)
    torch.testing.assert_close(UnrollDecay(eta, K)(lam), (1 - eta * lam) ** K, rtol=1e-14, atol=0)


def test_a_function_of_a_products_only_operator_is_refused():
    from gradalg.expr.spectral import Spectral, UnrollDecay
    task = ga.tasks.classification(mlp())
    train = TensorDataset(*TRAIN)
    H = ga.Operator(Spectral(ga.hessian(task, train).expr, UnrollDecay(0.1, 5)))
    G = ga.grads(task, train)
    with pytest.raises(ga.GradalgError, match="needs its eigendecomposition"):
        (G @ (H @ G.T)).compute()


def test_source_scores_combine_like_scores():
    run = TrainingRun(mlp(), ce, TRAIN, SGD(0.3), batch_size=4, epochs=3, seed=0)
    S = ga.methods.source(run, TensorDataset(*QUERIES), n_segments=2, curvature="gauss_newton")
    both = 2 * S - S / 2
    np.testing.assert_allclose(both.compute().values, 1.5 * S.compute().values, rtol=1e-12, atol=1e-15)
