"""Results as labelled arrays: one function, :func:`labelled`, makes every DataArray a
computation returns (scores, self-scores, a top-k) from its values and its axes; a side
of per-token rows adds a token axis, its padding NaN.

A score matrix whose left rows are ``Q.per_token()`` has (n_query · T_q) rows, row
(q, t) at index q·T_q + t; its right side likewise. :func:`scores_array` reshapes it to

    ("query", "train")                                   Q @ H @ G.T
    ("query", "query_token", "train")                    Q.per_token() @ H @ G.T
    ("query", "train", "train_token")                    Q @ H @ G.per_token().T
    ("query", "query_token", "train", "train_token")     both

with integer coordinates ``query_token`` / ``train_token`` = 0..T-1 (the positions of the
layers' sequence), and self-scores to ("train",) or ("train", "train_token"). Positions
that are not tokens of the example — where the task's ``token_mask`` is False, or past
the mask's width — are **NaN**; xarray's reductions skip them, so
``scores.sum("train_token")`` equals ``(Q @ H @ G.T).compute()``.
Rows captured by ``ga.capture`` carry no batches: every position up to ``tokens`` is
kept (their padding rows are zero where the task's ``token_mask`` zeroed them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .data import batch_size_of
from .expr import Inner, ScoreDiagonal, ScoreNode, ScoreSum, Source
from .expr.tokens import PerToken, per_token_node

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["Axis", "labelled", "scores_array", "self_scores_array", "token_sides", "valid_positions"]


def _first_inner(node: ScoreNode) -> Inner:
    while isinstance(node, ScoreSum):
        node = node.terms[0]   # terms share ids (checked when the sum is built)
    return node


def token_sides(node: ScoreNode) -> tuple[PerToken | None, PerToken | None]:
    """The per-token nodes of the left and right sides of ``node`` (None for example rows)."""
    inner = _first_inner(node)
    if not isinstance(inner, Inner):
        return None, None
    return per_token_node(inner.left), per_token_node(inner.right)


def valid_positions(pt: PerToken, batch_size: int) -> np.ndarray:
    """(n, tokens) bool: True where position t is a token of example i.

    From the task's ``token_mask`` on each batch of the data (no model is run); all True
    when the task has none or the rows were captured by ``ga.capture``.
    """
    src = pt.source
    n, T = pt.grads.n, pt.tokens
    mask_fn = getattr(getattr(src, "task", None), "token_mask", None)
    if not isinstance(src, Source) or mask_fn is None:
        return np.ones((n, T), dtype=bool)
    out = np.zeros((n, T), dtype=bool)
    start = 0
    for batch in src.data.loader(batch_size):
        b = batch_size_of(batch)
        m = torch.as_tensor(mask_fn(batch)).bool().cpu().numpy()
        width = min(m.shape[1], T)
        out[start:start + b, :width] = m[:, :width]
        start += b
    return out


@dataclass(frozen=True)
class Axis:
    """One axis of a result: its ``dim`` and ``labels`` (n,); a side of per-token rows
    adds the axis ``{dim}_token`` of ``tokens`` positions after it, NaN where ``valid``
    (n, tokens) is False."""

    dim: str
    labels: np.ndarray
    tokens: int | None = None
    valid: np.ndarray | None = None


def side_axis(dim: str, pt: PerToken | None, ids, batch_size: int) -> Axis:
    """The axis of one side: its example ids, and for per-token rows (``pt``) their
    positions and which are tokens (:func:`valid_positions`)."""
    if pt is None:
        return Axis(dim, np.asarray(ids))
    return Axis(dim, np.asarray(pt.example_ids), pt.tokens, valid_positions(pt, batch_size))


def labelled(values, axes: list[Axis], name: str, attrs: dict | None = None, coords: dict | None = None
             ) -> xr.DataArray:
    """``values`` as a DataArray over ``axes`` (``coords``: more coordinates, e.g. a
    top-k's training ids over (query, rank)). Without token axes the values are kept as
    they are (numpy from torch; a Dask array stays lazy); with them, ``values`` (n_rows,
    ...) with n_rows = n·tokens per side is reshaped to (n, tokens, ...) in float32 at
    least and its padding positions set to NaN."""
    import xarray as xr
    dims, shape, all_coords = [], [], {}
    for ax in axes:
        dims.append(ax.dim)
        shape.append(len(ax.labels))
        all_coords[ax.dim] = ax.labels
        if ax.tokens is not None:
            dims.append(f"{ax.dim}_token")
            shape.append(ax.tokens)
            all_coords[f"{ax.dim}_token"] = np.arange(ax.tokens)
    a = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else values
    if any(ax.tokens is not None for ax in axes):
        a = np.asarray(a)
        a = a.reshape(shape).astype(np.result_type(a.dtype, np.float32), copy=True)
        for ax in axes:
            if ax.tokens is not None:       # a view with this side's (n, T) axes in front
                at = dims.index(f"{ax.dim}_token")
                np.moveaxis(a, (at - 1, at), (0, 1))[~ax.valid] = np.nan
        attrs = dict(attrs or {}, padding="NaN at positions that are not tokens of the example (token_mask False); "
                                          "xarray reductions skip them")
    return xr.DataArray(a, dims=tuple(dims), coords={**all_coords, **(coords or {})}, name=name, attrs=attrs or {})


def scores_array(values, node: ScoreNode, batch_size: int, attrs: dict) -> xr.DataArray:
    """``values`` (n_left_rows, n_right_rows) of ``node`` as a DataArray ("query", "train"),
    with the token axes of per-token sides."""
    left, right = token_sides(node)
    return labelled(values, [side_axis("query", left, node.row_ids, batch_size),
                             side_axis("train", right, node.col_ids, batch_size)], "scores", attrs)


def self_scores_array(values, node: ScoreDiagonal, batch_size: int, attrs: dict | None = None) -> xr.DataArray:
    """Self-scores ``values`` (n_rows,) of ``node`` as a DataArray ("train",), or (n, T)
    ("train", "train_token") for per-token rows."""
    pt, _ = token_sides(node.scores)
    return labelled(values, [side_axis("train", pt, node.ids, batch_size)], "self_scores", attrs)
