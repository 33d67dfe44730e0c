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

__all__ = ["add_parser", "run", "check_store", "open_store", "other_models"]

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
  $ gradalg query -c run.toml --interactive --k 5 --max-new-tokens 20   # type prompts; :save s.csv, :quit
  $ printf 'def parse(\\n:save out/s.csv\\n' | gradalg query -c run.toml --interactive   # scripted
"""


def add_parser(sub):
    p = command_parser(sub, "query", help="score new queries against a store", description=__doc__, example=EXAMPLE)
    add_common(p)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("-i", "--interactive", action="store_true",
                   help="a prompt loop on stdin: generation, top and bottom documents per prompt")
    p.add_argument("--k", type=int, default=None, help="--interactive: documents listed at each end "
                   "(default query.top_k, else 5)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="--interactive: longest generated completion "
                   "(greedy; default 32)")
    p.add_argument("--tokenizer", metavar="DIR", help="--interactive: a local tokenizer folder (default "
                   "[data.train].tokenizer, else [data.queries].tokenizer)")
    p.add_argument("--texts", metavar="FILE", help="--interactive: the training texts (.jsonl with a 'text' field "
                   "or .txt, in store order); default: those recorded with the store, else [data.train].text")
    p.set_defaults(run=run)
    return p


def check_store(stored_attrs: dict, Q, path, *, weights: bool = True, other_checkpoint: bool = False) -> None:
    """Refuse (StoreMismatchError) a store whose rows were not made like ``Q``'s: same
    projector, layers, objective, backend and blocks, and the same model fingerprint
    (unless not ``weights``: a meta-device model for a plan; or ``other_checkpoint``:
    ``query.other_checkpoint = true``, the query's weights may differ on purpose)."""
    from ..store import layout
    from ..store.gradients import describe_gradients

    expected = describe_gradients(Q)
    keys = ("projector", "layers", "objective", "backend", "blocks")
    layout.compare(stored_attrs, expected, keys, "the config's queries",
                   f"build {path} from this config (gradalg build), or point store.path at the store built "
                   "from this model, layers and projector")
    if weights and not other_checkpoint:
        layout.compare(stored_attrs, expected, ("model_fingerprint",), "the config's model",
                       f"point [model] at the checkpoint {path} was built from, rebuild the store from this model "
                       "(gradalg build --overwrite), or set query.other_checkpoint = true to score this model's "
                       "query gradients against the stored ones (their meaning: docs/cli.md, 'Another checkpoint')")


def other_models(allowed: bool):
    """``ga.options(check_models=False)`` when ``query.other_checkpoint`` (the query's model
    may be another checkpoint than the store's), else nothing."""
    import contextlib

    from .. import options
    return options(check_models=False) if allowed else contextlib.nullcontext()


def open_store(path, cfg):
    """``ga.store.open(path)`` with the fixes a shell user runs (exit 4 when unusable)."""
    from pathlib import Path

    import gradalg as ga
    from ..errors import StoreIncompleteError, StoreNotFoundError

    if not Path(path).exists():
        raise StoreNotFoundError(f"no store at {path} (store.path): build it first with "
                                f"`gradalg build -c {cfg.source}`")
    try:
        return ga.store.open(path)
    except StoreIncompleteError as err:
        raise StoreIncompleteError(f"{err} — from the shell: `gradalg build -c {cfg.source}` finishes it") from None


def run(args) -> int:
    if args.interactive:
        from .interactive import run_interactive
        return run_interactive(args)
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
        check_store(dict(stored.expr.store.attrs), Q, path, other_checkpoint=cfg.query.other_checkpoint)
        with other_models(cfg.query.other_checkpoint):
            S = session.query_scores(stored)
        output = cfg.resolve(cfg.query.output)
        start = time.monotonic()
        provenance = record(cfg, "query")
        provenance["store_model_fingerprint"] = dict(stored.expr.store.attrs).get("model_fingerprint")
        with session.executor() as executor, other_models(cfg.query.other_checkpoint):
            summary = write_scores(S, output, provenance=provenance, top=top,
                                   chunk_rows=cfg.query.chunk_rows, overwrite=args.overwrite, executor=executor)
    log.info("scored %d queries against %d stored rows (%s): %s in %.1f s", S.shape[0], S.shape[1],
             cfg.query.similarity, summary["path"], time.monotonic() - start)
    return 0
