"""Scores over per-token rows as labelled arrays: token axes, positions, padding as NaN.

A score matrix whose left rows are ``Q.per_token()`` has (n_query · T_q) rows, row
(q, t) at index q·T_q + t; its right side likewise. This module reshapes it to

    ("query", "query_token", "train")                    Q.per_token() @ H @ G.T
    ("query", "train", "train_token")                    Q @ H @ G.per_token().T
    ("query", "query_token", "train", "train_token")     both

with integer coordinates ``query_token`` / ``train_token`` = 0..T-1 (the positions of the
layers' sequence). Positions that are not tokens of the example — where the task's
``token_mask`` is False, or past the mask's width — are **NaN**; xarray's reductions
skip them, so ``scores.sum("train_token")`` equals ``(Q @ H @ G.T).compute()``.
Rows captured by ``ga.capture`` carry no batches: every position up to ``tokens`` is
kept (their padding rows are zero where the task's ``token_mask`` zeroed them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .data import batch_size_of
from .expr import Inner, ScoreDiagonal, ScoreNode, ScoreSum, Source
from .expr.tokens import PerToken, per_token_node

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["token_sides", "valid_positions", "token_scores_array", "token_self_scores_array"]


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


def _side(pt, ids, batch_size):
    """(example ids, tokens, validity) of one side; ids are the example ids when not per-token."""
    if pt is None:
        return np.asarray(ids), None, None
    return np.asarray(pt.example_ids), pt.tokens, valid_positions(pt, batch_size)


def token_scores_array(values, node: ScoreNode, batch_size: int, attrs: dict) -> xr.DataArray:
    """``values`` (n_left_rows, n_right_rows) of ``node`` as a DataArray with token axes."""
    import xarray as xr
    left, right = token_sides(node)
    q_ids, Tq, q_valid = _side(left, node.row_ids, batch_size)
    t_ids, Tt, t_valid = _side(right, node.col_ids, batch_size)
    a = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    nq, nt = len(q_ids), len(t_ids)
    shape, dims, coords = [nq], ["query"], {"query": q_ids}
    if Tq is not None:
        shape.append(Tq)
        dims.append("query_token")
        coords["query_token"] = np.arange(Tq)
    shape.append(nt)
    dims.append("train")
    coords["train"] = t_ids
    if Tt is not None:
        shape.append(Tt)
        dims.append("train_token")
        coords["train_token"] = np.arange(Tt)
    a = a.reshape(shape).astype(np.result_type(a.dtype, np.float32), copy=True)
    if q_valid is not None:
        a[~q_valid] = np.nan                                 # (nq, Tq) leading axes
    if t_valid is not None:
        np.moveaxis(a, (-2, -1), (0, 1))[~t_valid] = np.nan  # a view with (nt, Tt) in front
    attrs = dict(attrs, padding="NaN at positions that are not tokens of the example (token_mask False); "
                                "xarray reductions skip them")
    return xr.DataArray(a, dims=tuple(dims), coords=coords, name="scores", attrs=attrs)


def token_self_scores_array(values, node: ScoreDiagonal, batch_size: int) -> xr.DataArray:
    """Self-scores of per-token rows, (n, T) with dims ("train", "train_token")."""
    import xarray as xr
    pt, _ = token_sides(node.scores)
    ids, T, valid = _side(pt, node.ids, batch_size)
    a = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    a = a.reshape(len(ids), T).astype(np.result_type(a.dtype, np.float32), copy=True)
    a[~valid] = np.nan
    return xr.DataArray(a, dims=("train", "train_token"), coords={"train": ids, "train_token": np.arange(T)},
                        name="self_scores")
