"""Gradient stores: the rows of a GradientSet in a chunked Zarr store, and back.

    P = ga.proj.kron(k=256, seed=0)
    ga.store.write(P(G), "train.zarr", chunk_rows=256)      # resumable, chunk by chunk
    stored = ga.store.open("train.zarr", like=P(G))         # lazy GradientSet
    (P(Q) @ stored.T).compute()                              # no pass over the training data

Layout (see :mod:`gradalg.store.layout` for the crash safety): one variable per block,
dims ``("example", "<block>_coord")``, chunked by ``chunk_rows`` rows; the coordinate
``example`` holds the ids; ``done`` (one flag per chunk); the attributes below.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import OptionError, StoreMismatchError
from ..options import plain
from ..units import format_bytes
from ..capture.chunks import Chunk
from ..space import Block, ParamSpace
from ..expr.stored import Stored
from ..exec.resilience import PAYLOAD, run_tasks
from . import layout
from .layout import store_path
from .describe import digest, store_attrs
from .integrity import chunk_error
from .rows import check_row_ids, fault_policy, check_shippable, executor_for, flat_rows, freeze_ops, restrictable, rows_of

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["write", "open_gradients", "dataset", "GradientStore"]

KIND = "gradients"
# what must agree for a write to resume an existing store
RESUME_KEYS = ("projector", "layers", "objective", "backend", "model_fingerprint", "model_digest", "blocks", "n",
               "chunk_rows", "expression_digest")
# what must agree for open(path, like=G)
LIKE_KEYS = ("projector", "layers", "objective", "backend", "model_fingerprint", "model_digest", "blocks",
             "expression_digest")



def _variables(space: ParamSpace) -> dict[str, str]:
    """Block name -> variable name (the block's name unless it collides with the layout's)."""
    out, taken = {}, {"done", "example", "chunk"}
    for i, b in enumerate(space.blocks):
        name = b.name if b.name and b.name not in taken and "/" not in b.name else f"block_{i}"
        taken.add(name)
        out[b.name] = name
    return out


def describe_gradients(G, chunk_rows: int | None = None) -> dict:
    """The attributes a store of ``G`` records (without the dtype, known from the rows)."""
    node = G.expr
    blocks = [{"name": b.name, "shape": list(b.shape), "kind": b.kind, "basis": b.basis,
               "variable": var, "representation": node.representation[b.name]}
              for b, var in zip(node.space.blocks, _variables(node.space).values())]
    attrs = dict(store_attrs(KIND, node), blocks=blocks, n=node.n)
    if chunk_rows is not None:
        attrs["chunk_rows"] = int(chunk_rows)
    return attrs


class GradientStore:
    """Reads a finished gradient store, one store chunk at a time (rows ``start:stop``).

    Picklable: the open Dataset is not sent, only the path and metadata.
    """

    def __init__(self, path, attrs: dict, ids: tuple, start: int = 0, stop: int | None = None):
        self.path = str(Path(path).resolve())
        self.attrs = attrs
        self._all_ids = ids
        self.start = start
        self.stop = len(ids) if stop is None else stop
        self.token = f"zarrgrads-{digest([self.path, attrs.get('expression_digest'), attrs.get('chunk_rows'), self.start, self.stop])}"
        self.label = os.path.basename(self.path) + ("" if (self.start, self.stop) == (0, len(ids))
                                                     else f"[{self.start}:{self.stop}]")
        self.description = {"store": attrs.get("expression_digest"), "rows": [self.start, self.stop]}
        self.summary = {k: attrs.get(k, []) for k in ("projector", "layers", "objective", "backend",
                                                      "model_fingerprint", "model_digest")}
        self._ds = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_ds"] = None
        return state

    @property
    def n(self) -> int:
        return self.stop - self.start

    @property
    def ids(self) -> tuple:
        return self._all_ids[self.start:self.stop]

    @property
    def dataset(self) -> xr.Dataset:
        """The store as a Dask-backed xarray Dataset (one Dask chunk per store chunk)."""
        if self._ds is None:
            self._ds = layout.open_dataset(self.path, chunks={})
        return self._ds

    def rows(self, start: int, stop: int) -> "GradientStore":
        """Rows start:stop of this view (read lazily, like the whole)."""
        return GradientStore(self.path, self.attrs, self._all_ids, self.start + start, self.start + stop)

    def chunks(self):
        """Chunks of flat (rows, dim) blocks, one store chunk (or part of one) at a time."""
        import dask

        ds = self.dataset
        size = int(self.attrs["chunk_rows"])
        first = self.start // size
        for index in range(first, layout.n_chunks(len(self._all_ids), size)):
            a, b = max(index * size, self.start), min((index + 1) * size, self.stop)
            if a >= b:
                break
            try:
                parts = dask.compute(*(ds[blk["variable"]].data[a:b] for blk in self.attrs["blocks"]),
                                     scheduler="synchronous")
            except Exception as err:  # noqa: BLE001 - checksum, truncated or unreadable chunk
                raise chunk_error(self.path, index, err) from err
            blocks = {blk["name"]: torch.from_numpy(np.ascontiguousarray(part))
                      for blk, part in zip(self.attrs["blocks"], parts)}
            yield Chunk(self._all_ids[a:b], blocks)


# ---------------------------------------------------------------------------------- write
def _template(attrs: dict, ids: np.ndarray, dtype, chunk_rows: int) -> xr.Dataset:
    import xarray as xr
    import dask.array as da

    n = len(ids)
    variables = {}
    for blk in attrs["blocks"]:
        dim = int(np.prod(blk["shape"]))
        variables[blk["variable"]] = (("example", f"{blk['variable']}_coord"),
                                      da.zeros((n, dim), chunks=(chunk_rows, dim), dtype=dtype))
    count = layout.n_chunks(n, chunk_rows)
    variables["done"] = (("chunk",), da.zeros((count,), chunks=(1,), dtype=np.uint8))
    return xr.Dataset(variables, coords={"example": ids}, attrs=attrs)


def _chunk_variables(attrs: dict, rows: dict[str, torch.Tensor]) -> dict:
    return {blk["variable"]: (("example", f"{blk['variable']}_coord"), rows[blk["name"]].detach().cpu().numpy())
            for blk in attrs["blocks"]}


def _write_chunk(path, attrs, index: int, rows: dict[str, torch.Tensor]) -> int:
    size = int(attrs["chunk_rows"])
    a, b = index * size, min((index + 1) * size, int(attrs["n"]))
    layout.write_region(path, _chunk_variables(attrs, rows), "example", a, b)
    layout.mark_done(path, index)
    return index


def _compute_and_write(path, attrs, node, index: int, options, rewrites: bool, executor=None) -> int:
    """One chunk: rows of ``node`` over its range, written, then flagged. (Dask task.)"""
    from ..exec.local import LocalExecutor

    ex = executor if executor is not None else LocalExecutor(options, rewrites=rewrites)
    size = int(attrs["chunk_rows"])
    a, b = index * size, min((index + 1) * size, int(attrs["n"]))
    chunk = rows_of(ex, node, a, b)
    return _write_chunk(path, attrs, index, flat_rows(chunk, [blk["name"] for blk in attrs["blocks"]]))


def _warn_factored(node) -> None:
    factored = [b for b in node.space.blocks if node.representation[b.name] == "factored"]
    if factored:
        size = node.n * sum(b.dim for b in factored) * 4
        warnings.warn(
            f"blocks {[b.name for b in factored]} are factored: the store keeps them materialized, "
            f"{node.n:,} × {sum(b.dim for b in factored):,} numbers (≈{format_bytes(size)} in float32). "
            "Project first (ga.proj.kron(k=...)) to store a few coordinates per example",
            stacklevel=3)


def write(G, path, *, chunk_rows: int = 256, executor=None, overwrite: bool = False, verify: bool = False,
          metadata: dict | None = None, texts=None):
    """Write the rows of ``G`` to a Zarr store at ``path``, chunk by chunk; return the
    store opened as a lazy GradientSet (see :func:`open_gradients`).

    G : GradientSet, typically projected (``P(G)``). Factored blocks are materialized
        (n × dim numbers: a warning says how many).
    chunk_rows : rows per chunk: the unit of writing, resuming and reading. Each chunk's
        rows are computed by a plan of their own (held while written): a chunk over the
        memory budget is refused by it, :class:`~gradalg.errors.MemoryBudgetError` naming
        a ``chunk_rows`` that fits.
    executor : None (this process), a LocalExecutor, or a ``ga.exec.DaskExecutor``: each
        unfinished chunk is then one task on the cluster, which computes its rows and
        writes them (positional writes: a retried task writes the same bytes).
    overwrite : replace a gradalg store already at ``path`` (anything else there is refused).
    verify : on a finished store, read every chunk and check its checksum (otherwise
        only that its files exist); damaged chunks are rewritten.
    metadata : extra JSON-able attributes kept with a new store (the ``gradalg`` command
        line records its config and versions here); not compared on resume.
    texts : the training documents, recorded as ``<path>.texts.jsonl`` beside the store (see
        :mod:`gradalg.store.documents`): a list in data order, a dict {id: text}, a function
        id -> text, a ``datasets.Dataset`` column or ``ga.report.jsonl_texts(path, field)``.
        Every example needs one (else DataError); an index of the store then returns them.

    If ``path`` holds an unfinished or damaged store of the same ``G`` (same projector, layers,
    objective, model fingerprint, example ids and ``chunk_rows``), only its unfinished
    chunks are computed; a store of anything else raises :class:`StoreMismatchError`.
    """
    path = store_path(path)   # a str or os.PathLike, else an OptionError
    from ..api import GradientSet

    layout.require()
    if not isinstance(G, GradientSet):
        raise OptionError(f"ga.store.write takes a GradientSet, got {type(G).__name__}")
    chunk_rows = plain(chunk_rows)   # np.int64 works as an int
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise OptionError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
    node = G.expr
    if node.n == 0:
        raise OptionError("G has no rows to store")
    ids = layout.ids_array(node.ids)
    attrs = layout.with_metadata(describe_gradients(G, chunk_rows), metadata)
    if texts is not None:                # refused before any pass when an example has no text
        from ..report.texts import check_texts
        check_texts(texts, list(node.ids))
    state = layout.prepare(path, attrs, ids, RESUME_KEYS, overwrite=overwrite, kind=KIND, verify=verify)
    if state == "new" and texts is None:     # a new store: no texts of an older one
        from .documents import remove_texts
        remove_texts(path)
    if state == "complete":
        _record_texts(path, node.ids, texts)
        return open_gradients(path)
    _warn_factored(node)
    with executor_for(executor) as ex:
        if restrictable(node):
            _write_by_ranges(path, attrs, ex, node, ids, state)
        else:
            _write_whole(path, attrs, ex, node, ids, state)
    _record_texts(path, node.ids, texts)
    return open_gradients(path)


def _record_texts(path, ids, texts) -> None:
    if texts is not None:
        from .documents import write_texts
        write_texts(path, ids, texts)


def _write_by_ranges(path, attrs, ex, node, ids, state) -> None:
    """Each unfinished chunk computed from its own range of examples (here, or one Dask
    task per chunk)."""
    from ..exec.local import LocalExecutor

    chunk_rows = int(attrs["chunk_rows"])
    node = freeze_ops(ex.operator, node)          # operators of the row chain: resolved once, here
    local = LocalExecutor(ex.options, rewrites=getattr(ex, "rewrites", True))
    if state == "new":
        # the first chunk fixes the dtype of the template (the rows' own dtype)
        first = rows_of(local, node, 0, min(chunk_rows, node.n))
        rows = flat_rows(first, [b["name"] for b in attrs["blocks"]])
        dtype = next(iter(rows.values())).detach().cpu().numpy().dtype
        attrs["dtype"] = str(dtype)
        layout.write_template(path, _template(attrs, ids, dtype, chunk_rows))
        _write_chunk(path, attrs, 0, rows)
    else:
        attrs["dtype"] = layout.read_attrs(path)["dtype"]
    todo = [int(i) for i in np.flatnonzero(~layout.done_flags(path))]
    client = getattr(ex, "client", None)
    if client is not None and todo:
        check_shippable(node)
        run_tasks(client, _compute_and_write, node,
                  [(str(path), attrs, PAYLOAD, i, ex.options, getattr(ex, "rewrites", True)) for i in todo],
                  policy=fault_policy(ex), labels=[f"{path} chunk {i}" for i in todo])
    else:
        for i in todo:
            _compute_and_write(path, attrs, node, i, None, True, executor=local)


def _write_whole(path, attrs, ex, node, ids, state) -> None:
    """Rows that cannot be computed by ranges (in-memory captures, group means): computed
    once, written chunk by chunk."""
    chunk = ex.gradients(node)
    check_row_ids(chunk.ids, node.ids, "rows")
    rows = flat_rows(chunk, [b["name"] for b in attrs["blocks"]])
    size = int(attrs["chunk_rows"])
    if state == "new":
        dtype = next(iter(rows.values())).detach().cpu().numpy().dtype
        attrs["dtype"] = str(dtype)
        layout.write_template(path, _template(attrs, ids, dtype, size))
    else:
        attrs["dtype"] = layout.read_attrs(path)["dtype"]
    for i in np.flatnonzero(~layout.done_flags(path)):
        a, b = int(i) * size, min((int(i) + 1) * size, node.n)
        _write_chunk(path, attrs, int(i), {k: v[a:b] for k, v in rows.items()})


# ---------------------------------------------------------------------------------- open
def _space(attrs: dict) -> ParamSpace:
    return ParamSpace(tuple(Block(b["name"], tuple(b["shape"]), b["kind"], b["basis"]) for b in attrs["blocks"]))


def open_gradients(path, like=None):
    """The rows of a finished gradient store as a lazy GradientSet.

    Its rows are read one store chunk at a time, when an expression over it is computed
    (``Q @ stored.T``, ``ga.fisher(stored)``, ``stored.normalize()``, ...), with either
    executor; the numbers are bitwise those written. An unfinished store raises
    :class:`StoreIncompleteError` (rerun ``ga.store.write`` to finish it).

    like : a GradientSet the store must have been written from: its projector, layers,
        objective, model fingerprint, blocks and example ids are compared with the
        store's, and any difference raises :class:`StoreMismatchError`.
    """
    path = store_path(path)   # a str or os.PathLike, else an OptionError
    from ..api import GradientSet

    layout.require()
    ds = layout.check_complete(path, KIND, "ga.store.write(G, path)")
    attrs = dict(ds.attrs)
    ids = layout.ids_tuple(ds["example"].values)
    if like is not None:
        if not isinstance(like, GradientSet):
            raise OptionError(f"like must be a GradientSet, got {type(like).__name__}")
        expected = describe_gradients(like)
        fix = ("open the store that was written from these gradients, or write them again "
               "(ga.store.write(G, path, overwrite=True))")
        layout.compare(attrs, expected, [k for k in LIKE_KEYS if k != "expression_digest"], "like", fix)
        if tuple(like.ids) != ids:
            raise StoreMismatchError([layout.ids_difference("the store's example ids", "like's", ids, like.ids,
                                                            "example")], fix)
        layout.compare(attrs, expected, ["expression_digest"], "like", fix)
    store = GradientStore(path, attrs, ids)
    rep = tuple((b["name"], "projected" if b["representation"] == "projected" else "dense")
                for b in attrs["blocks"])
    return GradientSet(Stored(store, _space(attrs), rep))


def dataset(path) -> xr.Dataset:
    """A finished store (gradients or scores) as a Dask-backed xarray Dataset, with its
    metadata in ``attrs``."""
    path = store_path(path)   # a str or os.PathLike, else an OptionError
    attrs = layout.read_attrs(path)
    kind = attrs.get("gradalg_store") if attrs else KIND
    layout.check_complete(path, kind, f"ga.store.write{'' if kind == KIND else '_' + kind}(...)")
    return layout.open_dataset(path, chunks={})
