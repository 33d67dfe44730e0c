"""Score stores: a (query, train) score matrix written column chunk by column chunk.

    S = P(Q) @ ga.fisher(P(G)).damp(1e-3).inv() @ P(G).T
    ga.store.write_scores(S, "scores.zarr", chunk_rows=1024)   # resumable
    ga.store.open_scores("scores.zarr")                         # Dask-backed DataArray
    S.compute(store=ga.store.ScoreStore("scores.zarr"))        # the same, as a result sink

Before the first chunk, each score term's left side (the queries) and operator are
computed once, by the given executor, and kept; each chunk then streams training rows
a:b of the right side only (operators over the training set stay over all of it) and
writes the columns a:b. Chunks are atomic and resumable as in a gradient store (see
:mod:`gradalg.store.layout`).
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import OptionError
from ..options import plain
from ..expr import Inner, ScoreSum
from ..expr.stored import Stored, StoredOp
from ..exec.resilience import PAYLOAD, run_tasks
from . import layout
from .layout import store_path
from .describe import store_attrs
from .rows import (fault_policy, MemoryRows, ResolvedStore, check_shippable, executor_for, freeze_ops, restrict_rows,
                   restrictable)

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["write_scores", "open_scores", "ScoreStore"]

KIND = "scores"
RESUME_KEYS = ("projector", "layers", "objective", "model_fingerprint", "model_digest", "n_query", "n_train",
               "chunk_rows", "expression_digest")



def _terms(node):
    """[(coef, Inner)] of a score expression (sums flattened)."""
    if isinstance(node, Inner):
        return [(1.0, node)]
    if isinstance(node, ScoreSum):
        out = []
        for c, t in zip(node.coefs, node.terms):
            out.extend((c * c2, inner) for c2, inner in _terms(t))
        return out
    raise OptionError(f"ga.store.write_scores takes scores built with @ (and sums of them), not {node.label!r}")


def _describe(S, chunk_rows: int) -> dict:
    n_q, n_t = S.expr.shape
    return dict(store_attrs(KIND, S.expr), n_query=n_q, n_train=n_t, chunk_rows=int(chunk_rows))


def _prepared(ex, node):
    """The score expression with left sides and operators computed once: [(coef, Inner)]."""
    memo: dict = {}
    out = []
    for coef, inner in _terms(node):
        if not restrictable(inner.right):
            raise OptionError(f"the training side {inner.right.label!r} cannot be streamed by row ranges: "
                            "it must come from ga.grads (or a gradient store)")
        if inner.left.token not in memo:
            rows = ex.gradients(inner.left)
            memo[inner.left.token] = Stored(MemoryRows(rows, inner.left.token, inner.left.label),
                                            inner.left.space, tuple(inner.left.representation.items()))
        op = inner.op
        if not op.is_identity:
            if op.token not in memo:
                memo[op.token] = StoredOp(ResolvedStore(ex.operator(op), op.token, op.label), op.space,
                                          op.structure)
            op = memo[op.token]
        out.append((coef, Inner(memo[inner.left.token], op, freeze_ops(ex.operator, inner.right, memo))))
    return out


def _chunk_node(terms, start: int, stop: int):
    inners = tuple(Inner(i.left, i.op, restrict_rows(i.right, start, stop)) for _, i in terms)
    if len(inners) == 1 and terms[0][0] == 1.0:
        return inners[0]
    return ScoreSum(inners, tuple(c for c, _ in terms))


def _compute(terms, start, stop, options, rewrites=True):
    from ..exec.local import LocalExecutor

    values = LocalExecutor(options, rewrites=rewrites).scores(_chunk_node(terms, start, stop))
    return values.detach().cpu().numpy()


def _compute_and_write(path, attrs, terms, index: int, options, rewrites: bool = True) -> int:
    size = int(attrs["chunk_rows"])
    a, b = index * size, min((index + 1) * size, int(attrs["n_train"]))
    values = _compute(terms, a, b, options, rewrites)
    layout.write_region(path, {"scores": (("query", "train"), values)}, "train", a, b)
    layout.mark_done(path, index)
    return index


def write_scores(S, path, *, chunk_rows: int = 1024, executor=None, overwrite: bool = False,
                 metadata: dict | None = None):
    """Compute the Scores ``S`` chunk by chunk of training rows into a Zarr store at
    ``path``; return :func:`open_scores` of it.

    chunk_rows : training examples (columns) per chunk.
    executor : None (this process), a LocalExecutor, or a ``ga.exec.DaskExecutor`` (one task
        per unfinished chunk). It also computes, once, the query sides and operators.
    overwrite : replace a store already at ``path``.
    metadata : extra JSON-able attributes kept with a new store; not compared on resume.

    An unfinished store of the same scores at ``path`` is completed (only its unfinished
    chunks are computed); a store of other scores raises :class:`StoreMismatchError`.
    """
    path = store_path(path)   # a str or os.PathLike, else an OptionError
    from ..api import Scores

    layout.require()
    if not isinstance(S, Scores):
        raise OptionError(f"ga.store.write_scores takes Scores, got {type(S).__name__}")
    chunk_rows = plain(chunk_rows)   # np.int64 works as an int
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise OptionError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
    node = S.expr
    _terms(node)   # a clear error for unsupported expressions before anything runs
    train_ids = layout.ids_array(node.col_ids)
    attrs = layout.with_metadata(_describe(S, chunk_rows), metadata)
    state = layout.prepare(path, attrs, train_ids, RESUME_KEYS, overwrite=overwrite, kind=KIND,
                           other_ids={"query": layout.ids_array(node.row_ids)})
    if state == "complete":
        return open_scores(path)
    with executor_for(executor) as ex:
        _write(path, attrs, ex, node, train_ids, state)
    return open_scores(path)


def _write(path, attrs, ex, node, train_ids, state) -> None:
    import xarray as xr
    import dask.array as da

    chunk_rows = int(attrs["chunk_rows"])
    terms = _prepared(ex, node)
    options, rewrites = ex.options, getattr(ex, "rewrites", True)
    n_q, n_t = node.shape
    if state == "new":
        first = _compute(terms, 0, min(chunk_rows, n_t), options, rewrites)
        attrs["dtype"] = str(first.dtype)
        template = xr.Dataset(
            {"scores": (("query", "train"), da.zeros((n_q, n_t), chunks=(n_q, chunk_rows), dtype=first.dtype)),
             "done": (("chunk",), da.zeros((layout.n_chunks(n_t, chunk_rows),), chunks=(1,), dtype=np.uint8))},
            coords={"query": layout.ids_array(node.row_ids), "train": train_ids}, attrs=attrs)
        layout.write_template(path, template)
        layout.write_region(path, {"scores": (("query", "train"), first)}, "train", 0, min(chunk_rows, n_t))
        layout.mark_done(path, 0)
    else:
        attrs["dtype"] = layout.read_attrs(path)["dtype"]
    todo = [int(i) for i in np.flatnonzero(~layout.done_flags(path))]
    client = getattr(ex, "client", None)
    if client is not None and todo:
        for _, inner in terms:
            check_shippable(inner)
        run_tasks(client, _compute_and_write, terms,
                  [(str(path), attrs, PAYLOAD, i, options, rewrites) for i in todo],
                  policy=fault_policy(ex), labels=[f"{path} chunk {i}" for i in todo])
    else:
        for i in todo:
            _compute_and_write(path, attrs, terms, i, options, rewrites)


@dataclass(frozen=True)
class ScoreStore:
    """A Zarr score store at ``path`` as the result sink of ``S.compute(store=...)``
    (:class:`gradalg.api.ScoreSink`): ``S.compute(store=ScoreStore(path, chunk_rows=10))``
    is ``write_scores(S, path, chunk_rows=10)``, and ``S.compute(store=path, chunk_rows=10)``
    writes through one (:func:`gradalg.api.register_path_sink`)."""

    path: str | os.PathLike
    chunk_rows: int = 1024
    overwrite: bool = False
    metadata: dict | None = field(default=None, compare=False)

    def __post_init__(self):
        if isinstance(self.chunk_rows, numbers.Integral) and not isinstance(self.chunk_rows, bool):
            object.__setattr__(self, "chunk_rows", int(self.chunk_rows))   # a numpy integer reads as its value

    def write_scores(self, scores, *, executor=None) -> xr.DataArray:
        """Compute ``scores`` into the store (:func:`write_scores`); its DataArray read back."""
        return write_scores(scores, self.path, chunk_rows=self.chunk_rows, executor=executor,
                            overwrite=self.overwrite, metadata=self.metadata)


def open_scores(path) -> xr.DataArray:
    """A finished score store as a Dask-backed DataArray, dims ("query", "train"), with the
    store's metadata in ``attrs``. An unfinished store raises :class:`StoreIncompleteError`."""
    path = store_path(path)   # a str or os.PathLike, else an OptionError
    layout.require()
    layout.check_complete(path, KIND, "ga.store.write_scores(S, path)")
    ds = layout.open_dataset(path, chunks={})
    out = ds["scores"]
    out.attrs = dict(ds.attrs)
    return out
