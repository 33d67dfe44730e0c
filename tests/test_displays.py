"""Displays are pure: ``repr``, ``explain()`` (text and HTML) call no model (not even on
the meta device), benchmark nothing and show no internal node ids; ``Q @ G.T`` shows no
identity operator."""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread  # noqa: E402,F401 - one_thread is an autouse fixture

import gradalg as ga  # noqa: E402
from gradalg.plan import devices  # noqa: E402

NODE_ID = re.compile(r"\b[a-z_]+-[0-9a-f]{12}\b")


class AnyForward:
    """Counts every forward call of any module of the model, on any device."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __enter__(self):
        self.handles = [m.register_forward_hook(lambda *a: setattr(self, "calls", self.calls + 1))
                        for m in self.model.modules()]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@pytest.fixture
def no_benchmark(tmp_path, monkeypatch):
    """A machine never measured (empty cache) where measuring fails the test."""
    monkeypatch.setenv("GRADALG_CACHE", str(tmp_path))

    def refuse():
        raise AssertionError("a display benchmarked the device")
    monkeypatch.setattr(devices, "_measure_cpu", refuse)


def expressions():
    model = models.cnn()
    X, y = models.image_data(n=10)
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, (X, y)), ga.grads(task, (X[:3], y[:3]))
    P = ga.proj.kron(k=4, seed=0)
    yield model, Q @ G.T
    yield model, P(Q) @ ga.fisher(P(G)).damp(1e-2).inv() @ P(G).T
    yield model, ga.methods.influence(task, (X, y), (X[:3], y[:3]), curvature="ekfac")


def test_repr_and_explain_call_no_model_and_benchmark_nothing(no_benchmark):
    for model, S in expressions():
        with AnyForward(model) as seen:
            texts = [repr(S), S._repr_html_(), str(S.explain()), S.explain()._repr_html_(),
                     str(S.explain(stage="physical")), S.explain(stage="costed")._repr_html_()]
        assert seen.calls == 0, "a display ran the model"
        for text in texts:
            assert not NODE_ID.search(text), NODE_ID.search(text).group(0)


def test_a_plain_inner_product_shows_no_identity_operator(no_benchmark):
    _, S = next(expressions())
    for text in (repr(S), str(S.explain(stage="logical"))):
        assert "identity" not in text and "─ I " not in text, text

