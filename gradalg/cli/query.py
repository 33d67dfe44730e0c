"""``gradalg query``: scores of new queries against a built store.

The queries (``[data.queries]``) are differentiated and projected like the training
set was (same model, task, layers and projector: a store built from anything else is
refused, exit 3), then scored against the stored rows without reading the training
data: ``similarity = "dot"`` (P(q)·P(z)), ``"cos"``, or ``"influence"`` (the stored rows'
Fisher, damped, inverted). Written to ``[query].output``: ``.zarr`` (resumable score
store, or the top k), ``.csv`` or ``.parquet`` (long tables), with the provenance.
"""
from __future__ import annotations

import logging
import time

from .common import add_common, command_parser, load, options_for

__all__ = ["add_parser", "run", "check_store", "open_store"]

log = logging.getLogger("gradalg.cli")

EXAMPLE = """\
  # run.toml (with the [model], [data.train], [projector] and [store] of `gradalg build`)
  [data.queries]
  path = "data/queries.jsonl"
  [query]
  output = "out/scores.parquet"          # .zarr, .csv or .parquet
  top_k = 10                             # optional: the 10 best training examples per query
  similarity = "dot"                     # dot, cos or influence (damping = 1e-3)

  $ gradalg build -c run.toml && gradalg query -c run.toml
  $ gradalg query -c run.toml --set query.output=out/all.zarr --set query.top_k=0   # 0: every score
"""


def add_parser(sub):
    p = command_parser(sub, "query", help="score new queries against a store", description=__doc__, example=EXAMPLE)
    add_common(p)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.set_defaults(run=run)
    return p


def check_store(stored_attrs: dict, Q, path, *, weights: bool = True) -> None:
    """Refuse (StoreMismatchError) a store whose rows were not made like ``Q``'s: same
    projector, layers, objective, backend, model fingerprint (unless not ``weights``:
    a meta-device model for a plan) and blocks."""
    from ..store import layout
    from ..store.gradients import describe_gradients

    expected = describe_gradients(Q)
    keys = ("projector", "layers", "objective", "backend") + (("model_fingerprint",) if weights else ()) + ("blocks",)
    layout.compare(stored_attrs, expected, keys, "the config's queries",
                   f"build {path} from this config (gradalg build), or point store.path at the store built "
                   "from this model, layers and projector")


def open_store(path, cfg):
    """``ga.store.open(path)`` with the fixes a shell user runs (exit 4 when unusable)."""
    from pathlib import Path

    import gradalg as ga
    from ..errors import StoreIncompleteError

    if not Path(path).exists():
        raise FileNotFoundError(f"no store at {path} (store.path): build it first with "
                                f"`gradalg build -c {cfg.source}`")
    try:
        return ga.store.open(path)
    except StoreIncompleteError as err:
        raise StoreIncompleteError(f"{err} — from the shell: `gradalg build -c {cfg.source}` finishes it") from None


def run(args) -> int:
    from .outputs import write_scores
    from .provenance import record
    from .session import Session

    cfg = load(args)
    cfg.require("model", "data.queries", "store", "query", command="query")
    path = cfg.resolve(cfg.store.path)
    session = Session(cfg)
    top = cfg.query.top_k or None
    with options_for(cfg, args):
        stored = open_store(path, cfg)
        Q = session.grads("queries")
        check_store(dict(stored.expr.store.attrs), Q, path)
        S = session.query_scores(stored)
        output = cfg.resolve(cfg.query.output)
        start = time.monotonic()
        with session.executor() as executor:
            summary = write_scores(S, output, provenance=record(cfg, "query"), top=top,
                                   chunk_rows=cfg.query.chunk_rows, overwrite=args.overwrite, executor=executor)
    log.info("scored %d queries against %d stored rows (%s): %s in %.1f s", S.shape[0], S.shape[1],
             cfg.query.similarity, summary["path"], time.monotonic() - start)
    return 0
