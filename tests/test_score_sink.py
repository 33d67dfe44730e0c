"""``S.compute(store=...)`` writes through an explicit result sink: a path goes through the
declared Zarr score store (no monkeypatched module global, no import order to get right),
a sink object (``ga.store.ScoreStore`` or any object with ``write_scores``) is used as
given, and bad ``store=`` arguments are refused with a fix that works."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg import api

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import one_thread  # noqa: E402,F401 - an autouse fixture

pytest.importorskip("zarr")
pytest.importorskip("dask")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def scores():
    task = ga.tasks.classification(models.mlp())
    x, y = models.classification_data(23, seed=1)
    xq, yq = models.classification_data(3, seed=2)
    G, Q = ga.grads(task, TensorDataset(x, y)), ga.grads(task, TensorDataset(xq, yq))
    S = Q @ G.T
    return S, S.compute().values


def test_a_score_store_sink_equals_memory_and_the_path_form(scores, tmp_path):
    S, full = scores
    sink = ga.store.ScoreStore(tmp_path / "a.zarr", chunk_rows=np.int32(10))
    assert sink.chunk_rows == 10 and type(sink.chunk_rows) is int
    assert isinstance(sink, api.ScoreSink)
    stored = S.compute(store=sink)
    assert stored.chunks == ((3,), (10, 10, 3))                   # the sink's chunking
    np.testing.assert_allclose(stored.values, full, rtol=1e-10, atol=1e-12)
    by_path = S.compute(store=str(tmp_path / "b.zarr"), chunk_rows=np.int64(10))    # a numpy integer works
    assert by_path.chunks == stored.chunks
    np.testing.assert_allclose(by_path.values, full, rtol=1e-10, atol=1e-12)
    again = S.compute(store=ga.store.ScoreStore(tmp_path / "a.zarr", chunk_rows=10, overwrite=True))
    np.testing.assert_allclose(again.values, full, rtol=1e-10, atol=1e-12)


def test_any_object_with_write_scores_is_a_sink(scores):
    S, full = scores
    seen = []

    class InMemory:
        def write_scores(self, scores, *, executor=None):
            seen.append((scores, executor))
            return scores.compute(executor)

    out = S.compute("local", store=InMemory())
    assert seen == [(S, "local")]
    np.testing.assert_allclose(out.values, full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("store, kwargs, match", [
    (123, {}, "takes a path"),
    (object(), {}, "takes a path"),
    ("SINK", {"chunk_rows": 5}, "carries its own chunking"),
    ("SINK", {"overwrite": True}, "carries its own chunking"),
    (None, {"chunk_rows": 5}, "apply to S.compute"),
])
def test_bad_store_arguments_are_refused_before_anything_runs(scores, tmp_path, store, kwargs, match):
    S, full = scores
    store = ga.store.ScoreStore(tmp_path / "c.zarr") if store == "SINK" else store
    with pytest.raises(ga.OptionError, match=match):
        S.compute(store=store, **kwargs)
    assert not (tmp_path / "c.zarr").exists()
    # the fix the message names: the chunking on the sink
    fixed = S.compute(store=ga.store.ScoreStore(tmp_path / "c.zarr", chunk_rows=5))
    assert fixed.chunks[1][0] == 5
    np.testing.assert_allclose(fixed.values, full, rtol=1e-10, atol=1e-12)


def test_no_module_global_is_patched_and_importing_api_alone_is_enough():
    """The store declares its sink through api.register_path_sink, not by assigning to an
    api global; importing only ``gradalg.api`` (which runs the package's __init__) leaves
    the path form working."""
    assert not hasattr(api, "SCORE_STORE_WRITER")
    source = open(os.path.join(ROOT, "gradalg", "store", "__init__.py")).read()
    assert "_api." not in source
    code = ("import gradalg.api as api; "
            "assert [f.__qualname__ for f in api._PATH_SINK] == ['ScoreStore'], api._PATH_SINK")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_register_path_sink_refuses_a_non_callable():
    with pytest.raises(ga.OptionError, match="takes a callable"):
        api.register_path_sink("scores.zarr")
