"""``ga.store``: gradients, curvature and scores persisted as chunked Zarr stores.

    ga.store.write(P(G), "train.zarr")                 # resumable, atomic per chunk
    stored = ga.store.open("train.zarr", like=P(G))    # lazy, Dask-backed GradientSet
    S = P(Q) @ ga.fisher(stored).damp(1e-3).inv() @ stored.T

    ga.store.write_operator(H, "fisher.zarr");  H2 = ga.store.open_operator("fisher.zarr")
    ga.store.write_scores(S, "scores.zarr");    ga.store.open_scores("scores.zarr")  # DataArray
    S.compute(store=ga.store.ScoreStore("scores.zarr", chunk_rows=1024))           # a result sink
    ga.store.verify("train.zarr")                      # checksums of every chunk: VerifyReport
    idx = ga.store.index("train.zarr", metric="ip")    # faiss ANN index beside the store (gradalg[index])
    idx.search(P(Q), k=10)                             # exact scores of the candidates: DataArray
    ga.store.write(P(G), "train.zarr", texts=docs)     # the documents too: search adds a ``text`` coordinate
    ga.store.texts("train.zarr")                       # {id: text} recorded with the store (or None)

See docs/store.md for the layout, the metadata and the guarantees.
"""
from ..errors import StoreCorruptError, StoreIncompleteError, StoreMismatchError
from .integrity import VerifyReport, verify
from .describe import model_fingerprint
from .gradients import dataset, open_gradients, write
from .operators import open_operator, write_operator
from .scores import ScoreStore, open_scores, write_scores
from .gradient_index import GradientIndex, index, open_index
from .documents import texts
from ..api import register_path_sink

register_path_sink(ScoreStore)   # S.compute(store="scores.zarr", chunk_rows=) writes through a ScoreStore

open = open_gradients  # noqa: A001 - ga.store.open reads like the other stores' APIs

__all__ = ["write", "open", "open_gradients", "dataset", "write_operator", "open_operator", "write_scores",
           "open_scores", "ScoreStore", "index", "open_index", "GradientIndex", "model_fingerprint", "texts", "verify", "VerifyReport", "StoreMismatchError", "StoreIncompleteError",
           "StoreCorruptError"]
