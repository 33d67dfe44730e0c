"""A plot of scores over training time: the cumulative score of the top training examples.

Pure display: it reads what it is given (a ``TrajectoryScores`` from ``ga.trajectory``, or
an xarray ``(query, train, step)`` of per-step scores) and imports nothing above this floor.
"""
from __future__ import annotations

import numpy as np

from ..errors import OptionError

__all__ = ["plot_trajectory"]


def _per_step(scores):
    """The (query, train, step) DataArray of per-step scores from either input."""
    array = getattr(scores, "array", scores)
    dims = getattr(array, "dims", None)
    if dims is None or set(dims) != {"query", "train", "step"}:
        raise OptionError("plot_trajectory takes ga.trajectory(...).scores or an xarray with dims "
                          f"(query, train, step), got {type(scores).__name__}"
                          + (f" with dims {tuple(dims)}" if dims is not None else ""))
    return array.transpose("query", "train", "step")


def plot_trajectory(scores, query, *, top: int = 5, bottom: int = 0, ax=None):
    """Cumulative score ``Σ_{s ≤ t} τ_{q,i,s}`` against step ``t`` for the ``top`` training
    examples with the largest total score for ``query`` (an id), and the ``bottom`` ones with
    the smallest (dashed). One line per example, labelled ``"train <id>"``, best first.

    A step whose score was not kept (``topk``) makes the line stop there (NaN), never a
    partial sum. Returns the matplotlib Figure (drawn on ``ax`` when given).
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:   # pragma: no cover - matplotlib is a test dependency
        raise OptionError("plot_trajectory needs matplotlib: pip install matplotlib") from err
    for name, k in (("top", top), ("bottom", bottom)):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise OptionError(f"{name} must be a non-negative int, got {k!r}")
    array = _per_step(scores)
    if query not in set(array["query"].values.tolist()):
        raise OptionError(f"query {query!r} is not among the scores' queries {array['query'].values.tolist()[:10]}")
    cum = array.sel(query=query).cumsum("step", skipna=False)                      # (train, step)
    totals = array.sel(query=query).sum("step", skipna=False).values              # (train,)
    if hasattr(scores, "total"):
        totals = scores.total().sel(query=query).sel(train=array["train"]).values   # exact with topk
    order = np.argsort(-totals, kind="stable")
    picks = [(int(i), "-") for i in order[:top]]
    if bottom:
        picks += [(int(i), "--") for i in order[::-1][:bottom] if int(i) not in {p for p, _ in picks}]
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3.4))
    else:
        fig = ax.figure
    steps = array["step"].values
    for i, style in picks:
        ax.plot(steps, cum.values[i], style, label=f"train {array['train'].values[i]}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cumulative score Σ τ")
    ax.set_title(f"query {query}: score over training")
    ax.legend(fontsize="small")
    return fig
