"""``benchmarks/fidelity_more.py``'s three settings at tiny size: training is deterministic
given the seed (the ground truth's premise), and a method called at its defaults, as the
benchmark calls it, matches the dense torch.func reference (``ga.per_example_grads``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import gradalg as ga
from gradalg.capture.hooks import resolve_layers
from gradalg.capture.reference import block_param_names
from references import one_thread  # noqa: F401 - one intra-op thread in this module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fidelity_more as fm  # noqa: E402

TINY = {
    "llama": lambda: fm.Llama(n_train=12, n_query=4, hidden=16, steps=4),
    "conv": lambda: fm.Conv(n_train=24, n_query=6, channels=2, steps=4),
    "seqcls": lambda: fm.SeqCls(n_train=12, n_query=4, hidden=16, steps=4, pretrain_steps=3,
                                pretrain_modules=2, cache=False),
}


@pytest.fixture(scope="module", params=sorted(TINY))
def setting(request):
    return TINY[request.param]()


def test_training_is_deterministic_given_the_seed(setting):
    subset = list(range(0, setting.n_train, 2))
    a = setting.query_targets(setting.train_model(subset, seed=3))        # (n_query,)
    b = setting.query_targets(setting.train_model(subset, seed=3))
    c = setting.query_targets(setting.train_model(subset, seed=4))
    assert a.shape == (setting.n_query,) and torch.isfinite(a).all()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)                  # the seed reaches the init / batch stream


def test_ground_truth_averages_its_runs(setting):
    gt = fm.ground_truth(setting, n_subsets=2, seeds_per_subset=2, store=False)
    runs = torch.as_tensor(gt["runs"].values)                               # (subset, run, query)
    torch.testing.assert_close(torch.as_tensor(gt["targets"].values), runs.mean(1))
    assert not torch.equal(runs[:, 0], runs[:, 1])


def test_grad_dot_at_its_defaults_matches_the_dense_reference(setting):
    model = setting.train_model(seed=0)
    task = setting.task(model)
    scores = ga.methods.grad_dot(task, setting.train, setting.queries).compute()   # (n_query, n_train)
    names = [n for ref in resolve_layers(model, task.layers_for(None)) for n in block_param_names(model, ref)]
    assert names

    def rows(batch):                                                       # (B, d) float64
        grads = ga.per_example_grads(task, batch, names, method="loop")
        return torch.cat([grads[n].flatten(1) for n in names], 1).double()

    dense = rows(setting.query_data) @ rows(setting.data).T
    assert scores.shape == (setting.n_query, setting.n_train)
    torch.testing.assert_close(torch.as_tensor(scores.values, dtype=torch.float64), dense,
                               rtol=1e-4, atol=1e-6 * float(dense.abs().max()))
