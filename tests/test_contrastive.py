"""Contrastive queries (ga.tasks.contrastive + ga.tasks.contrast_pairs): the query gradient
∇(L_b − L_c) against a loop-of-backward oracle (float64, each sequence alone, unpadded),
and every method's scores against dense references built from it."""
from __future__ import annotations

import pytest
import torch
from references import one_thread  # noqa: F401 - fixture
from test_tasks_lm import F64, close, dense, gpt2, items, next_token_nll, oracle

import gradalg as ga
from gradalg.errors import DataError, OptionError


def setup(seed=0):
    model, layers = gpt2(seed)
    train = items(6)
    behaviour = items(3, lengths=(5, 8, 4), seed=4)
    control = items(3, lengths=(7, 3, 6), seed=5)          # other lengths: each side padded on its own
    return model, layers, train, behaviour, control


def contrast_oracle(model, layers, behaviour, control):
    nll = lambda logits, seq: next_token_nll(logits, seq)  # noqa: E731
    return oracle(model, layers, behaviour, nll) - oracle(model, layers, control, nll)


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_query_gradient_is_the_difference_of_losses(batch_size):
    model, layers, _, behaviour, control = setup()
    task = ga.tasks.contrastive(ga.tasks.causal_lm(model))
    Q = ga.grads(task, ga.tasks.contrast_pairs(behaviour, control, batch_size=batch_size), layers)
    close(dense(Q, layers), contrast_oracle(model, layers, behaviour, control))


def test_grad_dot_and_dense_influence_match_references():
    model, layers, train, behaviour, control = setup()
    base = ga.tasks.causal_lm(model)
    task = ga.tasks.contrastive(base)
    pairs = ga.tasks.contrast_pairs(behaviour, control)
    G = oracle(model, layers, train, lambda lg, s: next_token_nll(lg, s))
    q = contrast_oracle(model, layers, behaviour, control)
    S = ga.methods.grad_dot(task, train, pairs, layers=layers).compute()
    close(torch.as_tensor(S.values), q @ G.T)
    lam = 1e-2
    S = ga.methods.influence(task, train, pairs, layers=layers, curvature="empirical", damping=lam).compute()
    eye = torch.eye(G.shape[1], dtype=F64)
    close(torch.as_tensor(S.values), q @ torch.linalg.solve(G.T @ G / len(train) + lam * eye, G.T), 1e-7)
    # plain training items through the contrastive task: the base task's own gradients
    close(dense(ga.grads(task, train, layers), layers), G)


@pytest.mark.parametrize("method", ["trak", "logra", "ekfac"])
def test_projected_methods_score_behaviour_minus_control(method):
    """TRAK (query side ∇(f_b − f_c)), LoGra (projected rows) and EK-FAC influence are linear
    in the query gradient: the contrastive scores are the behaviour's minus the control's."""
    model, layers, train, behaviour, control = setup()
    base = ga.tasks.causal_lm(model)
    task = ga.tasks.contrastive(base)
    run = {"trak": lambda t, q: ga.methods.trak(t, train, q, layers=layers, k=32, seed=3),
           "logra": lambda t, q: ga.methods.logra(t, train, q, layers=layers, k=16, seed=3),
           "ekfac": lambda t, q: ga.methods.influence(t, train, q, layers=layers, curvature="ekfac")}[method]
    S = torch.as_tensor(run(task, ga.tasks.contrast_pairs(behaviour, control)).compute().values)
    Sb = torch.as_tensor(run(base, behaviour).compute().values)
    Sc = torch.as_tensor(run(base, control).compute().values)
    close(S, Sb - Sc, 1e-7)


def test_trak_query_side_is_the_output_difference():
    model, layers, _, behaviour, control = setup()
    base = ga.tasks.causal_lm(model)
    task = ga.tasks.contrastive(base)
    phi = dense(ga.grads(task, ga.tasks.contrast_pairs(behaviour, control), layers, objective="output"), layers)
    ref = dense(ga.grads(base, behaviour, layers, objective="output"), layers) - \
        dense(ga.grads(base, control, layers, objective="output"), layers)
    close(phi, ref)


def test_mismatched_pairs_and_pairs_as_curvature_data_are_refused():
    model, layers, train, behaviour, control = setup()
    with pytest.raises(DataError, match="3 behaviour queries but 2 controls"):
        ga.tasks.contrast_pairs(behaviour, control[:2])
    with pytest.raises(DataError, match="no queries"):
        ga.tasks.contrast_pairs([], [])
    with pytest.raises(OptionError, match="positive int"):
        ga.tasks.contrast_pairs(behaviour, control, batch_size=0)
    with pytest.raises(OptionError, match="needs a ga.Task"):
        ga.tasks.contrastive(model)
    task = ga.tasks.contrastive(ga.tasks.causal_lm(model))
    pairs = ga.tasks.contrast_pairs(behaviour, control)
    with pytest.raises(OptionError, match="contrastive pairs are queries"):
        ga.grads(task, pairs, layers, objective="sampled").to_dense()
    bad = [dict(control[0]), {"input_ids": torch.tensor([3]), "attention_mask": torch.tensor([1])}, control[2]]
    with pytest.raises(ga.BatchContentError, match="the control side of contrastive queries") as err:
        ga.grads(task, ga.tasks.contrast_pairs(behaviour, bad), layers).to_dense()
    assert err.value.example_ids == [1]


def test_tensor_pairs_for_a_classifier():
    """Tuple items (x, y): the control is the same input with another label."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(F64)
    x = torch.randn(4, 4, dtype=F64)
    yb, yc = torch.tensor([0, 1, 2, 0]), torch.tensor([1, 2, 0, 2])
    mean = ga.Task(model, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), reduction="mean")
    for base in (ga.tasks.classification(model), mean):
        Q = ga.grads(ga.tasks.contrastive(base), ga.tasks.contrast_pairs((x, yb), (x, yc), batch_size=3))
        blocks = Q.to_dense()
        close(torch.cat([blocks[n].flatten(1) for n in ("0", "2")], 1), reference(model, x, yb, yc))


def reference(model, x, yb, yc):
    ref = []
    for i in range(4):
        rows = []
        for y in (yb, yc):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
            rows.append(torch.cat([torch.cat([m.weight.grad, m.bias.grad[:, None]], 1).flatten()
                                   for m in (model[0], model[2])]))
        ref.append(rows[0] - rows[1])
    return torch.stack(ref)


def test_planner_sees_both_sides_tokens():
    """The factored width of a paired query is T_b + T_c per layer (two forward calls,
    concatenated): the planner's positions per example, which the ghost / dense decision
    uses, count both sides."""
    from gradalg.plan.cost import tokens_hint
    model, layers, _, behaviour, control = setup()
    task = ga.tasks.contrastive(ga.tasks.causal_lm(model))
    Q = ga.grads(task, ga.tasks.contrast_pairs(behaviour, control), layers)
    assert tokens_hint(Q.expr) == len(behaviour[0]["input_ids"]) + len(control[0]["input_ids"])
    S = ga.methods.grad_dot(task, items(6), ga.tasks.contrast_pairs(behaviour, control), layers=layers)
    assert "needs T" not in str(S.explain())
