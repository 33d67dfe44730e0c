"""Every DataArray a computation returns is assembled by one function,
:func:`gradalg.token_scores.labelled`, from its values and its axes (scores, self-scores,
a top-k; per-token sides add a token axis whose padding is NaN)."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import torch

import gradalg.api as api
import gradalg.token_scores as token_scores
from gradalg.token_scores import Axis, labelled


def test_labelled_reshapes_token_axes_and_pads_with_nan():
    # 2 queries of 3 positions x 2 training examples of 2 positions: (6, 4) rows
    values = torch.arange(24, dtype=torch.float64).reshape(6, 4)
    q_valid = np.array([[True, True, False], [True, True, True]])
    t_valid = np.array([[True, False], [True, True]])
    out = labelled(values, [Axis("query", np.array(["a", "b"]), 3, q_valid),
                            Axis("train", np.array([10, 11]), 2, t_valid)], "scores", {"expression": "x"})
    assert out.dims == ("query", "query_token", "train", "train_token")
    want = values.numpy().reshape(2, 3, 2, 2).copy()
    want[0, 2] = np.nan                     # query a's third position is padding
    want[:, :, 0, 1] = np.nan               # training example 10's second position
    np.testing.assert_array_equal(out.values, want)
    assert list(out.coords["train"].values) == [10, 11] and list(out.coords["query_token"].values) == [0, 1, 2]
    assert out.attrs["expression"] == "x" and "NaN" in out.attrs["padding"]
    assert values[0, 0] == 0    # the input is not written to


def test_labelled_keeps_example_rows_as_they_are():
    values = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    out = labelled(values, [Axis("query", np.array([0, 1])), Axis("rank", np.arange(3))], "scores",
                   coords={"train": (("query", "rank"), np.array([[5, 6, 7], [7, 6, 5]]))})
    assert out.dims == ("query", "rank") and out.dtype == np.float64 and "padding" not in out.attrs
    np.testing.assert_array_equal(out.values, values.numpy())
    assert out.coords["train"].values.tolist() == [[5, 6, 7], [7, 6, 5]]


def test_no_other_result_assembly_in_the_api():
    """api.py and token_scores.py build a DataArray in one place: ``labelled``; so do the
    results of a store's index search, MAGIC and a recorded trajectory."""
    from importlib import import_module

    others = [import_module(f"gradalg.{name}") for name in ("store.gradient_index", "methods.magic",
                                                            "integrations.trajectory")]
    for module, allowed in ((api, 0), (token_scores, 1), *((m, 0) for m in others)):
        tree = ast.parse(Path(module.__file__).read_text())
        made = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("DataArray")]
        assert len(made) == allowed, (module.__name__, [ast.unparse(n)[:60] for n in made])
