"""A heat map of one query's per-token scores (matplotlib).

    S = (Q @ H @ G.per_token().T).compute()          # ("query", "train", "train_token")
    fig = ga.viz.token_heatmap(S, query=0, top=8)    # top training sequences × their tokens

    S = (Q.per_token() @ H @ G.T).compute()          # ("query", "query_token", "train")
    fig = ga.viz.token_heatmap(S, query=0, top=8, tokens=["The", " cat", ...])

Rows are the ``top`` training examples by total score (the sum over the token axis,
which is the ordinary score), columns the token positions; the colour is the score,
on a diverging scale centred at 0 (red helps, blue hurts). Padding (NaN) is blank.
"""
from __future__ import annotations

from ..errors import OptionError

import numpy as np

__all__ = ["token_heatmap"]


def token_heatmap(scores, query=None, *, top: int = 10, tokens=None, by: str = "total", ax=None,
                  cmap: str = "RdBu_r", annotate: bool | None = None):
    """Heat map of one query's per-token scores; returns the matplotlib ``Figure``.

    Parameters
    ----------
    scores : xarray.DataArray from ``Scores.compute()`` with dims ("query", "query_token",
        "train") or ("query", "train", "train_token").
    query : the query's id (a coordinate of "query"); default the first query.
    top : how many training examples to show (rows), ranked by ``by``.
    by : "total" (sum over tokens: the ordinary score, most positive first) or "abs"
        (largest |total| first).
    tokens : token strings for the columns: a list (query tokens, or the same for every
        training row) or, for training tokens, a dict {train id: list of strings} written
        into the cells.
    ax : an existing matplotlib Axes to draw on.
    annotate : write each cell's value (default: when the grid is at most 20 × 30).
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    dims = set(scores.dims)
    if {"query_token", "train_token"} <= dims:
        raise OptionError("the scores have both a query_token and a train_token axis: reduce one first, "
                         "e.g. token_heatmap(S.sum('query_token'), ...)")
    if "query_token" in dims:
        token_dim = "query_token"
    elif "train_token" in dims:
        token_dim = "train_token"
    else:
        raise OptionError(f"token_heatmap needs per-token scores (a query_token or train_token axis); got dims "
                         f"{scores.dims}: compute Q.per_token() @ G.T or Q @ G.per_token().T")
    if by not in ("total", "abs"):
        raise OptionError(f"by must be 'total' or 'abs', got {by!r}")
    one = scores.isel(query=0) if query is None else scores.sel(query=query)
    qid = one["query"].item() if "query" in one.coords else query
    grid = one.transpose("train", token_dim)
    total = grid.sum(token_dim, skipna=True).values
    order = np.argsort(-(np.abs(total) if by == "abs" else total), kind="stable")[:top]
    values = grid.values[order]                                 # (top, T)
    train_ids = grid["train"].values[order]

    if ax is None:
        fig, ax = plt.subplots(figsize=(min(2.0 + 0.55 * values.shape[1], 18), 1.2 + 0.45 * len(order)))
    else:
        fig = ax.figure
    finite = values[np.isfinite(values)]
    vmax = float(np.abs(finite).max()) if finite.size and np.abs(finite).max() > 0 else 1.0
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, aspect="auto", interpolation="nearest",
                      norm=TwoSlopeNorm(vcenter=0.0, vmin=-vmax, vmax=vmax))
    fig.colorbar(image, ax=ax, label="score")
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([f"{i} ({t:.3g})" for i, t in zip(train_ids, total[order])])
    ax.set_ylabel("training example (total score)")
    positions = grid[token_dim].values
    ax.set_xticks(range(len(positions)))
    cell_text = None
    if isinstance(tokens, dict):
        cell_text = [list(tokens.get(i, ())) for i in train_ids]
        ax.set_xticklabels([str(p) for p in positions])
    elif tokens is not None:
        if len(tokens) > len(positions):
            raise OptionError(f"got {len(tokens)} token strings for {len(positions)} positions")
        ax.set_xticklabels(list(tokens) + [""] * (len(positions) - len(tokens)), rotation=60, ha="right")
    else:
        ax.set_xticklabels([str(p) for p in positions])
    ax.set_xlabel("query token" if token_dim == "query_token" else "training token")
    ax.set_title(f"per-token scores of query {qid}")
    if annotate is None:
        annotate = values.shape[0] <= 20 and values.shape[1] <= 30
    for r in range(values.shape[0]):
        for c in range(values.shape[1]):
            text = None
            if cell_text is not None and c < len(cell_text[r]):
                text = str(cell_text[r][c])
            elif annotate and np.isfinite(values[r, c]):
                text = f"{values[r, c]:.2g}"
            if text is not None:
                ax.text(c, r, text, ha="center", va="center", fontsize=7)
    fig.tight_layout()
    return fig
