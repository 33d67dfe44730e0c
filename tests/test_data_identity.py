"""Data passed as tensors keeps its identity across ``ga.grads`` calls.

``as_data`` wraps tensors in a fresh ``TensorDataset`` on every call; the data's token
must still name the user's tensors, so that two gradient sets over the same tensors
are equal nodes and the planner reads that data in one fused pass.
"""
import os
import sys

import gradalg as ga

sys.path.insert(0, os.path.dirname(__file__))
from models import classification_data, mlp  # noqa: E402


def test_same_tensors_same_data():
    model = mlp()
    task = ga.tasks.classification(model)
    X, y = classification_data()
    assert ga.grads(task, (X, y)) == ga.grads(task, (X, y))
    # identity is content (the same in every process): a copy is the same data, a change is not
    assert ga.grads(task, (X, y)) == ga.grads(task, (X.clone(), y))
    X2 = X.clone()
    X2[3, 1] += 1.0
    assert ga.grads(task, (X, y)) != ga.grads(task, (X2, y))


def test_influence_on_tensors_reads_the_training_set_once():
    model = mlp()
    task = ga.tasks.classification(model)
    X, y = classification_data()
    train, queries = (X, y), (X[:5], y[:5])
    G, Q = ga.grads(task, train), ga.grads(task, queries)
    C = ga.grads(task, train, objective="expected")
    P = ga.proj.kron(k=16)
    S = P(Q) @ ga.fisher(P(C)).damp(1e-3).inv() @ P(G).T
    ex = ga.LocalExecutor()
    S.compute(ex)
    assert ex.last_plan.data_passes == 2   # the queries, then the training set once (fused)
