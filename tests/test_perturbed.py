"""``ga.methods.perturbed``: copies of the model, each parameter tensor moved by
N(0, (s · rms)²) noise, for ``ga.methods.ensemble`` — the noise's size and seeding, the tied
tensors, the model left untouched, and an ensemble over the copies against a loop-of-backward
reference of each copy's Grad-Dot scores."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradalg as ga
from gradalg.errors import OptionError

from models import classification_data, gpt2, lm_task, mlp
from references import one_thread  # noqa: F401 - autouse fixture


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_noise_is_scaled_to_each_tensor_and_the_model_is_untouched():
    model = mlp(d_in=64, hidden=256, classes=10)
    before = _params(model)
    copies = ga.methods.perturbed(ga.tasks.classification(model), members=3, scale=0.2, seed=5)
    assert len(copies) == 3
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), before[name].numpy())
    for task in copies:
        assert task.model is not model
        for name, p in task.model.named_parameters():
            rms = float(before[name].pow(2).mean().sqrt())
            delta = (p.detach() - before[name]).reshape(-1)
            if delta.numel() >= 1000:                          # enough draws to read the noise's size
                assert float(delta.std()) == pytest.approx(0.2 * rms, rel=0.1)
                assert abs(float(delta.mean())) < 0.2 * rms * 5 / delta.numel() ** 0.5
    # the copies are different draws; the same seed gives the same copies, another seed others
    w = [t.model[0].weight.detach() for t in copies]
    assert not torch.equal(w[0], w[1])
    again = ga.methods.perturbed(ga.tasks.classification(model), members=3, scale=0.2, seed=5)
    assert all(torch.equal(a.model[0].weight, b.model[0].weight) for a, b in zip(copies, again))
    other = ga.methods.perturbed(ga.tasks.classification(model), members=1, scale=0.2, seed=6)
    assert not torch.equal(other[0].model[0].weight, copies[0].model[0].weight)


def test_a_tied_embedding_stays_tied_and_moves_once():
    model = gpt2(tied=True, n_layer=1, n_embd=32)
    (copy,) = ga.methods.perturbed(lm_task(model), members=1, scale=0.3)
    assert copy.model.lm_head.weight is copy.model.transformer.wte.weight
    rms = float(model.transformer.wte.weight.detach().pow(2).mean().sqrt())
    delta = (copy.model.transformer.wte.weight - model.transformer.wte.weight).detach()
    assert float(delta.std()) == pytest.approx(0.3 * rms, rel=0.1)   # once: twice would be √2 × larger


def test_the_ensemble_over_copies_is_the_mean_of_each_copys_scores():
    X, y = classification_data(n=12, d_in=8, classes=3)
    Xq, yq = X[:4] + 0.1, y[:4]
    tasks = ga.methods.perturbed(ga.tasks.classification(mlp()), members=3, scale=0.3, seed=0)
    S = ga.methods.ensemble(ga.methods.grad_dot, tasks, (X, y), (Xq, yq)).compute().values

    def per_example_grads(model, X, y):
        rows = []
        for i in range(len(X)):
            model.zero_grad()
            F.cross_entropy(model(X[i:i + 1]), y[i:i + 1], reduction="sum").backward()
            rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        return torch.stack(rows)

    reference = np.mean([(per_example_grads(t.model, Xq, yq) @ per_example_grads(t.model, X, y).T).numpy()
                         for t in tasks], axis=0)
    np.testing.assert_allclose(S, reference, rtol=1e-10, atol=1e-12)
    single = ga.methods.grad_dot(tasks[0], (X, y), (Xq, yq)).compute().values
    assert np.abs(S - single).max() > 1e-3 * np.abs(S).max()            # the members differ


@pytest.mark.parametrize("kwargs, match", [
    (dict(members=0), "members must be a positive int"),
    (dict(members=2.0), "members must be a positive int"),
    (dict(scale=0.0), "scale must be a positive finite number"),
    (dict(scale=float("nan")), "scale must be a positive finite number"),
    (dict(scale="0.3"), "scale must be a positive finite number"),
    (dict(seed=None), "seed must be an int"),
])
def test_bad_options_are_refused_with_the_fix(kwargs, match):
    with pytest.raises(OptionError, match=match):
        ga.methods.perturbed(ga.tasks.classification(mlp()), **kwargs)


def test_a_model_instead_of_a_task_is_refused():
    with pytest.raises(OptionError, match="perturbed takes a ga.Task"):
        ga.methods.perturbed(mlp())


def test_copies_of_a_task_already_scored_are_not_taken_for_it():
    """The copies share the task's loss functions but not its model: a plan over the original and
    its copies must not reuse the original's passes (its token) for them."""
    X, y = classification_data(n=12, d_in=8, classes=3)
    task = ga.tasks.classification(mlp())
    first = ga.methods.grad_dot(task, (X, y), (X[:3], y[:3])).compute().values     # the original, scored first
    copies = ga.methods.perturbed(task, members=2, scale=0.3)
    assert len({task.token, copies[0].token, copies[1].token}) == 3
    S = ga.methods.ensemble(ga.methods.grad_dot, [task, *copies], (X, y), (X[:3], y[:3])).compute().values
    each = [first] + [ga.methods.grad_dot(t, (X, y), (X[:3], y[:3])).compute().values for t in copies]
    np.testing.assert_allclose(S, np.mean(each, axis=0), rtol=1e-12, atol=1e-14)
    assert np.abs(each[1] - first).max() > 1e-2 * np.abs(first).max()
