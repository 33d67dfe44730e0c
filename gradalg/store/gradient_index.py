"""Approximate nearest-neighbour indexes of projected gradient stores (faiss), with exact re-ranking.

    P = ga.proj.gaussian(128, seed=0)
    ga.store.write(P(G), "train.zarr")
    idx = ga.store.index("train.zarr", metric="ip", kind="ivf")      # saved beside the store
    top = idx.search(P(Q), k=10)                                       # DataArray (query, rank)

An index answers "which training rows have the largest ⟨q, g⟩ (``metric="ip"``) or
cos(q, g) (``metric="cos"``)" without scoring every row. faiss proposes ``candidates``
rows per query (approximately: IVF probes ``nprobe`` of ``nlist`` clusters, HNSW walks
a graph); each candidate's score is then **recomputed exactly**, in float64, from the
stored rows, and the candidates are ranked by it (ties by training position, as
``S.topk``). So every returned score is the exact score of the returned row; only
*recall* (whether the true top-k were among the candidates) is approximate.

On disk (``<store>.<metric>-<kind>.index``, a directory written to a temporary sibling
and renamed into place, like a store's template):

``index.faiss``  the faiss index (rows as float32; cosine: unit rows, inner product)
``rows.npy``     the store's rows verbatim (its dtype), memory-mapped for the re-ranking
``meta.json``    metric, kind, faiss factory string, parameters, build time, and the
                 store's identity: projector, layers, objective, model fingerprint,
                 blocks, n, a digest of its ids and its expression digest

Only projected stores are indexed (full gradients are too wide for an index), and a
query's projector, layers, blocks and model fingerprint must equal the store's:
otherwise :class:`~gradalg.errors.StoreMismatchError`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import MissingLibraryError, OptionError, StoreMismatchError
from ..options import plain
from ..token_scores import Axis, labelled
from . import layout
from .describe import digest, store_attrs
from .rows import flat_rows

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["index", "open_index", "GradientIndex"]

METRICS = ("ip", "cos")
KINDS = ("flat", "ivf", "hnsw")
#: what a query must share with the store (compared with ``store_attrs`` of the query)
QUERY_KEYS = ("projector", "layers", "model_fingerprint", "model_digest")
INDEX_FORMAT = 1


def _faiss():
    try:
        import faiss
    except ImportError as err:
        raise MissingLibraryError("ga.store.index needs faiss: pip install 'gradalg[index]' (faiss-cpu)") from err
    return faiss


def _store_path(store) -> Path:
    """The path of a gradient store given as a path or as a GradientSet opened from one."""
    from ..api import GradientSet
    from ..expr.stored import Stored

    if isinstance(store, GradientSet):
        if not isinstance(store.expr, Stored) or not hasattr(store.expr.store, "path"):
            raise OptionError("ga.store.index takes a gradient store: its path, or ga.store.open(path)")
        return Path(store.expr.store.path)
    return Path(store)


def _check_projected(attrs: dict, path) -> None:
    wide = [b["name"] for b in attrs["blocks"] if b["representation"] != "projected"]
    if wide:
        dim = sum(int(np.prod(b["shape"])) for b in attrs["blocks"])
        raise OptionError(
            f"the store {path} holds unprojected gradients (blocks {wide}, {dim:,} coordinates per row): too "
            "wide to index. Store projected rows, ga.store.write(P(G), path) with P = ga.proj.gaussian(k) "
            "or ga.proj.kron(k), and index that store")


def _factory(kind: str, n: int, nlist: int | None, hnsw_m: int) -> tuple[str, dict]:
    if kind == "flat":
        return "Flat", {}
    if kind == "ivf":
        nlist = nlist or max(1, min(4 * int(np.sqrt(n)), n // 39))   # ≥ 39 training rows per cluster
        return f"IVF{nlist},Flat", {"nlist": nlist}
    return f"HNSW{hnsw_m},Flat", {"hnsw_m": hnsw_m}


def default_path(store_path: Path, metric: str, kind: str) -> Path:
    """Where ``ga.store.index`` saves an index of ``store_path``: a sibling directory."""
    return store_path.with_name(f"{store_path.name}.{metric}-{kind}.index")


def _unit(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


def index(store, *, metric: str = "ip", kind: str = "ivf", path=None, nlist: int | None = None,
          hnsw_m: int = 32, train_rows: int = 200_000, batch_rows: int = 65_536, overwrite: bool = False,
          seed: int = 0) -> "GradientIndex":
    """Build an approximate nearest-neighbour index of a finished projected gradient store.

    store : the store's path, or ``ga.store.open(path)``.
    metric : "ip" (⟨q, g⟩, Grad-Dot / TRAK-style scores) or "cos" (cos(q, g), Grad-Cos).
    kind : "flat" (exact search, no approximation: a baseline), "ivf" (faiss
        ``IVF{nlist},Flat``: k-means clusters, ``nprobe`` of them searched) or "hnsw"
        (``HNSW{hnsw_m},Flat``: a proximity graph).
    path : where to save it (default ``<store>.<metric>-<kind>.index`` beside the store).
    nlist : IVF clusters (default 4·√n, at most n/39); trained on ``train_rows`` rows
        drawn with ``seed``.
    batch_rows : rows read from the store and added per step.
    overwrite : replace an index already at ``path``.

    Returns the :class:`GradientIndex`, also reopened later by :func:`open_index`.
    """
    faiss = _faiss()
    if metric not in METRICS:
        raise OptionError(f"metric must be one of {METRICS}, got {metric!r}")
    if kind not in KINDS:
        raise OptionError(f"kind must be one of {KINDS}, got {kind!r}")
    from .gradients import open_gradients

    store_path = _store_path(store)
    G = open_gradients(store_path)          # refuses an unfinished store
    reader = G.expr.store
    attrs = reader.attrs
    _check_projected(attrs, store_path)
    names = [b["name"] for b in attrs["blocks"]]
    n, dim = reader.n, G.expr.space.dim
    target = Path(path) if path is not None else default_path(store_path, metric, kind)
    if target.exists() and not overwrite:
        raise FileExistsError(f"an index exists at {target}: open it with ga.store.open_index, or pass overwrite=True")
    factory, params = _factory(kind, n, nlist, hnsw_m)
    faiss_metric = faiss.METRIC_INNER_PRODUCT

    def build(tmp: Path) -> None:
        start = time.perf_counter()
        tmp.mkdir(parents=True)
        rows = np.lib.format.open_memmap(tmp / "rows.npy", mode="w+", dtype=np.dtype(attrs["dtype"]), shape=(n, dim))
        a = 0
        for chunk in reader.chunks():       # the store's rows, verbatim (checksummed reads)
            x = torch.cat([v.reshape(chunk.n, -1) for v in flat_rows(chunk, names).values()], dim=1)
            rows[a:a + chunk.n] = x.numpy()
            a += chunk.n
        rows.flush()
        idx = faiss.index_factory(dim, factory, faiss_metric)
        if not idx.is_trained:
            pick = np.sort(np.random.default_rng(seed).choice(n, size=min(n, train_rows), replace=False))
            idx.train(_vectors(rows[pick], metric))
        for b in range(0, n, batch_rows):
            idx.add(_vectors(rows[b:b + batch_rows], metric))
        faiss.write_index(idx, str(tmp / "index.faiss"))
        meta = {"format": INDEX_FORMAT, "metric": metric, "kind": kind, "factory": factory, "params": params,
                "n": n, "dim": dim, "store": str(store_path.resolve()),
                "build_seconds": time.perf_counter() - start,
                "store_identity": _identity(attrs, reader.ids)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))

    layout.atomic_directory(target, build, overwrite=overwrite)
    return open_index(target, store=store_path)


def _vectors(rows: np.ndarray, metric: str) -> np.ndarray:
    x = np.ascontiguousarray(rows, dtype=np.float32)
    return _unit(x) if metric == "cos" else x


def _identity(attrs: dict, ids) -> dict:
    return {"projector": attrs.get("projector"), "layers": attrs.get("layers"), "objective": attrs.get("objective"),
            "model_fingerprint": attrs.get("model_fingerprint"), "expression_digest": attrs.get("expression_digest"),
            "blocks": [[b["name"], list(b["shape"])] for b in attrs["blocks"]], "n": len(ids),
            "ids": digest([repr(i) for i in ids])}


def open_index(path, *, store=None) -> "GradientIndex":
    """A saved index (``ga.store.index``). ``store``: the store it indexes, if moved
    (default: the path recorded at build time); it must be the store the index was built
    from (same identity, ids and expression), else :class:`StoreMismatchError`."""
    faiss = _faiss()
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise FileNotFoundError(f"no gradalg index at {path} (build one with ga.store.index(store, ...))")
    meta = json.loads(meta_file.read_text())
    from .gradients import open_gradients

    G = open_gradients(_store_path(store) if store is not None else meta["store"])
    reader = G.expr.store
    now = _identity(reader.attrs, reader.ids)
    differ = [f"{k}: index built from {meta['store_identity'][k]!r}, store has {now[k]!r}"
              for k in now if meta["store_identity"][k] != now[k]]
    if differ:
        raise StoreMismatchError(differ, f"rebuild the index: ga.store.index({str(reader.path)!r}, overwrite=True)")
    rows = np.load(path / "rows.npy", mmap_mode="r")
    return GradientIndex(path, meta, faiss.read_index(str(path / "index.faiss")), rows, reader)


class GradientIndex:
    """A faiss index of a projected gradient store, with exact re-ranking (:func:`index`).

    ``search(P(Q), k)``: the ``k`` training rows with the largest exact scores among
    ``candidates`` proposed by faiss, per query. Attributes: ``path``, ``metric``,
    ``kind``, ``meta`` (what ``meta.json`` records), ``n``, ``dim``.
    """

    def __init__(self, path: Path, meta: dict, faiss_index, rows: np.ndarray, reader):
        self.path, self.meta, self.faiss_index, self.rows, self.reader = path, meta, faiss_index, rows, reader
        self.metric, self.kind = meta["metric"], meta["kind"]
        self.n, self.dim = int(meta["n"]), int(meta["dim"])

    def __repr__(self):
        return (f"GradientIndex({self.kind}, metric={self.metric}, {self.n:,} rows × {self.dim}, "
                f"{self.meta['factory']}, at {self.path})")

    def disk_bytes(self) -> int:
        """Bytes of the index directory (faiss index, row copy, metadata)."""
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def query_rows(self, Q) -> tuple[torch.Tensor, tuple]:
        """The rows of the queries ``Q`` (a projected GradientSet like the store's), after
        checking that they were projected and captured like the store's rows, and their
        ids: ``(rows, ids)``, rows (n_query, dim)."""
        from ..api import GradientSet
        from ..exec.local import LocalExecutor

        if not isinstance(Q, GradientSet):
            raise OptionError(f"search takes the queries' projected gradients, P(Q) (a GradientSet), "
                            f"got {type(Q).__name__}")
        theirs = store_attrs("gradients", Q.expr)
        ours = self.reader.attrs
        differ = [f"{k}: store {ours.get(k)!r}, queries {theirs.get(k)!r}" for k in QUERY_KEYS
                  if ours.get(k) != theirs.get(k) and k in ours]   # model_digest: absent in older stores
        blocks = [[b.name, list(b.shape)] for b in Q.expr.space.blocks]
        if blocks != [[b["name"], list(b["shape"])] for b in ours["blocks"]]:
            differ.append(f"blocks: store {[b['name'] for b in ours['blocks']]}, queries {[b[0] for b in blocks]}")
        if differ:
            raise StoreMismatchError(differ, "project the queries with the store's projector, from the same "
                                             "model and layers (P(ga.grads(task, queries, layers=...)))")
        chunk = LocalExecutor().gradients(Q.expr)
        names = [b["name"] for b in ours["blocks"]]
        return torch.cat([v.reshape(chunk.n, -1) for v in flat_rows(chunk, names).values()], dim=1), chunk.ids

    def search(self, Q, k: int = 10, *, largest: bool = True, candidates: int | None = None,
               nprobe: int | None = None, ef_search: int | None = None, texts=None) -> xr.DataArray:
        """The ``k`` best training rows per query, by exact score among faiss's candidates.

        Q : the queries' projected gradients, ``P(ga.grads(task, queries))``.
        largest : False for the lowest scores (searched as the best of −q).
        candidates : rows proposed per query and re-scored exactly (default max(4k, 64));
            more: higher recall, slower.
        nprobe : IVF clusters searched (default max(8, nlist/16)); ef_search : HNSW's
            search breadth (default max(candidates, 64)).
        texts : the training documents (a list in the store's row order, a dict {id: text},
            a function id -> text, ``ga.report.jsonl_texts``); default: those recorded with
            the store (``ga.store.write(..., texts=)``), if any. Adds a ``text``
            coordinate (query, rank); an id without text raises DataError.

        Returns a DataArray like ``S.topk``: dims ("query", "rank"), the exact scores
        (float64), coordinates ``query``, ``rank`` and ``train`` (query, rank) ids;
        ``attrs`` say which metric, kind and candidate count produced them.
        """
        k = plain(k)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.n:
            raise OptionError(f"k must be an integer in 1..{self.n}, got {k!r}")
        faiss = _faiss()
        q, ids = self.query_rows(Q)
        q = q.to(torch.float64)
        m = max(k, min(self.n, candidates if candidates is not None else max(4 * k, 64)))
        sign = 1.0 if largest else -1.0
        vec = _vectors(sign * q.numpy(), self.metric)
        params = None
        if self.kind == "ivf":
            nlist = self.meta["params"]["nlist"]
            params = faiss.SearchParametersIVF(nprobe=min(nlist, nprobe or max(8, nlist // 16)))
        elif self.kind == "hnsw":
            params = faiss.SearchParametersHNSW(efSearch=ef_search or max(m, 64))
        _, proposed = self.faiss_index.search(vec, m, params=params)          # (n_query, m) positions, -1 = none
        values, positions = self._rerank(q, proposed, k, largest)
        train_ids = np.asarray(self.reader.ids, dtype=object)
        result = labelled(
            values.numpy(), [Axis("query", np.asarray(ids)), Axis("rank", np.arange(k))], "scores",
            {"metric": self.metric, "kind": self.kind, "candidates": m, "largest": int(largest),
             "scores": "exact (candidates re-scored in float64 from the stored rows)",
             "ties": "lower training position first"},
            coords={"train": (("query", "rank"), _as_ids(train_ids[positions.numpy()]))})
        if texts is None:
            from .documents import texts as read_texts
            texts = read_texts(self.reader.path)
        if texts is None:
            return result
        from ..report.texts import with_texts
        return with_texts(result, texts, ids=list(self.reader.ids))

    def _rerank(self, q: torch.Tensor, proposed: np.ndarray, k: int, largest: bool):
        """Exact scores of each query's candidates from the stored rows, then its top k."""
        from ..plan.jobs import select_topk

        if (proposed < 0).sum(1).max() > proposed.shape[1] - k:
            raise OptionError(f"faiss proposed fewer than k={k} rows for some query: search more clusters "
                              "(nprobe=...) or more candidates")
        unique = np.unique(proposed[proposed >= 0])                          # sorted: sequential reads
        rows = torch.from_numpy(np.asarray(self.rows[unique], dtype=np.float64))   # (n_unique, dim)
        exact = q @ rows.T                                                     # (n_query, n_unique)
        if self.metric == "cos":
            qn = torch.linalg.vector_norm(q, dim=1, keepdim=True)
            gn = torch.linalg.vector_norm(rows, dim=1).unsqueeze(0)
            exact = torch.where((qn > 0) & (gn > 0), exact / (qn * gn), torch.zeros_like(exact))
        where = torch.from_numpy(np.searchsorted(unique, np.maximum(proposed, 0)))
        cand = torch.gather(exact, 1, where)                                   # (n_query, m)
        pos = torch.from_numpy(proposed.astype(np.int64))
        missing = pos < 0
        fill = float("-inf") if largest else float("inf")
        cand = cand.masked_fill(missing, fill)
        pos = pos.masked_fill(missing, self.n)                                 # after every real row
        return select_topk(cand, pos, k, largest)


def _as_ids(values: np.ndarray) -> np.ndarray:
    """Ids as a plain NumPy dtype when they are all ints or all strings (xarray coordinates)."""
    flat = values.ravel().tolist()
    if all(isinstance(v, (int, np.integer)) for v in flat):
        return values.astype(np.int64)
    if all(isinstance(v, str) for v in flat):
        return values.astype(str)
    return values
