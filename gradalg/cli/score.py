"""``gradalg score``: a published method end to end, ``ga.methods.<name>``.

``[method]`` names the method (grad_dot, grad_cos, influence, trak, logra, grass,
relatif) and its options; the model, task, layers and ``[projector]`` (for the
methods that take one) come from the rest of the config. The scores of the queries
against the training set go to ``[score].output`` (.zarr: a resumable score store,
.csv / .parquet: long tables; ``top_k`` keeps the best per query), with the provenance.
"""
from __future__ import annotations

import logging
import time

from .common import add_common, command_parser, load, options_for

__all__ = ["add_parser", "run"]

log = logging.getLogger("gradalg.cli")

EXAMPLE = """\
  # run.toml (with [model], [data.train] and [data.queries])
  [method]
  name = "influence"
  options = { curvature = "ekfac", damping = 1e-3 }
  [projector]                            # used by influence / grad_dot / grad_cos / trak / relatif
  kind = "kron"
  k = 64
  [score]
  output = "out/influence.zarr"

  $ gradalg score -c run.toml
  $ gradalg score -c run.toml --set method.name=logra --set 'method.options={k=16}' \\
        --set score.output=out/logra.csv
"""


def add_parser(sub):
    p = command_parser(sub, "score", help="run a method end to end (ga.methods)", description=__doc__,
                       example=EXAMPLE)
    add_common(p)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from .outputs import write_scores
    from .provenance import record
    from .session import Session

    cfg = load(args)
    cfg.require("model", "data.train", "data.queries", "method", "score", command="score")
    session = Session(cfg)
    with options_for(cfg, args):
        S = session.method_scores()
        start = time.monotonic()
        with session.executor() as executor:
            summary = write_scores(S, cfg.resolve(cfg.score.output), provenance=record(cfg, "score"),
                                   top=cfg.score.top_k or None, chunk_rows=cfg.score.chunk_rows,
                                   overwrite=args.overwrite, executor=executor)
    log.info("%s: %d queries × %d training examples → %s in %.1f s", cfg.method.name, S.shape[0], S.shape[1],
             summary["path"], time.monotonic() - start)
    return 0
