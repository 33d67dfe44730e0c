"""Score files: a ``(query, train)`` score matrix, or its top k per query, as Zarr, CSV
or parquet (the path's suffix), with the provenance of :mod:`gradalg.cli.provenance`.

=====================  =============================================================
full scores, .zarr     ``ga.store.write_scores``: chunked, resumable, ``scores`` (query, train)
                       (scores it cannot stream by training rows: computed whole, same layout)
full scores, .csv      long table ``query, train, score`` (one row per pair)
top k, .zarr           ``train`` and ``score`` of dims (query, rank); rank 0 is the highest
top k, .csv/.parquet   long table ``query, rank, train, score``
=====================  =============================================================

CSV and parquet files are written to a temporary name and renamed into place; an
existing file is refused unless ``overwrite``.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from .errors import OutputExistsError
from .provenance import ATTRIBUTE, write_sidecar

__all__ = ["OutputExistsError", "write_scores", "top_k", "long_table", "read_scores"]


def top_k(scores, k: int):
    """``(train ids, scores)`` of the ``k`` highest scores per query: dims (query, rank)."""
    import torch
    import xarray as xr

    values = torch.from_numpy(np.asarray(scores.values))
    k = min(k, values.shape[1])
    best, index = torch.topk(values, k, dim=1)     # (n_query, k), sorted descending
    train = np.asarray(scores["train"].values)[index.numpy()]
    coords = {"query": scores["query"].values, "rank": np.arange(k)}
    return xr.Dataset({"train": (("query", "rank"), train), "score": (("query", "rank"), best.numpy())},
                      coords=coords)


def long_table(result):
    """A DataFrame with one row per (query, train) pair, or per (query, rank) of a top k."""
    import pandas as pd

    if "rank" in result.dims:
        q = np.repeat(result["query"].values, result.sizes["rank"])
        r = np.tile(result["rank"].values, result.sizes["query"])
        return pd.DataFrame({"query": q, "rank": r, "train": result["train"].values.reshape(-1),
                             "score": result["score"].values.reshape(-1)})
    q = np.repeat(result["query"].values, result.sizes["train"])
    t = np.tile(result["train"].values, result.sizes["query"])
    return pd.DataFrame({"query": q, "train": t, "score": np.asarray(result.values).reshape(-1)})


def _refuse_existing(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{path} exists already: pass --overwrite to replace it, or set another output path")


def _atomic_file(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _streamable(S) -> bool:
    """Whether ``ga.store.write_scores`` can write ``S`` chunk by chunk (inner products and
    sums of them over a training side read by row ranges); other scores (RelatIF's
    normalization, say) are computed whole and written as one Zarr array."""
    from ..store.rows import restrictable
    from ..store.scores import _terms

    try:
        return all(restrictable(inner.right) for _, inner in _terms(S.expr))
    except TypeError:
        return False


def write_scores(S, path, *, provenance: dict, top: int | None = None, chunk_rows: int = 1024,
                 overwrite: bool = False, executor=None) -> dict:
    """Compute the lazy Scores ``S`` into ``path``; return a summary (rows written, path)."""
    import gradalg as ga

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".zarr" and top is None and _streamable(S):
        from ..errors import StoreMismatchError
        try:
            ga.store.write_scores(S, path, chunk_rows=chunk_rows, overwrite=overwrite, executor=executor,
                                  metadata={ATTRIBUTE: provenance})
        except StoreMismatchError as err:
            raise StoreMismatchError(err.differences, f"{path} holds other scores: pass --overwrite to replace "
                                     "them, or set another output path") from None
        n_q, n_t = S.shape
        return {"path": str(path), "format": "zarr", "shape": [n_q, n_t]}
    _refuse_existing(path, overwrite)
    scores = S.compute(executor)
    result = top_k(scores, top) if top is not None else scores
    if path.suffix == ".zarr":
        ds = result.copy()
        ds.attrs = {ATTRIBUTE: json.loads(json.dumps(provenance, default=str))}
        if path.exists():
            shutil.rmtree(path)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
        try:
            ds.to_zarr(tmp, mode="w", consolidated=False)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return {"path": str(path), "format": "zarr", "shape": list(result["score"].shape)}
    table = long_table(result)
    if path.suffix == ".csv":
        _atomic_file(path, lambda tmp: table.to_csv(tmp, index=False, float_format=None))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        arrow = pa.Table.from_pandas(table, preserve_index=False)
        meta = dict(arrow.schema.metadata or {})
        meta[ATTRIBUTE.encode()] = json.dumps(provenance, default=str).encode()
        _atomic_file(path, lambda tmp: pq.write_table(arrow.replace_schema_metadata(meta), tmp))
    write_sidecar(path, provenance)
    return {"path": str(path), "format": path.suffix[1:], "rows": len(table)}


def read_scores(path):
    """A score file written by :func:`write_scores` back as an xarray object: the full
    matrix (DataArray, dims query, train) or the top k (Dataset of train / score)."""
    import pandas as pd
    import xarray as xr

    path = Path(path)
    if path.suffix == ".zarr":
        ds = xr.open_zarr(path, consolidated=False, mask_and_scale=False)
        return ds["scores"].load() if "scores" in ds else ds.load()
    table = pd.read_csv(path) if path.suffix == ".csv" else pd.read_parquet(path)
    if "rank" in table.columns:
        return table.set_index(["query", "rank"]).to_xarray()
    return table.set_index(["query", "train"])["score"].to_xarray()
