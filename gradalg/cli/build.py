"""``gradalg build``: the training set's (projected) gradients into a Zarr store.

The store is written by ``ga.store.write``: chunk by chunk, each chunk atomic, so a
build that was interrupted (Ctrl-C, SIGKILL, a lost node) resumes where it stopped
when the same command runs again, and a finished store is left alone (the second run
says so and computes nothing). A store at the path written from another model, data,
layers or projector is refused (exit 3) with the fields that differ. When
``[data.train]`` has a ``text`` column, the texts are recorded beside the store
(``<store>.texts.jsonl``, ``ga.store.texts``): ``gradalg query --interactive`` and the
store's index show the documents, not only their ids.
"""
from __future__ import annotations

import logging
import time

from .common import add_common, command_parser, load, options_for

__all__ = ["add_parser", "run"]

log = logging.getLogger("gradalg.cli")

EXAMPLE = """\
  # run.toml
  [model]
  class = "GPT2LMHeadModel"
  checkpoint = "checkpoints/final"       # or config = "tiny_gpt2" (random init), factory = "pkg.mod:fn"
  [data.train]
  path = "data/train.jsonl"              # {"input_ids": [...]} per line; or .parquet, a datasets folder
  [projector]
  kind = "kron"
  k = 64
  [store]
  path = "out/train.zarr"
  chunk_rows = 256

  $ gradalg build -c run.toml            # interrupted? run it again: it resumes
"""


def add_parser(sub):
    p = command_parser(sub, "build", help="write the training gradients to a store (resumable)",
                       description=__doc__, example=EXAMPLE)
    add_common(p)
    p.add_argument("--overwrite", action="store_true",
                   help="replace a store at the path that was written from something else")
    p.add_argument("--verify", action="store_true",
                   help="on a finished store, read every chunk and check its checksum (damaged chunks are rewritten)")
    p.add_argument("--progress-interval", type=float, default=30.0, metavar="SECONDS",
                   help="seconds between progress lines when stderr is not a terminal (default 30)")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    import gradalg as ga
    from ..errors import StoreMismatchError
    from ..store import layout
    from .monitor import ChunkMonitor
    from .provenance import ATTRIBUTE, record
    from .report import _config_texts
    from .session import Session

    cfg = load(args)
    cfg.require("model", "data.train", "store", command="build")
    path = cfg.resolve(cfg.store.path)
    chunk_rows = cfg.store.chunk_rows
    session = Session(cfg)
    texts = _config_texts(cfg, "train")
    # the chunk monitor reports progress: the per-pass bars of every chunk would be noise
    with options_for(cfg, args, progress=False):
        G = session.grads("train")
        n = G.n
        chunks = layout.n_chunks(n, chunk_rows)
        before = None if args.overwrite else _done_before(path)
        if before is not None:
            log.info("store %s exists: %d of %d chunks written; checking it matches the config", path, before, chunks)
        start = time.monotonic()
        with session.executor() as executor, \
                ChunkMonitor(path, chunks, chunk_rows, n, enabled=not args.quiet, interval=args.progress_interval):
            try:
                ga.store.write(G, path, chunk_rows=chunk_rows, overwrite=args.overwrite, verify=args.verify,
                               executor=executor, metadata={ATTRIBUTE: record(cfg, "build")}, texts=texts)
            except StoreMismatchError as err:
                raise StoreMismatchError(err.differences, f"{path} was built from something else: pass --overwrite "
                                         "to replace it, or set store.path to another folder") from None
    seconds = time.monotonic() - start
    dim = sum(b.dim for b in G.space.blocks)
    if before == chunks and not args.verify:
        log.info("store %s is complete and matches the config (%d rows × %d coordinates): nothing to do",
                 path, n, dim)
    else:
        verb = "resumed" if before else "wrote"
        log.info("%s %s: %d rows × %d coordinates in %d chunks, %.1f s", verb, path, n, dim, chunks, seconds)
    return 0


def _done_before(path):
    """Chunks done in an existing store at ``path`` (None when there is no store)."""
    from pathlib import Path

    from .monitor import done_count

    if not Path(path).exists():
        return None
    return done_count(path) or 0
