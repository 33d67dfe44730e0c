"""Node identity is deterministic across processes and follows content: tokens computed
in two fresh interpreters agree; a pickled DataRef keeps its name (the Dask shard bug:
``restrict`` matched nothing and every shard read the whole dataset); tensors of any
size are hashed by value; cached digests are invalidated by in-place writes.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

import gradalg as ga
from gradalg import fingerprint
from gradalg.data import as_data

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROGRAM = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import gradalg as ga
    from torch.utils.data import DataLoader, TensorDataset
    from models import classification_data, mlp
    from reliability_datasets import ListDataset
    model = mlp(); task = ga.tasks.classification(model); X, y = classification_data(n=20)
    big = torch.arange(2_000_000, dtype=torch.float64)       # above any size threshold
    G = ga.grads(task, (X, y))
    nodes = [G, ga.grads(task, TensorDataset(X, y)), ga.grads(task, DataLoader(TensorDataset(X, y), batch_size=3)),
             ga.grads(task, ListDataset(X, y)), ga.proj.kron(k=4, seed=3)(G),
             G @ ga.fisher(G).damp(1e-3).inv() @ ga.grads(task, (X[:2], y[:2])).T]
    print(task.token)
    for n in nodes:
        print(n.expr.token)
    print(ga.expr.tokenize(big))
""")


def _tokens_in_a_new_process() -> list[str]:
    code = _PROGRAM.format(tests=os.path.dirname(__file__))
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONHASHSEED="random", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_tokens_agree_across_two_processes():
    first, second = _tokens_in_a_new_process(), _tokens_in_a_new_process()
    assert len(first) == 8
    assert first == second


def test_a_pickled_dataref_keeps_its_name_and_restrict_matches():
    import cloudpickle    # how Dask ships jobs to workers

    X, y = models.classification_data(n=20)
    for data in (TensorDataset(X, y), DataLoader(TensorDataset(X, y), batch_size=4)):
        ref = as_data(data)
        copy = pickle.loads(pickle.dumps(ref))
        assert copy.token == ref.token and copy == ref
        task = ga.tasks.classification(models.mlp())
        src = ga.grads(task, ref).expr
        shard = pickle.loads(cloudpickle.dumps(src)).restrict(ref.token, 5, 9)
        assert shard.data.n == 4 and shard.data.ids == tuple(range(5, 9))


def test_datasets_are_named_by_content():
    from reliability_datasets import ListDataset
    X, y = models.classification_data(n=10)
    a, b = as_data(ListDataset(X, y)), as_data(ListDataset(X.clone(), y.clone()))
    assert a == b
    X2 = X.clone()
    X2[0, 0] += 1
    assert as_data(ListDataset(X2, y)) != a
    assert as_data(Subset(TensorDataset(X, y), [1, 2])) != as_data(Subset(TensorDataset(X, y), [2, 1]))


def test_big_tensors_are_hashed_by_value_and_in_place_writes_are_seen():
    t = torch.zeros(1_500_000)
    token = ga.expr.tokenize(t)
    assert ga.expr.tokenize(torch.zeros(1_500_000)) == token          # value, not identity
    t[123_456] = 1.0                                                   # in place: version bumps
    assert ga.expr.tokenize(t) != token
    # a write through .data bypasses the version counter: forget() (or the option) sees it
    before = ga.expr.tokenize(t)
    t.data[7] = 5.0
    fingerprint.forget(t)
    assert ga.expr.tokenize(t) != before
    with ga.options(fingerprint_cache=False):
        t.data[8] = 5.0
        assert ga.expr.tokenize(t) != ga.expr.tokenize(torch.zeros(1_500_000))


def test_training_a_model_changes_its_tasks_token():
    model = models.mlp()
    task = ga.tasks.classification(model)
    X, y = models.classification_data(n=8)
    token = task.token
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(X), y).backward()
    opt.step()
    assert task.token != token
    # losses are part of the identity
    other = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum", label_smoothing=0.1))
    same = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum", label_smoothing=0.1))
    assert other.token == same.token != ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum")).token


def test_unpicklable_datasets_get_a_name_for_their_lifetime():
    class Opaque(Dataset):
        def __init__(self, X):
            self.X, self.lock = X, __import__("threading").Lock()   # a lock cannot be pickled

        def __len__(self):
            return len(self.X)

        def __getitem__(self, i):
            return self.X[i]

    X, _ = models.classification_data(n=6)
    d = Opaque(X)
    assert as_data(d) == as_data(d)
    assert as_data(d) != as_data(Opaque(X))        # never confused with another object
    assert not fingerprint.is_stable(as_data(d).key)
